"""Load driver processes that end, die or hang: each run's load comes from a process of
its own, and none outlives its run or the service."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.load.shards import DriverPool, Drivers
from tests.conftest import wait_finished, wait_for
from tests.service_process import ServiceProcess, driver_pids, host_pids, pid_alive
from tests.test_reliability import SLOW_RUN, SMALL


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


class _LineStream:
    """A driver's stdout as the reader awaits it: lines fed by the test."""

    def __init__(self) -> None:
        self.stdout = asyncio.StreamReader()

    async def wait(self) -> int:
        return 0


def test_a_cancel_that_lands_as_a_drivers_line_arrives_stops_the_reader() -> None:
    # The service reads each shard's lines with a deadline. Through asyncio.wait_for, on
    # Python 3.11 a cancel delivered in the step where the awaited line arrives was lost: the
    # line came back and the reader read on, so a cancelled run went on sending to its end
    # (seen once in a 4-worker fresh-clone run: samples for 30 s after Ctrl-C).
    async def main() -> list[dict[str, Any]]:
        drivers = Drivers([], DriverPool(Path("/nonexistent")), hang_s=30)
        stream = _LineStream()
        drivers.procs = [stream]  # type: ignore[list-item]
        seen: list[dict[str, Any]] = []
        reader = asyncio.ensure_future(drivers._read(0, lambda _, line: seen.append(line)))
        await asyncio.sleep(0)  # the reader waits for a line
        stream.stdout.feed_data(b'{"n": 1}\n')
        reader.cancel()  # in the same step: the line and the cancel arrive together
        await asyncio.sleep(0.05)
        stream.stdout.feed_data(b'{"n": 2}\n')  # a reader that read on takes this one
        await asyncio.sleep(0.05)
        assert reader.done(), "the reader read on after its cancel"
        assert reader.cancelled()
        return seen

    assert asyncio.run(main()) == []
