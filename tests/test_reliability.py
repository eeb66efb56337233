"""Fault injection: crashed, hung and stubborn vLLM servers, cancels, and concurrent clients.

The stub server (``tests/stub_vllm.py``) fails on purpose, as told by environment
variables the service passes on to its workers.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.conftest import AUTH, wait_finished, wait_for
from tests.service_process import ServiceProcess, driver_pids, group_pids, host_pids, pid_alive

SMALL = {"input_len": 16, "output_len": 8, "num_prompts": 10, "max_concurrency": 2}


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


def test_a_long_silent_prefill_is_not_a_hang(stub_service: Any) -> None:
    # Every stream is silent 1.5 s before its first token, three times the stall floor:
    # a real prefill of 4,000 tokens is allowed 4 s before the first token (room for a
    # busy machine), and three times the longest time to first token after it.
    client = stub_service({"STUB_FIRST_TOKEN_S": "1.5"}, stall_s=0.5)
    spec = {**SMALL, "input_len": 4000, "num_prompts": 4, "max_concurrency": 1, "mode": "prefill"}
    done = wait_finished(client, client.post("/api/runs", json=spec).json()["id"], timeout=60)
    assert done["status"] == "succeeded", done["error"]
    # The same silence in a fill run, which has no prefill to wait for, is a hang.
    fill = wait_finished(client, client.post("/api/runs", json={**spec, "mode": "fill"}).json()["id"],
                         timeout=60)
    assert fill["status"] == "failed" and "vLLM server hung" in fill["error"], fill["error"]


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


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceProcess]:
    proc = ServiceProcess(tmp_path / "var", {"STUB_TOKEN_INTERVAL_S": "0.001"})
    proc.start()
    yield proc
    proc.stop()


def test_concurrent_posts_with_idempotency_keys_create_one_run_per_key(service: ServiceProcess) -> None:
    body = {"input_len": 8, "output_len": 2, "num_prompts": 1}

    def post(i: int) -> tuple[int, str]:
        r = httpx.post(f"{service.url}/api/runs", json=body,
                       headers={"Idempotency-Key": f"key-{i % 50}", **AUTH}, timeout=60)
        return r.status_code, r.json()["id"]

    with ThreadPoolExecutor(32) as pool:
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


# ---------------------------------------------------------------- load driver processes

SLOW_RUN = {"input_len": 16, "output_len": 40, "num_prompts": 12, "max_concurrency": 2}


def _driver_of_running_run(client: TestClient, run_id: str) -> int:
    wait_for(client, run_id, lambda r: r["status"] == "running" and r["summary"] is None
             and r["progress"]["completed"] >= 2)
    deadline = time.monotonic() + 10
    while not (pids := driver_pids(run_id=run_id)):
        assert time.monotonic() < deadline, "no load driver process found"
        time.sleep(0.05)
    assert len(pids) == 1  # 2 streams: one shard
    return pids[0]


def test_load_is_driven_from_a_process_of_its_own_that_ends_with_the_run(stub_service: Any) -> None:
    client = stub_service({"STUB_TOKEN_INTERVAL_S": "0.02"})
    run = client.post("/api/runs", json=SLOW_RUN).json()
    pid = _driver_of_running_run(client, run["id"])
    assert pid != os.getpid()
    # Samples reach the database while the run goes on, not only at its end.
    assert client.get(f"/api/runs/{run['id']}/requests").json()
    done = wait_finished(client, run["id"])
    assert done["status"] == "succeeded" and done["summary"]["completed"] == 12
    samples = client.get(f"/api/runs/{run['id']}/requests").json()
    assert sorted(s["index"] for s in samples) == list(range(12))  # each exactly once
    assert not pid_alive(pid)


def test_a_driver_that_dies_fails_its_run_and_keeps_what_it_measured(stub_service: Any) -> None:
    client = stub_service({"STUB_TOKEN_INTERVAL_S": "0.02"})
    run = client.post("/api/runs", json=SLOW_RUN).json()
    pid = _driver_of_running_run(client, run["id"])
    os.kill(pid, signal.SIGKILL)
    done = wait_finished(client, run["id"], timeout=30)
    assert done["status"] == "failed"
    assert "load driver 0 exited with code -9" in done["error"]
    kept = client.get(f"/api/runs/{run['id']}/requests").json()
    assert 2 <= len(kept) < 12 and done["progress"]["completed"] == len(kept)
    # The worker was fine: the next run uses it.
    again = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert again["status"] == "succeeded" and again["worker_id"] == done["worker_id"]


def test_a_driver_that_hangs_fails_its_run_with_a_reason_and_is_stopped(stub_service: Any) -> None:
    client = stub_service({"STUB_TOKEN_INTERVAL_S": "0.02"}, driver_hang_s=2)
    run = client.post("/api/runs", json=SLOW_RUN).json()
    pid = _driver_of_running_run(client, run["id"])
    os.kill(pid, signal.SIGSTOP)  # alive, and silent: no samples, no heartbeat
    started = time.monotonic()
    done = wait_finished(client, run["id"], timeout=30)
    assert done["status"] == "failed"
    assert "load driver 0 sent nothing for 2 s (hung)" in done["error"]
    assert time.monotonic() - started < 10
    assert not pid_alive(pid)
    assert client.get(f"/api/runs/{run['id']}/requests").json()


def test_cancel_stops_the_driver_and_keeps_its_samples(stub_service: Any) -> None:
    client = stub_service({"STUB_TOKEN_INTERVAL_S": "0.02"})
    # 40 requests (about 16 s): a cancel that is slow to arrive on a loaded machine still
    # lands mid-run.
    run = client.post("/api/runs", json={**SLOW_RUN, "num_prompts": 40}).json()
    pid = _driver_of_running_run(client, run["id"])
    assert client.post(f"/api/runs/{run['id']}/cancel").json()["status"] == "cancelled"
    deadline = time.monotonic() + 10
    while pid_alive(pid):
        assert time.monotonic() < deadline, "the driver outlived its cancelled run"
        time.sleep(0.05)
    final = wait_for(client, run["id"], lambda r: r["status"] == "cancelled")

    def kept() -> int:
        return len(client.get(f"/api/runs/{run['id']}/requests").json())

    # What the driver measured before it stopped is stored, and counted.
    final = wait_for(client, run["id"], lambda r: sum(r["progress"][k] for k in ("completed", "failed"))
                     == kept(), timeout=10)
    assert 2 <= kept() < 40
    assert final["error"] == "cancelled by the user"


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_no_driver_outlives_the_service(tmp_path: Path, how: str) -> None:
    # With the warm driver host on (the default): neither it nor a driver outlives the service.
    service = ServiceProcess(tmp_path / "var", {"STUB_TOKEN_INTERVAL_S": "0.05",
                                                "DECODEBENCH_WARM_DRIVERS": "1"})
    service.start()
    try:
        with service.client() as c:
            run_id = c.post("/api/runs", json={**SLOW_RUN, "output_len": 200}).json()["id"]
            wait_for(c, run_id, lambda r: r["status"] == "running" and r["progress"]["completed"] >= 1)
        assert service.proc is not None
        pids = driver_pids(service.proc.pid)
        assert len(driver_pids(service.proc.pid, run_id)) == 1
        hosts = host_pids(service.proc.pid)
        assert len(hosts) == 1  # the warm host the drivers are forked from
        if how == "sigterm":
            service.stop()
        else:
            # A crash: the host sees its socket close (or its parent die) and ends, and
            # its drivers with it; a driver also sees its stdin close.
            service.kill()
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in [*pids, *hosts]):
            assert time.monotonic() < deadline, "a load driver or its host outlived the service"
            time.sleep(0.05)
    finally:
        service.stop()
        service._kill_workers()
