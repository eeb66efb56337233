"""Workers, drivers and their warm host stay in the service's session, each leading its own process group.

With the kernel's session autogroups (``sched_autogroup_enabled``), a driver in a session
of its own went unscheduled while the vLLM server's processes in another kept both
cores busy, and its streams arrived in bursts (``service.control.procs``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.conftest import make_client, wait_finished
from tests.service_process import driver_pids, host_pids


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    """A service with the warm driver host on (the default), said here since it is checked."""
    with make_client(tmp_path, warm_drivers=True) as c:
        yield c


def test_workers_and_drivers_share_the_services_session(client: TestClient) -> None:
    run = wait_finished(client, client.post("/api/runs", json={"input_len": 16, "output_len": 4,
                                                               "num_prompts": 2}).json()["id"])
    assert run["status"] == "succeeded"
    worker = client.get(f"/api/workers/{run['worker_id']}").json()
    pid = worker["pid"]
    assert os.getsid(pid) == os.getsid(0)
    assert os.getpgid(pid) == pid != os.getpgid(0)
    drivers = driver_pids()
    assert drivers, "the service keeps a spare driver ready"
    hosts = host_pids()
    assert len(hosts) == 1, "the drivers' warm host"
    for driver in [*drivers, *hosts]:
        assert os.getsid(driver) == os.getsid(0)
        # A spare just spawned makes its group as its first act: give it a moment.
        deadline = time.monotonic() + 10
        while os.getpgid(driver) != driver and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.getpgid(driver) == driver
