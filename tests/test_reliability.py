"""Fault injection: crashed, hung and stubborn vLLM servers, servers that cannot start, and
cancels while a server starts or hangs.

The stub server (``tests/stub_vllm.py``) fails on purpose, as told by environment
variables the service passes on to its workers. Faults of the load drivers are in
``test_driver_faults.py``; concurrent clients of one service in ``test_concurrent_clients.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import wait_finished, wait_for
from tests.service_process import group_pids, pid_alive

SMALL = {"input_len": 16, "output_len": 8, "num_prompts": 10, "max_concurrency": 2}
# Requests of 40 tokens: a run long enough to act on (cancel, kill its driver) while it runs.
SLOW_RUN = {"input_len": 16, "output_len": 40, "num_prompts": 12, "max_concurrency": 2}


def test_worker_that_crashes_mid_run_fails_the_run_with_its_log(stub_service: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    client = stub_service({"STUB_CRASH_AFTER": "3"})
    run = client.post("/api/runs", json=SMALL).json()
    started = time.monotonic()
    done = wait_finished(client, run["id"], timeout=30)
    detected = time.monotonic() - started
    assert done["status"] == "failed"
    assert "exited during the run" in done["error"]
    assert "stub: crashing mid-stream as told" in done["error"]
    assert detected < 10
    # Samples so far are kept; the worker is marked failed and the next run gets a new one.
    assert client.get(f"/api/runs/{run['id']}/requests").json()
    monkeypatch.delenv("STUB_CRASH_AFTER")
    again = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert again["status"] == "succeeded"
    assert again["worker_id"] != done["worker_id"]
    statuses = {w["id"]: w["status"] for w in client.get("/api/workers").json()}
    assert statuses[done["worker_id"]] == "failed"


def test_worker_that_never_becomes_healthy_fails_at_the_deadline(stub_service: Any) -> None:
    client = stub_service({"STUB_STARTUP_DELAY_S": "inf"}, worker_start_timeout_s=3)
    run = client.post("/api/runs", json=SMALL).json()
    started = time.monotonic()
    done = wait_finished(client, run["id"], timeout=30)
    assert done["status"] == "failed"
    assert "not healthy after 3 s" in done["error"]
    assert time.monotonic() - started < 15
    worker = client.get("/api/workers").json()[0]
    assert worker["status"] == "failed" and not pid_alive(worker["pid"])


FAILED_STARTS = Path(__file__).resolve().parent / "data" / "vllm_start_failures"


def _gone(pgid: int, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while group_pids(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_server_whose_engine_failed_fails_its_run_at_once_with_the_root_cause(stub_service: Any) -> None:
    # A real vLLM log up to its engine's failure, then the API server hangs (port bound, no
    # answer) with its engine processes alive: only the log says it will never serve.
    client = stub_service({"STUB_PRINT_LOG": str(FAILED_STARTS / "engine_failed_server_hangs.log"),
                           "STUB_SILENT_PORT": "1", "STUB_ENGINE": "alive", "STUB_IGNORE_SIGTERM": "1"},
                          worker_start_timeout_s=60)
    started = time.monotonic()
    run = client.post("/api/runs", json=SMALL).json()
    done = wait_finished(client, run["id"], timeout=60)
    elapsed = time.monotonic() - started
    assert done["status"] == "failed"
    lines = done["error"].splitlines()
    assert lines[0] == ("ValueError: Available memory on node 0 (9.46/12.71 GiB) on kv cache allocation is "
                        "less than requested memory for kv (93132.26 GiB). Decrease --kv-cache-memory-bytes, "
                        "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes."), lines[0]
    assert lines[1] == ("Fix: lower VLLM_CPU_KVCACHE_SPACE in the service's environment below 9.46 GiB "
                        "(the memory free on the node), or stop what else uses the host's memory.")
    assert lines[2] == "vLLM server's engine failed to start (the server was stopped); last log lines:"
    assert "RuntimeError: Worker failed with error" in done["error"]  # the log's tail follows
    # The stub prints the log as it starts (about a second of imports here); the start
    # timeout is 60 s.
    assert elapsed < 10, elapsed
    worker = client.get("/api/workers").json()[0]
    assert worker["status"] == "failed" and worker["error"].splitlines()[0] == lines[0]
    assert _gone(worker["pid"], timeout=0.5), group_pids(worker["pid"])


def test_a_server_that_exits_before_it_is_healthy_says_its_root_cause_first(stub_service: Any) -> None:
    client = stub_service({"STUB_PRINT_LOG": str(FAILED_STARTS / "max_model_len.log"),
                           "STUB_EXIT_AT_START": "1"})
    run = client.post("/api/runs", json=SMALL).json()
    done = wait_finished(client, run["id"], timeout=60)
    assert done["status"] == "failed"
    lines = done["error"].splitlines()
    assert lines[0].startswith("ValueError: To serve at least one request with the model's max seq len "
                               "(131072)"), lines[0]
    assert lines[1] == ("Fix: set engine.max_model_len to at most 97408, "
                        "or raise engine.gpu_memory_utilization.")
    assert "RuntimeError: Engine core initialization failed" in done["error"]
    worker = client.get("/api/workers").json()[0]
    assert _gone(worker["pid"])


def test_worker_that_hangs_fails_the_run_and_is_replaced(stub_service: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    client = stub_service({"STUB_HANG_AFTER_TOKENS": "3"}, request_timeout_s=2)
    run = client.post("/api/runs", json=SMALL).json()
    started = time.monotonic()
    done = wait_finished(client, run["id"], timeout=60)
    assert done["status"] == "failed"
    assert "stopped answering" in done["error"] and "stub: hanging as told" in done["error"]
    assert time.monotonic() - started < 20
    monkeypatch.delenv("STUB_HANG_AFTER_TOKENS")
    again = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert again["status"] == "succeeded" and again["worker_id"] != done["worker_id"]


def test_worker_that_hangs_with_a_live_health_fails_within_the_stall_limit(
        stub_service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # /health answers and the request timeout is the default 600 s: only the streams'
    # silence shows the hang.
    client = stub_service({"STUB_HANG_AFTER_TOKENS": "3", "STUB_HANG_HEALTHY": "1"}, stall_s=2)
    run = client.post("/api/runs", json=SMALL).json()
    started = time.monotonic()
    done = wait_finished(client, run["id"], timeout=60)
    elapsed = time.monotonic() - started
    assert done["status"] == "failed"
    assert "vLLM server hung: none of the" in done["error"], done["error"]
    assert "requests running" in done["error"] and "stub: hanging as told" in done["error"]
    assert elapsed < 15, elapsed
    worker = client.get(f"/api/workers/{done['worker_id']}").json()
    assert worker["status"] == "failed" and "hung" in worker["error"]
    monkeypatch.delenv("STUB_HANG_AFTER_TOKENS")
    again = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert again["status"] == "succeeded" and again["worker_id"] != done["worker_id"]


def test_a_run_cancelled_on_a_hung_server_leaves_that_server_out(
        stub_service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A user cancels because the server hung, before the stall limit could tell: /health
    # still answers, but the server must not take the next run (it would hang that too).
    client = stub_service({"STUB_HANG_AFTER_TOKENS": "3", "STUB_HANG_HEALTHY": "1"}, stall_s=6)
    run = client.post("/api/runs", json=SMALL).json()
    hung = wait_for(client, run["id"], lambda r: r["status"] == "running")["worker_id"]
    url = client.get(f"/api/workers/{hung}").json()["url"]
    deadline = time.monotonic() + 10
    while not httpx.get(f"{url}/stub/requests").json()["hung"]:
        assert time.monotonic() < deadline, "the stub never hung"
        time.sleep(0.05)
    started = time.monotonic()
    assert client.post(f"/api/runs/{run['id']}/cancel").json()["status"] == "cancelled"
    assert time.monotonic() - started < 3  # the answer does not wait for the check
    monkeypatch.delenv("STUB_HANG_AFTER_TOKENS")
    again = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert again["status"] == "succeeded", again["error"]
    assert again["worker_id"] != hung
    worker = client.get(f"/api/workers/{hung}").json()
    assert worker["status"] == "failed" and "after run" in worker["error"], worker
    # A cancel on a server that still serves keeps it for the next run.
    cancelled = client.post("/api/runs", json={**SLOW_RUN, "num_prompts": 40}).json()
    wait_for(client, cancelled["id"], lambda r: r["progress"]["completed"] >= 1)
    client.post(f"/api/runs/{cancelled['id']}/cancel")
    last = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert last["status"] == "succeeded" and last["worker_id"] == again["worker_id"]


# A prefill at 500 tokens/s in steps of 128 tokens (0.26 s each): half the speed the
# watchdog used to allow before a first token (1,000 tokens/s).
SLOW_PREFILL = {"STUB_PREFILL_S_PER_TOKEN": "0.002", "STUB_PREFILL_CHUNK": "128"}
PREFILL_RUN = {**SMALL, "input_len": 2048, "output_len": 4, "num_prompts": 2, "max_concurrency": 2,
               "mode": "prefill"}


def test_a_slow_prefill_whose_server_shows_progress_completes_and_is_measured(
        stub_service: Any) -> None:
    # Two 2,048-token prompts, one prefill at a time: 4.1 s of silence before the first
    # token, 8.2 s before the second's, against a stall limit of 2 s (the old rule allowed
    # 2.05 s: the prompt at 1,000 tokens/s). The stub's /metrics moves after every chunk,
    # as vLLM's does: the server is seen working, and nothing is declared hung.
    client = stub_service(SLOW_PREFILL, stall_s=2)
    done = wait_finished(client, client.post("/api/runs", json=PREFILL_RUN).json()["id"], timeout=90)
    assert done["status"] == "succeeded", done["error"]
    assert done["progress"]["completed"] == 2
    ttfts = sorted(r["ttft"] for r in client.get(f"/api/runs/{done['id']}/requests").json())
    assert ttfts[0] > 4.0 and ttfts[1] > 8.0, ttfts
    worker = client.get(f"/api/workers/{done['worker_id']}").json()
    assert worker["status"] != "failed", worker


def test_a_prefill_whose_engine_sticks_is_a_hang(stub_service: Any) -> None:
    # The same prefill, but the engine sticks after 4 chunks (about 1 s in): /health still
    # answers and /metrics answers what it said then. Found a stall limit after that.
    client = stub_service({**SLOW_PREFILL, "STUB_PREFILL_STUCK_AFTER": "4", "STUB_HANG_HEALTHY": "1"},
                          stall_s=2)
    started = time.monotonic()
    done = wait_finished(client, client.post("/api/runs", json=PREFILL_RUN).json()["id"], timeout=60)
    elapsed = time.monotonic() - started
    assert done["status"] == "failed"
    assert "vLLM server hung: none of the 2 open streams got a token" in done["error"], done["error"]
    assert "its /metrics did not move" in done["error"]
    assert "stub: hanging as told" in done["error"]
    assert elapsed < 20, elapsed
    worker = client.get(f"/api/workers/{done['worker_id']}").json()
    assert worker["status"] == "failed" and "hung" in worker["error"]


@pytest.mark.parametrize("mode", ["prefill", "fill"])
def test_a_silence_without_progress_is_a_hang_whatever_the_run(stub_service: Any, mode: str) -> None:
    # Every stream is silent 3 s before its first token while /metrics stands still, six
    # times the stall limit: a prefill run (8,000-token prompts, which the old rule allowed
    # 8 s) fails as a fill run does. A fill run's silence is seen once a driver beat (one
    # a second) comes 0.5 s into it: 2.5 s hold two beats, so one a busy machine delays
    # does not hide it.
    client = stub_service({"STUB_FIRST_TOKEN_S": "3"}, stall_s=0.5)
    spec = {**SMALL, "input_len": 8000, "num_prompts": 4, "max_concurrency": 1, "mode": mode}
    done = wait_finished(client, client.post("/api/runs", json=spec).json()["id"], timeout=60)
    assert done["status"] == "failed" and "vLLM server hung" in done["error"], done["error"]
    assert "its /metrics did not move" in done["error"]


def test_pauses_between_requests_of_a_slow_open_loop_are_not_a_hang(stub_service: Any) -> None:
    # 0.4 requests/s, nearly evenly spaced: the first request goes 2.5 s after the driver
    # got its config, the second 2.5 s later, each after seconds with no stream open, longer
    # than the stall limit. Each is silent 1.2 s before its first token (under the limit).
    # Only the silence of open streams, from when they opened, counts.
    client = stub_service({"STUB_FIRST_TOKEN_S": "1.2"}, stall_s=2)
    spec = {**SMALL, "num_prompts": 2, "max_concurrency": None, "request_rate": 0.4,
            "burstiness": 50}
    done = wait_finished(client, client.post("/api/runs", json=spec).json()["id"], timeout=60)
    assert done["status"] == "succeeded", done["error"]
    assert done["progress"]["completed"] == 2
    worker = client.get(f"/api/workers/{done['worker_id']}").json()
    assert worker["status"] != "failed", worker


def test_cancel_while_the_worker_starts_leaves_no_process(stub_service: Any) -> None:
    # The worker answers /health only after 3 s: the cancel lands while it starts.
    client = stub_service({"STUB_STARTUP_DELAY_S": "3"})
    run = client.post("/api/runs", json=SMALL).json()
    worker = None
    deadline = time.monotonic() + 30
    while worker is None and time.monotonic() < deadline:
        workers = client.get("/api/workers").json()
        worker = workers[0] if workers and workers[0]["pid"] else None
        time.sleep(0.05)
    assert worker is not None, "no worker was started"
    assert client.post(f"/api/runs/{run['id']}/cancel").status_code == 200
    assert wait_finished(client, run["id"])["status"] == "cancelled"
    deadline = time.monotonic() + 20
    while pid_alive(worker["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(worker["pid"]), "the starting worker was left running"
    deadline = time.monotonic() + 10  # the row is written once the group has stopped
    while (stopped := client.get(f"/api/workers/{worker['id']}").json())["status"] == "starting" \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stopped["status"] == "failed" and stopped["error"] == "start interrupted"


def test_cancel_of_a_queued_run_is_immediate_and_others_go_on(stub_service: Any) -> None:
    client = stub_service({"STUB_TOKEN_INTERVAL_S": "0.02"})
    first = client.post("/api/runs", json={**SMALL, "output_len": 20}).json()
    second = client.post("/api/runs", json=SMALL).json()
    cancelled = client.post(f"/api/runs/{second['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    assert wait_finished(client, first["id"])["status"] == "succeeded"
    assert client.get(f"/api/runs/{second['id']}").json()["status"] == "cancelled"
    assert client.get(f"/api/runs/{second['id']}/requests").json() == []


def test_stopping_a_worker_stops_its_whole_group_even_if_it_ignores_sigterm(
    stub_service: Any,
) -> None:
    client = stub_service({"STUB_IGNORE_SIGTERM": "1", "STUB_GRANDCHILD": "1"}, worker_stop_grace_s=1)
    wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    worker = client.get("/api/workers").json()[0]
    grandchild = httpx.get(f"{worker['url']}/stub/requests").json()["grandchild"]
    assert pid_alive(worker["pid"]) and pid_alive(grandchild)
    client.__exit__(None, None, None)  # the service's shutdown
    assert not pid_alive(worker["pid"])
    assert not pid_alive(grandchild)
