"""The runner's ways to end a run, as a user sees them through the API: the run's final
status and error, its worker's status, the samples kept, and what the next run gets.

Each case runs a real service whose workers are the stub vLLM server
(``tests/stub_vllm.py``), misbehaving as its environment knobs say.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.control.handles import CANCELLED_BEFORE_PROCESS
from service.storage import workers as storage_workers
from tests.conftest import wait_finished, wait_for
from tests.service_process import pid_alive

TINY = {"input_len": 16, "output_len": 4, "num_prompts": 4, "max_concurrency": 2}
# Slow enough (12 x 40 tokens x 20 ms, 2 at a time: about 5 s) to act on mid-run.
SLOW = {"input_len": 16, "output_len": 40, "num_prompts": 12, "max_concurrency": 2}
SLOW_ENV = {"STUB_TOKEN_INTERVAL_S": "0.02"}


def _samples(client: TestClient, run_id: str) -> list[dict[str, Any]]:
    return list(client.get(f"/api/runs/{run_id}/requests").json())


def _worker(client: TestClient, worker_id: str) -> dict[str, Any]:
    return dict(client.get(f"/api/workers/{worker_id}").json())


def _wait(pred: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def _measuring(client: TestClient, run_id: str, completed: int = 2) -> dict[str, Any]:
    """Wait until the run is being measured and has ``completed`` answers."""
    return wait_for(client, run_id, lambda r: r["status"] == "running"
                    and r["progress"]["completed"] >= completed, timeout=30)


# ---------------------------------------------------------------- failures, one shape


@dataclass
class Case:
    """A run that fails: the stub's knobs and the service's settings, the spec, and what
    the user sees."""

    env: dict[str, str]
    error: list[str]  # pieces of the run's error text
    worker: str  # the worker's status after the run
    answered: tuple[int, int]  # the least and most answered requests kept
    kept: tuple[int, int]  # the least and most samples kept (failed requests too)
    settings: dict[str, Any] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=lambda: dict(TINY))
    worker_error: str | None = None  # a piece of the worker's error
    # A spec the same worker then serves (it stays, with its fault): it succeeds there.
    then: dict[str, Any] | None = None
    # True: the worker is not reused and the next run (without the fault) gets a new one.
    replaced: bool = False


FAILURES = [
    pytest.param(Case(
        env={"STUB_EXIT_AT_START": "3"},
        error=["vLLM server exited with code 3 before it became healthy",
               "stub: exiting at start as told"],
        worker="failed", answered=(0, 0), kept=(0, 0), replaced=True,
    ), id="server exits as it starts"),
    pytest.param(Case(
        env={"STUB_STARTUP_DELAY_S": "inf"},
        # Long enough for the stub that replaces it after, on a machine the suite keeps busy.
        settings={"worker_start_timeout_s": 10, "worker_stop_grace_s": 1},
        error=["vLLM server not healthy after 10 s"],
        worker="failed", answered=(0, 0), kept=(0, 0), replaced=True,
    ), id="server never becomes healthy"),
    pytest.param(Case(
        env={"STUB_CRASH_AFTER": "3", **SLOW_ENV},
        error=["vLLM server exited during the run; last log lines:",
               "stub: crashing mid-stream as told"],
        worker="failed", answered=(2, 2), kept=(2, 12), spec=dict(SLOW), replaced=True,
    ), id="server exits mid-run"),
    pytest.param(Case(
        env={"STUB_HANG_AFTER_TOKENS": "2", "STUB_HANG_HEALTHY": "1"},
        settings={"stall_s": 1, "worker_stop_grace_s": 1},
        error=["vLLM server hung: none of the", "open streams got a token",
               "stub: hanging as told"],
        worker="failed", worker_error="hung: no token on any open stream",
        answered=(0, 0), kept=(0, 4), replaced=True,
    ), id="server hangs with a live /health"),
    pytest.param(Case(
        # Every stream is silent longer than the client waits for a byte; /health answers.
        env={"STUB_FIRST_TOKEN_S": "1.5"},
        settings={"request_timeout_s": 0.3},
        error=["every request failed; first error: SocketTimeoutError: Timeout on reading data",
               "last log lines of the vLLM server:"],
        worker="ready", answered=(0, 0), kept=(4, 4),
    ), id="every request fails"),
    pytest.param(Case(
        # 32 tokens of KV cache, of which vLLM fits one request of 16: the run's requests
        # are each that long, but 3 at once need 48.
        env={"STUB_KV_BLOCKS": "2"},
        spec={**TINY, "input_len": 12, "max_concurrency": 3},
        error=["infeasible: 3 requests at once x 16 tokens each (input + output) = 48 tokens "
               "of KV cache, and this server holds 32", "so the run was not sent"],
        worker="ready", answered=(0, 0), kept=(0, 0),
        then={**TINY, "input_len": 4, "max_concurrency": 1},  # 1 x 8 tokens fits
    ), id="more KV than the server has"),
    pytest.param(Case(
        env={"STUB_NO_CONNECTOR": "1"},
        error=["the vLLM server's connector never reported on this run (4 requests answered)",
               "as mode 'fill' says"],
        worker="ready", answered=(4, 4), kept=(4, 4),
    ), id="connector reports nothing for a fill run"),
]


@pytest.mark.parametrize("case", FAILURES)
def test_a_run_that_cannot_succeed_fails_with_its_reason(
    case: Case, stub_service: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = stub_service(case.env, **case.settings)
    run = client.post("/api/runs", json=case.spec).json()
    done = wait_finished(client, run["id"], timeout=60)
    assert done["status"] == "failed", done
    for piece in case.error:
        assert piece in done["error"], done["error"]
    kept = _samples(client, run["id"])
    answered = sum(s["success"] for s in kept)
    assert case.answered[0] <= answered <= case.answered[1], kept
    assert case.kept[0] <= len(kept) <= case.kept[1], kept
    # The counts shown agree with the samples kept.
    assert done["progress"]["completed"] + done["progress"]["failed"] == len(kept)
    # One worker was started for it (a run whose worker never started names none).
    workers = client.get("/api/workers").json()
    assert len(workers) == 1, workers
    worker = workers[0]
    assert done["worker_id"] in (worker["id"], None)
    assert worker["status"] == case.worker, worker
    if case.worker_error is not None:
        assert case.worker_error in worker["error"], worker
    if case.worker == "failed":
        assert not pid_alive(worker["pid"])
    else:
        assert pid_alive(worker["pid"])
    if case.then is not None:
        again = wait_finished(client, client.post("/api/runs", json=case.then).json()["id"], timeout=60)
        assert again["status"] == "succeeded", again["error"]
        assert again["worker_id"] == worker["id"]
    if case.replaced:
        for key in case.env:
            monkeypatch.delenv(key)
        again = wait_finished(client, client.post("/api/runs", json=TINY).json()["id"], timeout=60)
        assert again["status"] == "succeeded", again["error"]
        assert again["worker_id"] != worker["id"]


# ---------------------------------------------------------------- before any worker


def test_a_model_directory_gone_before_the_start_fails_the_run_and_starts_no_worker(
    stub_service: Callable[..., TestClient], tmp_path: Path
) -> None:
    client = stub_service(SLOW_ENV)
    # A run holds the one CPU worker while the other waits behind it.
    blocker = client.post("/api/runs", json={**SLOW, "num_prompts": 200}).json()
    _measuring(client, blocker["id"], completed=1)
    model = tmp_path / "gone-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000}))
    (model / "tokenizer.json").write_text("{}")
    run = client.post("/api/runs", json={**TINY, "model": str(model),
                                         "engine": {"load_format": "dummy"}}).json()
    assert run["status"] == "queued", run
    shutil.rmtree(model)
    assert client.post(f"/api/runs/{blocker['id']}/cancel").status_code == 200
    done = wait_finished(client, run["id"], timeout=60)
    assert done["status"] == "failed"
    assert "no model directory with a config.json" in done["error"], done["error"]
    assert str(model) in done["error"]
    assert done["worker_id"] is None
    assert _samples(client, run["id"]) == []
    # No worker was started for it, and the blocker's (of another model) was not stopped
    # for it.
    workers = client.get("/api/workers").json()
    blocker_worker = wait_finished(client, blocker["id"])["worker_id"]
    assert [w["id"] for w in workers] == [blocker_worker]
    assert workers[0]["status"] == "ready" and pid_alive(workers[0]["pid"])
    # Set aside for the failed run, it went back warm: the next run of its kind takes it.
    again = client.post("/api/runs", json={**SLOW, "num_prompts": 2}).json()
    assert wait_finished(client, again["id"])["worker_id"] == blocker_worker


# ---------------------------------------------------------------- a user's cancel


def test_a_cancel_while_measured_keeps_the_samples_and_the_worker(
    stub_service: Callable[..., TestClient],
) -> None:
    client = stub_service(SLOW_ENV)
    run = client.post("/api/runs", json=SLOW).json()
    _measuring(client, run["id"])
    assert client.post(f"/api/runs/{run['id']}/cancel").status_code == 200
    done = wait_finished(client, run["id"], timeout=30)
    assert done["status"] == "cancelled"
    assert done["error"] == "cancelled by the user"
    # What was measured before the cancel is stored and counted.
    done = wait_for(client, run["id"], lambda r: r["progress"]["completed"] + r["progress"]["failed"]
                    == len(_samples(client, run["id"])), timeout=10)
    assert 2 <= len(_samples(client, run["id"])) < SLOW["num_prompts"]
    worker = _worker(client, done["worker_id"])
    _wait(lambda: _worker(client, done["worker_id"])["status"] == "ready", "worker ready again")
    # The worker serves the next run.
    again = wait_finished(client, client.post("/api/runs", json=TINY).json()["id"], timeout=60)
    assert again["status"] == "succeeded", again["error"]
    assert again["worker_id"] == done["worker_id"]
    assert _worker(client, done["worker_id"])["pid"] == worker["pid"]


def test_a_cancel_while_the_worker_starts_leaves_no_worker_process(
    stub_service: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = stub_service({"STUB_STARTUP_DELAY_S": "3"})
    run = client.post("/api/runs", json=TINY).json()
    workers: list[dict[str, Any]] = []

    def started() -> bool:
        workers[:] = [w for w in client.get("/api/workers").json() if w["pid"]]
        return bool(workers)

    _wait(started, "a worker process started")
    assert workers[0]["status"] == "starting"
    assert client.post(f"/api/runs/{run['id']}/cancel").status_code == 200
    done = wait_finished(client, run["id"], timeout=30)
    assert done["status"] == "cancelled" and done["error"] == "cancelled by the user"
    assert _samples(client, run["id"]) == []
    pid = workers[0]["pid"]
    _wait(lambda: not pid_alive(pid), "the starting worker's process gone")
    _wait(lambda: _worker(client, workers[0]["id"])["status"] in ("stopped", "failed"),
          "the starting worker's row ended")
    # Nothing of the interrupted start holds the next run back.
    monkeypatch.delenv("STUB_STARTUP_DELAY_S")
    again = wait_finished(client, client.post("/api/runs", json=TINY).json()["id"], timeout=60)
    assert again["status"] == "succeeded", again["error"]
    assert again["worker_id"] != workers[0]["id"]


def test_a_cancel_while_the_servers_row_is_written_leaves_no_row_starting(
    stub_service: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The row of a server about to start is written in a thread, which a cancel cannot
    # stop: held there until the cancel has been answered, the cancel comes while it is written.
    client = stub_service()
    writing, answered = threading.Event(), threading.Event()
    real = storage_workers.add_worker

    def slow_add_worker(*args: Any, **kwargs: Any) -> None:
        writing.set()
        answered.wait(timeout=30)
        real(*args, **kwargs)

    monkeypatch.setattr(storage_workers, "add_worker", slow_add_worker)
    run = client.post("/api/runs", json=TINY).json()
    assert writing.wait(timeout=30), "no server start began"
    assert client.post(f"/api/runs/{run['id']}/cancel").status_code == 200
    answered.set()
    done = wait_finished(client, run["id"], timeout=30)
    assert done["status"] == "cancelled" and done["error"] == "cancelled by the user"
    # The row went in after the cancel: it is not left "starting" with no process behind it.
    _wait(lambda: [w["status"] for w in client.get("/api/workers").json()] == ["stopped"],
          "the server's row ended")
    (worker,) = client.get("/api/workers").json()
    assert worker["pid"] is None and worker["error"] == CANCELLED_BEFORE_PROCESS
    # And the next run starts its own server.
    monkeypatch.setattr(storage_workers, "add_worker", real)
    again = wait_finished(client, client.post("/api/runs", json=TINY).json()["id"], timeout=60)
    assert again["status"] == "succeeded", again["error"]
    assert again["worker_id"] != worker["id"]


# ---------------------------------------------------------------- the service stops


def _worker_starting(client: TestClient, run_id: str) -> None:
    _wait(lambda: any(w["pid"] for w in client.get("/api/workers").json()), "a worker process started")
    assert client.get(f"/api/runs/{run_id}").json()["status"] == "starting"


@pytest.mark.parametrize(("env", "spec", "reached", "kept"), [
    pytest.param({"STUB_STARTUP_DELAY_S": "60"}, TINY, _worker_starting, (0, 0),
                 id="while its worker starts"),
    pytest.param(SLOW_ENV, SLOW, _measuring, (2, SLOW["num_prompts"] - 1),
                 id="while it is measured"),
])
def test_a_run_in_progress_when_the_service_stops_is_failed_with_that_reason(
    stub_service: Callable[..., TestClient], env: dict[str, str], spec: dict[str, Any],
    reached: Callable[[TestClient, str], object], kept: tuple[int, int],
) -> None:
    client = stub_service(env)
    run = client.post("/api/runs", json=spec).json()
    reached(client, run["id"])
    worker = client.get("/api/workers").json()[0]
    client.__exit__(None, None, None)  # the service's shutdown
    assert not pid_alive(worker["pid"]), "the worker outlived the service"

    # Started again on the same data: the runner's own word, not the recovery's.
    client = stub_service()
    done = client.get(f"/api/runs/{run['id']}").json()
    assert done["status"] == "failed"
    assert done["error"] == "the service stopped while this run was in progress"
    samples = _samples(client, run["id"])
    assert kept[0] <= len(samples) <= kept[1], samples
    assert done["progress"]["completed"] + done["progress"]["failed"] == len(samples)
    assert _worker(client, worker["id"])["status"] in ("stopped", "failed")


# ---------------------------------------------------------------- after the last answer


def test_a_run_waiting_for_the_connector_shows_every_answered_request(
    stub_service: Callable[..., TestClient],
) -> None:
    # Without the connector's report the runner waits its whole report wait after the last
    # answer; the 4 tiny requests are answered well before the first periodic save.
    client = stub_service({"STUB_NO_CONNECTOR": "1"})
    run = client.post("/api/runs", json=TINY).json()
    seen: list[tuple[str, int, int]] = []

    def ended() -> bool:
        now = client.get(f"/api/runs/{run['id']}").json()
        seen.append((now["status"], now["progress"]["completed"], len(_samples(client, run["id"]))))
        return now["status"] in ("succeeded", "failed", "cancelled")

    _wait(ended, "the run ended", timeout=30)
    running = [s for s in seen if s[0] == "running"]
    assert len(running) >= 5, seen  # the report wait is seconds long
    assert running[-1][1:] == (4, 4), running
