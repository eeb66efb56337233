"""Stopping the service (SIGTERM to ``python -m service``) leaves no vLLM process running,
whatever phase of its start a server was in.

Each stub server here ignores SIGTERM (as vLLM's API server can, stuck in its engine's
start or shutdown), so only the SIGKILL after the stop grace ends it, and the runs get
less time to stop (``DECODEBENCH_SHUTDOWN_WAIT_S``) than a stop takes: the shutdown must
not depend on the runner of a start getting to finish its stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.control.procs import rpc_dir
from tests.service_process import ServiceProcess, group_pids

GRACE_S = 2.0


def _zombies(pgid: int) -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            count += int(fields[2]) == pgid and fields[0] == "Z"
    return count


def _ignores_sigterm(pid: int) -> bool:
    """True once the stub has set SIGTERM aside (before that, one would kill it at once)."""
    with contextlib.suppress(OSError, StopIteration):
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        ignored = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
        return bool(ignored & 1 << (signal.SIGTERM - 1))
    return False


def _listening(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
        return True
    return False


def _health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code
    except httpx.HTTPError:
        return None


# phase: (the stub's behaviour, how to tell the server is in that phase)
PHASES: dict[str, tuple[dict[str, str], Callable[[dict[str, Any]], bool]]] = {
    "before its port answers": (
        {"STUB_LISTEN_AFTER_S": "inf"},
        lambda w: not _listening(w["url"])),
    "while its engine loads": (  # vLLM binds its port first, and answers nothing until ready
        {"STUB_SILENT_PORT": "1", "STUB_ENGINE": "alive"},
        lambda w: len(group_pids(w["pid"])) == 2 and _listening(w["url"])),
    "while it profiles memory": (  # listening, /health not 200 yet
        {"STUB_STARTUP_DELAY_S": "inf", "STUB_ENGINE": "alive"},
        lambda w: len(group_pids(w["pid"])) == 2 and _health(w["url"]) == 503),
    "after its engine died and its API server hangs": (
        {"STUB_SILENT_PORT": "1", "STUB_ENGINE": "dead"},
        lambda w: _zombies(w["pid"]) == 1 and _listening(w["url"])),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_stopping_the_service_stops_a_server_in_every_phase_of_its_start(tmp_path: Path, phase: str) -> None:
    env, reached = PHASES[phase]
    service = ServiceProcess(tmp_path / "var", {
        **env, "STUB_IGNORE_SIGTERM": "1",
        "DECODEBENCH_WORKER_STOP_GRACE_S": str(GRACE_S), "DECODEBENCH_SHUTDOWN_WAIT_S": "0.5",
    })
    service.start()
    pgid = None
    try:
        with service.client() as c:
            c.post("/api/runs", json={"input_len": 16, "output_len": 8, "num_prompts": 2})
            deadline = time.monotonic() + 30
            while True:
                workers = c.get("/api/workers").json()
                if workers and workers[0]["pid"]:
                    worker = workers[0]
                    pgid = worker["pid"]
                    if _ignores_sigterm(pgid) and reached(worker):
                        break
                assert time.monotonic() < deadline, f"the server never got {phase}"
                time.sleep(0.1)
        assert worker["status"] == "starting"
        # vLLM's sockets go in a directory of the server's own, not loose in the temp dir.
        assert rpc_dir(worker["id"]).is_dir()
        assert service.proc is not None
        started = time.monotonic()
        service.proc.send_signal(signal.SIGTERM)
        service.proc.wait(timeout=30)
        took = time.monotonic() - started
        # Gone by the time the service has exited: it waited for the SIGKILL after the grace.
        assert group_pids(pgid) == [], f"left running after the service stopped: {group_pids(pgid)}"
        assert not rpc_dir(worker["id"]).exists()
        assert took < GRACE_S + 8, took
    finally:
        service.stop()
        if pgid is not None and group_pids(pgid):  # never leave a test's processes behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
