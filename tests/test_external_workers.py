"""Registered vLLM servers (started elsewhere, driven by this service), with the stub server
in its own process standing in for a server on another host."""

from __future__ import annotations

import contextlib
import html
import json
import os
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.control.queue import PLACE_AHEAD
from service.storage.db import make_engine
from tests.conftest import TESTS, make_client, wait_answering, wait_finished, wait_for
from tests.ports import free_port

MODEL = "acme/remote-8b"
SMALL = {"model": MODEL, "input_len": 64, "output_len": 8, "num_prompts": 6, "max_concurrency": 2}


# The connector config each registered URL was given, for stubs started (or restarted) after
# their registration, as a user restarts vLLM with the config the registration answers.
KV_CONFIGS: dict[str, dict[str, Any]] = {}


class RemoteStub:
    """A stub vLLM server the test starts and stops itself, as a user would on another host."""

    def __init__(self, port: int, served: str = MODEL, args: Sequence[str] = (), **env: str) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, str(TESTS / "stub_vllm.py"), "--served-model-name", served,
                "--host", "127.0.0.1", "--port", str(port), *args]
        if self.url in KV_CONFIGS:
            argv += ["--kv-transfer-config", json.dumps(KV_CONFIGS[self.url])]
        # A process group of its own, to be stopped whole; in the suite's session, as the
        # service under test that times it (a session is a CPU share of its own).
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, process_group=0,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = self.proc
        wait_answering(f"{self.url}/health", 30, 0.05, "the stub server",
                       ended=lambda: None if proc.poll() is None else "the stub server exited")

    def requests_seen(self) -> int:
        return int(httpx.get(f"{self.url}/stub/requests", timeout=5).json()["requests"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def remotes() -> Iterator[Callable[..., RemoteStub]]:
    started: list[RemoteStub] = []

    def start(port: int | None = None, served: str = MODEL, args: Sequence[str] = (),
              **env: str) -> RemoteStub:
        stub = RemoteStub(port or free_port(), served, args, **env)
        started.append(stub)
        return stub

    yield start
    for stub in started:
        stub.stop()


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with make_client(tmp_path, worker_probe_s=0.2) as c:
        yield c


def _register(client: TestClient, url: str, **extra: Any) -> dict[str, Any]:
    response = client.post("/api/workers", json={"url": url, "model": MODEL, **extra})
    assert response.status_code == 201, response.text
    # The server loads the connector config the registration answers (a real vLLM server
    # is started with it); a stub that is not up yet gets it when the test starts it.
    KV_CONFIGS[url.rstrip("/")] = response.json()["kv_transfer_config"]
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{url}/stub/connector", json=response.json()["kv_transfer_config"], timeout=5)
    return dict(response.json())


def _worker(client: TestClient, worker_id: str, status: str, timeout: float = 20,
            error: str | None = None) -> dict[str, Any]:
    """The worker once it has ``status`` (and an error containing ``error``, when given)."""
    deadline = time.monotonic() + timeout
    while True:
        worker = client.get(f"/api/workers/{worker_id}").json()
        if worker["status"] == status and (error is None or error in (worker["error"] or "")):
            return dict(worker)
        assert time.monotonic() < deadline, f"worker never became {status} ({error}): {worker}"
        time.sleep(0.05)


class Silent:
    """A port that takes connections and closes them unanswered, as a server that does not
    answer, and counts them: each probe of the service is one. ``close`` is when and how:
    "at once" (whether the request's bytes came first is a race), "after the request" (a
    clean end of stream) or "reset after the request" (the client reads a reset)."""

    def __init__(self, port: int, close: str = "at once") -> None:
        self.how = close
        self.sock = socket.create_server(("127.0.0.1", port))
        self.sock.settimeout(0.05)
        self.connections = 0
        self._open = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self._open:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            if self.how != "at once":
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
            if self.how == "reset after the request":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            self.connections += 1

    def wait_connections(self, count: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while self.connections < count:
            assert time.monotonic() < deadline, f"{self.connections} connections, not {count}"
            time.sleep(0.02)

    def close(self) -> None:
        self._open = False
        self._thread.join()
        self.sock.close()


def test_a_run_longer_than_a_registered_server_takes_is_a_422(
        client: TestClient, remotes: Callable[..., RemoteStub]) -> None:
    remote = remotes(args=["--max-model-len", "64"])
    registered = _register(client, remote.url)
    assert _worker(client, registered["id"], "ready")["max_model_len"] == 64  # as /v1/models said
    long = client.post("/api/runs", json={"model": MODEL, "input_len": 60, "output_len": 8})
    assert long.status_code == 422, long.text
    assert f"max_model_len of the registered server {remote.url}" in long.text
    assert "needs 68 tokens, more than the model's max length 64" in long.text
    fits = client.post("/api/runs", json={"model": MODEL, "input_len": 48, "output_len": 8,
                                          "num_prompts": 2})
    assert fits.status_code == 201, fits.text
    assert wait_finished(client, fits.json()["id"])["status"] == "succeeded"


def test_registered_server_takes_the_runs_of_its_model_and_engine(
    client: TestClient, remotes: Callable[..., RemoteStub]
) -> None:
    remote = remotes()
    registered = _register(client, remote.url)
    assert registered["external"] is True and registered["status"] == "unavailable"
    worker = _worker(client, registered["id"], "ready")
    assert worker["kv_tokens"] == 100_000 * 16  # read from the server's /metrics
    assert worker["last_seen_at"] is not None

    run = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert run["status"] == "succeeded", run["error"]
    assert run["worker_id"] == registered["id"]
    assert run["progress"] == {"completed": 6, "failed": 0, "total": 6}
    assert remote.requests_seen() == 6
    # No server was started here for it: the registered one is the only worker.
    assert [w["id"] for w in client.get("/api/workers").json()] == [registered["id"]]
    assert client.get(f"/api/workers/{registered['id']}").json()["runs_served"] == 1
    page = client.get(f"/runs/{run['id']}")
    assert page.status_code == 200
    assert registered["id"] in page.text and "registered server, started elsewhere" in page.text


def test_runs_spread_over_registered_servers_of_one_kind(
    client: TestClient, remotes: Callable[..., RemoteStub]
) -> None:
    slow = {"STUB_TOKEN_INTERVAL_S": "0.05"}
    first, second = remotes(**slow), remotes(**slow)
    ids = {_register(client, first.url)["id"], _register(client, second.url)["id"]}
    for worker_id in ids:
        _worker(client, worker_id, "ready")
    spec = {**SMALL, "output_len": 20, "num_prompts": 4}
    runs = [client.post("/api/runs", json=spec).json()["id"] for _ in range(2)]
    both = [wait_for(client, r, lambda run: run["status"] == "running") for r in runs]
    assert {run["worker_id"] for run in both} == ids  # side by side, one per server
    assert all(wait_finished(client, r)["status"] == "succeeded" for r in runs)


def test_unreachable_server_is_unavailable_and_its_runs_wait_until_it_answers(
    client: TestClient, remotes: Callable[..., RemoteStub]
) -> None:
    port = free_port()
    silent = Silent(port)
    registered = _register(client, f"http://127.0.0.1:{port}")
    error = _worker(client, registered["id"], "unavailable", error="no answer")["error"]
    assert error == f"no answer from http://127.0.0.1:{port}: it closed the connection without answering"
    index = client.get("/").text
    assert registered["id"] in index and "registered" in index and html.escape(error) in index
    run_id = client.post("/api/runs", json=SMALL).json()["id"]
    probed = silent.connections
    # The scheduler went over it: a local run queued after it (runs are taken oldest first)
    # is placed and ends. And two whole probe rounds came after it was queued.
    local = client.post("/api/runs", json={**SMALL, "model": "decodebench-tiny"}).json()["id"]
    assert wait_finished(client, local)["status"] == "succeeded"
    silent.wait_connections(probed + 3)
    assert client.get(f"/api/runs/{run_id}").json()["status"] == "queued"
    assert client.get(f"/api/workers/{registered['id']}").json()["error"] == error  # round after round

    silent.close()
    remotes(port)
    _worker(client, registered["id"], "ready")
    run = wait_finished(client, run_id)
    assert run["status"] == "succeeded", run["error"]
    assert run["worker_id"] == registered["id"]


def test_one_cause_of_no_answer_reads_the_same_however_the_close_reaches_the_probe(
    client: TestClient,
) -> None:
    # A port that closes unanswered makes httpx raise a protocol error (a clean end of stream)
    # or a read error (a reset), as the close and the request race: the user reads one cause.
    ports = {how: free_port() for how in ("after the request", "reset after the request")}
    silents = [Silent(port, close=how) for how, port in ports.items()]
    refused = free_port()  # nothing listens there
    try:
        ids = {port: _register(client, f"http://127.0.0.1:{port}")["id"]
               for port in [*ports.values(), refused]}
        errors = {port: _worker(client, worker_id, "unavailable", error="no answer")["error"]
                  for port, worker_id in ids.items()}
    finally:
        for silent in silents:
            silent.close()
    for port in ports.values():
        closed = f"no answer from http://127.0.0.1:{port}: it closed the connection without answering"
        assert errors[port] == closed
    assert errors[refused].startswith(f"no answer from http://127.0.0.1:{refused}: could not connect")


def test_a_run_waiting_for_a_registered_server_does_not_hold_up_other_runs(
    client: TestClient,
) -> None:
    registered = _register(client, f"http://127.0.0.1:{free_port()}")
    _worker(client, registered["id"], "unavailable")
    waiting = client.post("/api/runs", json=SMALL).json()["id"]
    local = client.post("/api/runs", json={**SMALL, "model": "decodebench-tiny"}).json()["id"]
    assert wait_finished(client, local)["status"] == "succeeded"
    assert client.get(f"/api/runs/{waiting}").json()["status"] == "queued"


def test_any_number_of_runs_waiting_for_a_registered_server_do_not_hold_up_a_run_behind(
    client: TestClient,
) -> None:
    registered = _register(client, f"http://127.0.0.1:{free_port()}")
    _worker(client, registered["id"], "unavailable")
    # More than one pass of the scheduler reads at first, and more than twice that.
    waiting = [client.post("/api/runs", json=SMALL).json()["id"] for _ in range(3 * PLACE_AHEAD + 1)]
    local = client.post("/api/runs", json={**SMALL, "model": "decodebench-tiny"}).json()["id"]
    assert wait_finished(client, local, timeout=60)["status"] == "succeeded"
    assert client.get("/api/runs", params={"status": "queued"}).json()["total"] == len(waiting)


def test_server_that_dies_mid_run_fails_that_run_only_and_comes_back(
    client: TestClient, remotes: Callable[..., RemoteStub]
) -> None:
    port = free_port()
    crashing = remotes(port, STUB_CRASH_AFTER="3", STUB_TOKEN_INTERVAL_S="0.02")
    registered = _register(client, crashing.url)
    _worker(client, registered["id"], "ready")
    run = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert run["status"] == "failed"
    assert "stopped answering" in run["error"]
    assert "its log is on the host that runs it" in run["error"]
    # Not forgotten, not failed: unavailable, and back once it answers again.
    assert client.get(f"/api/workers/{registered['id']}").json()["status"] == "unavailable"
    next_run = client.post("/api/runs", json=SMALL).json()["id"]
    remotes(port)
    done = wait_finished(client, next_run)
    assert done["status"] == "succeeded", done["error"]
    assert done["worker_id"] == registered["id"]


def test_a_server_gone_since_its_last_probe_leaves_the_run_queued_not_failed(
    tmp_path: Path, remotes: Callable[..., RemoteStub]
) -> None:
    with make_client(tmp_path, worker_probe_s=2) as client:
        port = free_port()
        remote = remotes(port)
        registered = _register(client, remote.url)
        _worker(client, registered["id"], "ready")
        remote.stop()  # the probe that just passed is the last one for a while
        run_id = client.post("/api/runs", json=SMALL).json()["id"]
        # The run was placed on the server, and its runner found it gone and let the run be.
        _worker(client, registered["id"], "unavailable",
                error="did not answer /health as a run was about to start")
        assert client.get(f"/api/runs/{run_id}").json()["status"] == "queued"
        remotes(port)
        run = wait_finished(client, run_id)
        assert run["status"] == "succeeded", run["error"]


def test_server_serving_another_model_is_unavailable_with_the_reason(
    client: TestClient, remotes: Callable[..., RemoteStub]
) -> None:
    remote = remotes(served="acme/some-other-model")
    registered = _register(client, remote.url)
    worker = _worker(client, registered["id"], "unavailable")
    assert "acme/some-other-model" in worker["error"] and MODEL in worker["error"]


def test_registration_answers_the_exact_vllm_serve_line_with_the_worker_token(
    client: TestClient,
) -> None:
    port = free_port()  # nothing listens there: only the answer matters
    registered = _register(
        client, f"http://127.0.0.1:{port}", control_url="http://bench.internal:8000",
        engine={"tensor_parallel_size": 2, "max_model_len": 65536,
                "extra_args": ["--max-num-seqs=32"]},
    )
    token = registered["token"]
    assert len(token) >= 32
    extra = registered["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["worker_token"] == token
    assert extra["control_url"] == "http://bench.internal:8000"
    assert registered["kv_transfer_config"]["kv_connector"] == "FillConnector"
    line = registered["vllm_serve"]
    assert line.startswith(f"vllm serve {MODEL} --served-model-name {MODEL} ")
    for part in (f"--port {port}", "--tensor-parallel-size 2", "--max-model-len 65536",
                 "--max-num-seqs=32", token):
        assert part in line
    # The token is shown once: listing workers never shows it.
    assert token not in client.get("/api/workers").text


def test_a_chosen_token_is_used_and_opens_the_connector_endpoints_for_its_runs(
    client: TestClient, remotes: Callable[..., RemoteStub]
) -> None:
    token = "k8s-secret-" + "x" * 32
    remote = remotes()
    registered = _register(client, remote.url, token=token)
    assert registered["token"] == token
    _worker(client, registered["id"], "ready")
    run = wait_finished(client, client.post("/api/runs", json={**SMALL, "fill": {"mean": 0.25}})
                        .json()["id"])
    worker_auth = {"Authorization": f"Bearer {token}"}
    pulled = client.get(f"/api/connector/fill?run_id={run['id']}", headers=worker_auth)
    assert pulled.status_code == 200
    assert pulled.json() == {"run_id": run["id"], "mode": "fill", "mean": 0.25, "std": 0.0}
    # After removal the token opens nothing.
    assert client.delete(f"/api/workers/{registered['id']}").status_code == 204
    again = client.get(f"/api/connector/fill?run_id={run['id']}", headers=worker_auth)
    assert again.status_code == 403


def test_removed_server_takes_no_runs_and_cannot_be_removed_twice(
    client: TestClient, remotes: Callable[..., RemoteStub]
) -> None:
    remote = remotes()
    registered = _register(client, remote.url)
    _worker(client, registered["id"], "ready")
    assert client.delete(f"/api/workers/{registered['id']}").status_code == 204
    assert client.get(f"/api/workers/{registered['id']}").json()["status"] == "removed"
    again = client.delete(f"/api/workers/{registered['id']}")
    assert again.status_code == 404 and "no registered worker" in again.json()["detail"]
    assert client.delete("/api/workers/w-000000000000").status_code == 404
    # The same URL may be registered again once the old entry is gone.
    assert client.post("/api/workers", json={"url": remote.url, "model": MODEL}).status_code == 201
    assert remote.requests_seen() == 0


def test_a_server_busy_with_a_run_cannot_be_removed(
    client: TestClient, remotes: Callable[..., RemoteStub]
) -> None:
    remote = remotes(STUB_TOKEN_INTERVAL_S="0.05")
    registered = _register(client, remote.url)
    _worker(client, registered["id"], "ready")
    run_id = client.post("/api/runs", json={**SMALL, "output_len": 40}).json()["id"]
    wait_for(client, run_id, lambda r: r["status"] == "running")
    busy = client.delete(f"/api/workers/{registered['id']}")
    assert busy.status_code == 409 and run_id in busy.json()["detail"]
    assert wait_finished(client, run_id)["status"] == "succeeded"


def test_a_worker_the_service_started_cannot_be_removed(client: TestClient) -> None:
    run = wait_finished(client, client.post("/api/runs", json={**SMALL, "model": "decodebench-tiny"})
                        .json()["id"])
    response = client.delete(f"/api/workers/{run['worker_id']}")
    assert response.status_code == 409
    assert "started by this service" in response.json()["detail"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"url": "ftp://127.0.0.1:21", "model": MODEL}, "http:// or https://"),
        ({"url": "http://user:pw@127.0.0.1:8000", "model": MODEL}, "no user"),
        ({"url": "http://127.0.0.1:8000/?x=1", "model": MODEL}, "no user, query"),
        ({"url": "http://127.0.0.1:99999", "model": MODEL}, "port"),
        ({"url": "http://bad_host!:8000", "model": MODEL}, "not a host name"),
        ({"url": "http://127.0.0.1:8000", "model": "../../etc"}, "served-model-name"),
        ({"url": "http://127.0.0.1:8000", "model": MODEL, "token": "short"}, "at least 32"),
        ({"url": "http://127.0.0.1:8000"}, "Field required"),
        ({"url": "http://127.0.0.1:8000", "model": MODEL, "engine": {"extra_args": ["--x"]}},
         "not allowed"),
    ],
)
def test_bad_registrations_are_422_with_the_reason(
    shared_client: TestClient, body: dict[str, Any], message: str
) -> None:
    response = shared_client.post("/api/workers", json=body)
    assert response.status_code == 422
    assert message in str(response.json()["detail"])
    assert shared_client.get("/api/workers").json() == []


def test_the_same_url_twice_is_409(client: TestClient) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    _register(client, url)
    response = client.post("/api/workers", json={"url": url + "/", "model": MODEL})
    assert response.status_code == 409 and "registered already" in response.json()["detail"]


def test_registering_needs_the_api_token(tmp_path: Path) -> None:
    with make_client(tmp_path) as client:
        body = {"url": "http://127.0.0.1:8000", "model": MODEL}
        assert client.post("/api/workers", json=body, headers={"Authorization": ""}).status_code == 401
        assert client.get("/api/workers").json() == []


def test_registered_servers_survive_a_restart_of_the_service(
    tmp_path: Path, remotes: Callable[..., RemoteStub]
) -> None:
    remote = remotes()
    # The service comes back at the same address: the server's connector keeps reaching it.
    control_url = f"http://127.0.0.1:{free_port()}"
    with make_client(tmp_path, worker_probe_s=0.2, control_url=control_url) as client:
        registered = _register(client, remote.url)
        _worker(client, registered["id"], "ready")
    with make_client(tmp_path, worker_probe_s=0.2, control_url=control_url) as client:
        _worker(client, registered["id"], "ready")
        run = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
        assert run["status"] == "succeeded" and run["worker_id"] == registered["id"]
    # The service's shutdown left the server it did not start running.
    assert remote.proc.poll() is None


def test_an_older_database_gets_the_new_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    with make_client(tmp_path) as client:
        run = wait_finished(client, client.post("/api/runs", json={**SMALL, "model": "decodebench-tiny"})
                            .json()["id"])
    db = tmp_path / "var" / "decodebench.sqlite3"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("DROP TABLE alembic_version")  # older than schema migrations
        for column in ("external", "vocab_size", "last_seen_at"):
            conn.execute(f"ALTER TABLE worker DROP COLUMN {column}")
        conn.commit()
    make_engine(db).dispose()
    with make_client(tmp_path) as client:
        worker = client.get(f"/api/workers/{run['worker_id']}").json()
        assert worker["external"] is False and worker["status"] == "stopped"
        assert client.get(f"/api/runs/{run['id']}").json()["status"] == "succeeded"
