"""The warm driver host: drivers forked from it behave as drivers started on their own,
their ends are known to the service, and without it drivers still start."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from service.core.sample import Sample
from service.core.spec import RunSpec
from service.load.forkserver_client import DriverHost, HostedDriver
from service.load.shards import DriverPool, DriverProcess, Drivers, _stop_processes
from tests.conftest import make_client, wait_finished
from tests.service_process import driver_pids, host_pids, pid_alive


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_driver_forked_from_the_warm_host_sends_its_samples(stub: str, tmp_path: Path) -> None:
    spec = RunSpec(input_len=16, output_len=4, num_prompts=8, max_concurrency=2, seed=1)
    samples: list[Sample] = []
    parents: list[int] = []

    async def drive() -> tuple[Drivers, int]:
        pool = DriverPool(tmp_path, warm=True)
        pool.start()
        drivers = Drivers.for_run("r-warm", spec, stub, "stub", 1000, 30, pool, hang_s=30)

        def on_sample(sample: Sample) -> None:
            if not parents:
                parents.append(_parent(drivers.procs[0].pid))
            samples.append(sample)

        try:
            await drivers.run(on_sample)
            assert pool.host is not None and pool.host.pid is not None
            return drivers, pool.host.pid
        finally:
            await pool.close()

    drivers, host = asyncio.run(drive())
    assert sorted(s.index for s in samples) == list(range(8))  # every request, once
    assert all(s.success for s in samples)
    [proc] = drivers.procs
    assert isinstance(proc, HostedDriver) and parents == [host]
    assert proc.returncode == 0 and not pid_alive(proc.pid)
    assert (tmp_path / "r-warm.driver0.log").exists()  # its stderr, named for the run


@pytest.mark.parametrize(("how", "code"), [("bad config", 1), ("killed", -signal.SIGKILL)])
def test_a_forked_driver_that_crashes_reports_its_exit_code(tmp_path: Path, how: str, code: int) -> None:
    log = tmp_path / "crash.driver0.log"

    async def crash() -> int:
        host = DriverHost(tmp_path)
        host.start()
        try:
            proc = await host.spawn(log, 1 << 16)
            assert proc.stdin is not None and proc.stdout is not None
            if how == "bad config":
                proc.stdin.write(b"not a config\n")
                await proc.stdin.drain()
            else:
                proc.kill()
            assert await proc.stdout.read() == b""  # nothing on the protocol's pipe
            return await asyncio.wait_for(proc.wait(), 30)
        finally:
            await host.close()

    assert asyncio.run(crash()) == code
    if how == "bad config":
        assert "ValidationError" in log.read_text()  # the traceback, on its stderr


def test_without_its_host_drivers_start_on_their_own_and_a_new_host_starts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        pool = DriverPool(tmp_path, spares=0, warm=True)
        pool.start()
        started: list[DriverProcess] = []
        try:
            running, _ = await pool.take("r-a.driver0.log")
            started.append(running)
            assert isinstance(running, HostedDriver) and pool.host is not None
            lost = pool.host.pid
            assert lost is not None
            os.kill(lost, signal.SIGKILL)
            # Its driver died with it, and says so.
            assert await asyncio.wait_for(running.wait(), 30) == -signal.SIGKILL
            assert not pid_alive(running.pid)
            # The next driver is a process of its own, while a new host starts.
            alone, _ = await pool.take("r-b.driver0.log")
            started.append(alone)
            assert not isinstance(alone, HostedDriver) and _parent(alone.pid) == os.getpid()
            forked, _ = await pool.take("r-c.driver0.log")
            started.append(forked)
            assert isinstance(forked, HostedDriver)
            assert pool.host.pid not in (None, lost) and _parent(forked.pid) == pool.host.pid
        finally:
            await _stop_processes(started)
            await pool.close()

    with caplog.at_level(logging.WARNING, logger="service.load.shards"):
        asyncio.run(go())
    assert any("driver host is gone" in r.getMessage() and "a new host starts" in r.getMessage()
               for r in caplog.records), caplog.text


def test_a_service_starts_its_driver_host_with_its_first_run(tmp_path: Path) -> None:
    # A service that only shows results runs no driver process; the first run starts the
    # host (beside its server's start), and after the run a spare forked from it waits.
    with make_client(tmp_path, warm_drivers=True) as client:
        time.sleep(1)  # the old service had its host up well within this
        assert host_pids() == [] and driver_pids() == []
        run = client.post("/api/runs", json={"input_len": 16, "output_len": 4, "num_prompts": 2}).json()
        assert wait_finished(client, run["id"])["status"] == "succeeded"
        assert len(host_pids()) == 1
        deadline = time.monotonic() + 10
        while not driver_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert driver_pids(), "no spare driver after the run"
