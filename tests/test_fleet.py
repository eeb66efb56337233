"""The fleet and the one owner of a run: what a placed run holds is given back whatever way
its runner ends, a stopping server keeps its GPUs until it has stopped, a cancel is the
runner's to carry out, and two servers starting at once never share a port."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from service.control import procs
from service.control.queue import Scheduler
from service.core.status import RunStatus
from service.storage import store
from tests.conftest import make_client, make_settings, wait_finished, wait_for

SMALL = {"input_len": 16, "output_len": 8, "num_prompts": 6, "max_concurrency": 3}


def _until(check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_run_whose_runner_is_cancelled_before_its_first_step_holds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run's task is cancelled in the same pass that placed it, before it ever ran (as a
    # cancel or a shutdown can land). Its placement held this CPU machine's one worker slot.
    original = Scheduler._place_queued
    victims: list[str] = []

    async def place_then_cancel(self: Scheduler) -> None:
        before = set(self._tasks)
        await original(self)
        for run_id, task in self._tasks.items():
            if run_id not in before and not victims:
                victims.append(run_id)
                store.transition(self.engine, run_id, RunStatus.cancelled, error="cancelled by the user")
                task.cancel()

    monkeypatch.setattr(Scheduler, "_place_queued", place_then_cancel)
    with make_client(tmp_path) as client:
        first = client.post("/api/runs", json=SMALL).json()
        _until(lambda: bool(victims))
        assert victims == [first["id"]]
        # The next run gets a worker (it waited forever for the held slot before).
        second = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"], timeout=90)
        assert second["status"] == "succeeded", second["error"]
        # ... and the cancelled run is over: it can be deleted (a 409 forever before).
        assert client.get(f"/api/runs/{first['id']}").json()["status"] == "cancelled"
        assert client.delete(f"/api/runs/{first['id']}").status_code == 204


def test_a_failing_worker_holds_its_gpus_until_its_process_group_has_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Streams hang after 3 tokens and the worker ignores SIGTERM: stopping it takes the whole
    # grace period. One GPU: the next run's worker may start only once the first has stopped.
    monkeypatch.setenv("STUB_HANG_AFTER_TOKENS", "3")
    monkeypatch.setenv("STUB_HANG_HEALTHY", "1")
    monkeypatch.setenv("STUB_IGNORE_SIGTERM", "1")
    short = {**SMALL, "output_len": 2}
    with make_client(tmp_path, gpus="0", stall_s=1, worker_stop_grace_s=3) as client:
        # A run of 2 tokens a stream is served well; the worker stays, idle, on GPU 0.
        warm = wait_finished(client, client.post("/api/runs", json=short).json()["id"], timeout=60)
        assert warm["status"] == "succeeded", warm["error"]
        # The next run reuses it, and hangs it; one more waits behind.
        first = client.post("/api/runs", json=SMALL).json()
        second = client.post("/api/runs", json=short).json()
        a = wait_finished(client, first["id"], timeout=60)
        assert a["status"] == "failed" and "vLLM server hung" in a["error"], a["error"]
        assert a["worker_id"] == warm["worker_id"]
        b = wait_finished(client, second["id"], timeout=60)
        assert b["status"] == "succeeded", b["error"]
        workers = {w["id"]: w for w in client.get("/api/workers").json()}
        old, new = workers[a["worker_id"]], workers[b["worker_id"]]
        assert old["gpus"] == new["gpus"] == "0"
        assert old["status"] == "failed" and old["stopped_at"] is not None
        # The new server started on GPU 0 only after the old one's group was gone.
        assert new["created_at"] >= old["stopped_at"], (old, new)


def test_cancel_of_a_measured_run_is_carried_out_by_its_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.05")
    with make_client(tmp_path) as client:
        spec = {**SMALL, "output_len": 200, "num_prompts": 40, "max_concurrency": 2}
        run = client.post("/api/runs", json=spec).json()
        wait_for(client, run["id"], lambda r: r["progress"]["completed"] >= 1, timeout=60)
        answer = client.post(f"/api/runs/{run['id']}/cancel")
        assert answer.status_code == 200
        # The answer comes once the run has ended: its samples are saved, nothing is in flight.
        ended = answer.json()
        assert ended["status"] == "cancelled" and ended["finished_at"] is not None
        assert ended["progress"]["completed"] >= 1
        kept = client.get(f"/api/runs/{run['id']}/requests").json()
        assert len(kept) == ended["progress"]["completed"] + ended["progress"]["failed"]
        assert client.post(f"/api/runs/{run['id']}/cancel").status_code == 409
        # The worker served the run well: it stays and takes the next.
        again = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"], timeout=60)
        assert again["status"] == "succeeded" and again["worker_id"] == ended["worker_id"]


def test_two_servers_starting_at_once_never_get_the_same_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel hands out the same free port twice in a row (nothing listens on it yet).
    from service.control.fleet import Fleet

    picked: list[int] = []
    real = procs.free_port

    def same_port_twice(taken: set[int], ports: range | None = None) -> int:
        port = picked[0] if picked and picked[0] not in taken else real(taken, ports)
        picked.append(port)
        return port

    monkeypatch.setattr("service.control.local.free_port", same_port_twice)
    settings = make_settings(tmp_path)
    held: dict[str, Any] = {}

    async def start_two() -> list[int]:
        import httpx

        from service.core.spec import RunSpec
        from service.storage.db import make_engine

        engine = make_engine(settings.db_path)
        async with httpx.AsyncClient() as http:
            fleet = Fleet(settings, engine, http)
            spec = RunSpec()
            handles = await asyncio.gather(
                fleet.servers.start(spec, [], lambda h: held.setdefault(h.id, h), set()),
                fleet.servers.start(spec, [], lambda h: held.setdefault(h.id, h), set()),
            )
            try:
                return [h.port for h in handles]
            finally:
                for h in handles:
                    await fleet.servers.stop(h)

    ports = asyncio.run(start_two())
    assert len(set(ports)) == 2, ports


def _free_run_of_ports(count: int) -> int:
    """The first of ``count`` ports in a row that are free now, below the ephemeral range."""
    for low in range(29000, 32000, count):  # above the workers' ranges (tests/ports.py)
        if all(procs.try_bind("127.0.0.1", port) is not None for port in range(low, low + count)):
            return low
    raise AssertionError("no run of free ports found")


def test_servers_listen_on_the_ports_the_setting_names_and_skip_one_in_use(tmp_path: Path) -> None:
    # Another program listens on the range's first port, as a server does (with SO_REUSEADDR):
    # the service's server takes the next one.
    low = _free_run_of_ports(3)
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", low))
        other.listen()
        with make_client(tmp_path, server_ports=f"{low}-{low + 2}") as client:
            done = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"], timeout=60)
            assert done["status"] == "succeeded", done["error"]
            worker = client.get(f"/api/workers/{done['worker_id']}").json()
            assert worker["url"] == f"http://127.0.0.1:{low + 1}"


@pytest.mark.parametrize(("value", "said"), [
    ("20000", "'20000' is not a range of ports: give LOW-HIGH, as 20000-20099"),
    ("20100-20000", "'20100-20000': give 1024 <= LOW <= HIGH <= 65535"),
    ("80-90", "'80-90': give 1024 <= LOW <= HIGH <= 65535"),
])
def test_a_bad_port_range_stops_the_service_saying_why(tmp_path: Path, value: str, said: str) -> None:
    ended = subprocess.run(
        [sys.executable, "-m", "service"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "DECODEBENCH_DATA_DIR": str(tmp_path / "var"), "DECODEBENCH_SERVER_PORTS": value})
    assert ended.returncode == 1
    assert ended.stderr.strip().splitlines()[-1] == f"decodebench: DECODEBENCH_SERVER_PORTS: {said}"


class _OtherProgram(BaseHTTPRequestHandler):
    """Another program on the port a server is to listen on: it answers /health and lists
    another model; it counts the completions sent to it."""

    completions = 0

    def do_GET(self) -> None:
        listed = b'{"object": "list", "data": [{"id": "another-model"}]}'
        body = listed if self.path == "/v1/models" else b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        type(self).completions += 1
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_another_program_answering_on_a_starting_servers_port_is_not_taken_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The system handed the server's port to another program too (as it can between the
    # pick and vLLM's listen): that program answers /health at once, while the server
    # still loads. The server is not taken as ready; it fails to listen and says why.
    _OtherProgram.completions = 0
    other = ThreadingHTTPServer(("127.0.0.1", 0), _OtherProgram)
    port = other.server_address[1]
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr("service.control.local.free_port", lambda taken, ports=None: port)
    try:
        with make_client(tmp_path) as client:
            done = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"], timeout=60)
    finally:
        other.shutdown()
        other.server_close()
    assert done["status"] == "failed"
    assert "address already in use" in done["error"].lower(), done["error"]
    assert _OtherProgram.completions == 0
