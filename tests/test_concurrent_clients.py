"""Many clients of one service at once, over real HTTP to a real service process: submits
with idempotency keys, reads and cancels beside the scheduler's writes, and connections kept
alive as long as an HTTP client reuses them."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import AUTH, wait_for
from tests.service_process import ServiceProcess


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceProcess]:
    proc = ServiceProcess(tmp_path / "var", {"STUB_TOKEN_INTERVAL_S": "0.001"})
    proc.start()
    yield proc
    proc.stop()


def test_concurrent_posts_with_idempotency_keys_create_one_run_per_key(service: ServiceProcess) -> None:
    body = {"input_len": 8, "output_len": 2, "num_prompts": 1}

    def post(i: int) -> tuple[int, str]:
        r = http.post("/api/runs", json=body, headers={"Idempotency-Key": f"key-{i % 50}"})
        return r.status_code, r.json()["id"]

    # One client (its pool has a connection for each thread) for the 200 posts.
    with service.client() as http, ThreadPoolExecutor(32) as pool:
        results = list(pool.map(post, range(200)))
    assert {code for code, _ in results} <= {200, 201}
    assert sum(code == 201 for code, _ in results) == 50
    assert len({run_id for _, run_id in results}) == 50
    assert httpx.get(f"{service.url}/api/runs?limit=500", headers=AUTH).json()["total"] == 50


def test_an_idle_kept_alive_connection_outlives_an_http_clients_own_expiry(service: ServiceProcess) -> None:
    # httpx (the CLI's and the connector's client) reuses a connection idle up to 5 s. A
    # service that closed it at 5 s could close it under a request just sent on it, which
    # then fails with "Server disconnected without sending a response".
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{service.port}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", service.port), timeout=30) as conn:
        for _ in range(2):
            conn.sendall(request)
            data = b""
            while True:
                chunk = conn.recv(4096)
                assert chunk, "the service closed the kept-alive connection"
                data += chunk
                head, found, body = data.partition(b"\r\n\r\n")
                fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
                if found and len(body) >= int(fields.get(b"content-length", b"0")):
                    break
            assert head.startswith(b"HTTP/1.1 200"), head
            time.sleep(6)


# Twelve clients at once, each this many rounds of submit, read, list (and a cancel every
# third round): every round of all twelve overlaps the others' writes and the scheduler's.
ROUNDS = 8


def test_many_clients_and_the_scheduler_never_hit_a_locked_database(service: ServiceProcess) -> None:
    def client(i: int) -> list[int]:
        codes = []
        with service.client() as c:
            for j in range(ROUNDS):
                r = c.post("/api/runs", json={"input_len": 8, "output_len": 2, "num_prompts": 2})
                codes.append(r.status_code)
                run_id = r.json()["id"]
                codes.append(c.get(f"/api/runs/{run_id}").status_code)
                codes.append(c.get("/api/runs?limit=20").status_code)
                if j % 3 == 0:
                    codes.append(c.post(f"/api/runs/{run_id}/cancel").status_code)
        return codes

    with ThreadPoolExecutor(12) as pool:
        codes = [code for result in pool.map(client, range(12)) for code in result]
    assert all(code < 500 for code in codes), sorted(set(codes))
    assert set(codes) <= {200, 201, 409}
    runs = httpx.get(f"{service.url}/api/runs?limit=500", headers=AUTH).json()
    assert runs["total"] == 12 * ROUNDS
    # The scheduler kept working through it all: every run ends (or is on its way). About
    # 64 runs go one after the other, each with a load driver process of its own.
    with service.client() as c:
        wait_for(c, runs["runs"][0]["id"], lambda r: r["status"] in {"succeeded", "cancelled"},
                 timeout=300)
    assert "locked" not in service.log()
