"""``docker compose down && docker compose up``: the service gets SIGTERM (through the
container's init) with a run in progress, then starts again on the same data.

The run in progress is failed with a reason (never lost, never silently re-run), what
it measured so far is kept, queued runs go on, and no worker process is left behind.
If the service outlived the stop grace period, compose would SIGKILL it: that path is
tests/test_crash_recovery.py.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.service_process import ServiceProcess, pid_alive

SLOW = {"input_len": 16, "output_len": 100, "num_prompts": 8, "max_concurrency": 2}
COMPOSE = Path(__file__).resolve().parents[1] / "docker" / "compose.yaml"


def compose_stop_grace_s() -> float:
    """How long docker/compose.yaml gives the service between SIGTERM and SIGKILL."""
    grace = yaml.safe_load(COMPOSE.read_text())["x-decodebench"]["stop_grace_period"]
    assert grace.endswith("s") and grace[:-1].isdigit(), grace
    return float(grace[:-1])


def _wait(pred: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_down_fails_the_run_in_progress_with_a_reason_and_up_goes_on(tmp_path: Path) -> None:
    service = ServiceProcess(tmp_path / "var", {"STUB_TOKEN_INTERVAL_S": "0.02"})
    service.start()
    try:
        with service.client() as client:
            running = client.post("/api/runs", json=SLOW).json()["id"]
            queued = client.post("/api/runs", json={**SLOW, "output_len": 4}).json()["id"]

            def some_done() -> bool:
                return bool(client.get(f"/api/runs/{running}").json()["progress"]["completed"] >= 2)

            _wait(some_done)
            pid = client.get("/api/workers").json()[0]["pid"]

        assert service.proc is not None
        started = time.monotonic()
        service.proc.send_signal(signal.SIGTERM)
        try:
            service.proc.wait(timeout=compose_stop_grace_s())
        except subprocess.TimeoutExpired as exc:
            raise AssertionError("the service outlived compose's stop grace period") from exc
        print(f"service stopped {time.monotonic() - started:.2f} s after SIGTERM")
        assert not pid_alive(pid), "the worker outlived the service"

        service.start()
        with service.client() as client:
            run = client.get(f"/api/runs/{running}").json()
            assert run["status"] == "failed"
            assert "service stopped" in run["error"]
            kept = client.get(f"/api/runs/{running}/requests").json()
            assert len(kept) >= 2 and run["progress"]["completed"] >= 2

            def queued_done() -> bool:
                return bool(client.get(f"/api/runs/{queued}").json()["status"] == "succeeded")

            _wait(queued_done)
            # The interrupted run was not re-run: its samples are the ones kept at shutdown.
            assert client.get(f"/api/runs/{running}/requests").json() == kept
    finally:
        service.stop()
