"""Load drivers on a Ray cluster (``service.load.ray_drivers``): a local cluster of three
nodes on this machine, one token-streaming stub server, short runs.

One cluster for the module (starting one takes seconds); a test that kills a node adds
its own first.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# ``make test`` installs the ``ray`` extra: these tests run, never skip.
import ray
from ray import cluster_utils

from service.core.sample import Sample
from service.core.spec import RunSpec
from service.load.driver import DriverConfig
from service.load.plan import LoadShape
from service.load.ray_drivers import _REMOTE_HOST, RayDriverBackend, host_name
from service.load.shards import (
    DriverError,
    ShardedRun,
    run_configs,
)
from service.settings import Settings
from tests.conftest import stub_server

# A local Ray cluster: left out of ``make test-quick``.
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
NAMESPACE = f"decodebench-test-{uuid.uuid4().hex[:8]}"
# A shard silent this long is hung. These tests are not about the hang check (the tests that
# are set their own): on a machine the rest of the suite keeps busy a shard starting on a
# node was once silent for more than 15 s.
HANG_S = 60


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    # Node deaths noticed within about a second and a half, not the default half minute.
    fast = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
            "health_check_failure_threshold": 3}
    cluster = cluster_utils.Cluster(initialize_head=True,
                                    head_node_args={"num_cpus": 1, "_system_config": fast})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def backend(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayDriverBackend]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("data"), ray_namespace=NAMESPACE)
    backend = RayDriverBackend(settings)
    backend.start()  # connected already: a no-op
    try:
        yield backend
    finally:
        asyncio.run(backend.close())


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    with stub_server() as url:
        yield url


def worker_node(cluster: Any) -> str:
    """A node that is not the head (the service's own process runs on the head)."""
    return str(next(n.node_id for n in cluster.list_all_nodes() if n is not cluster.head_node))


def host_node(node_id: str) -> str:
    actor = ray.get_actor(host_name(node_id), namespace=NAMESPACE)
    return str(ray.get(actor.node.remote(), timeout=30)["node_id"])


def test_samples_come_back_once_from_a_shard_on_the_servers_node(
        cluster: Any, backend: RayDriverBackend, stub: str) -> None:
    node = worker_node(cluster)
    spec = RunSpec(input_len=8, output_len=4, num_prompts=24, max_concurrency=4, request_rate=16.0,
                   warmup_prompts=2, seed=1)
    drivers = backend.drivers_for("r-ray-one", spec, stub, "stub", 1000, 30, hang_s=HANG_S, node_id=node)
    samples: list[Sample] = []
    before = time.perf_counter()
    duration = asyncio.run(drivers.run(samples.append))
    after = time.perf_counter()

    assert sorted(s.index for s in samples) == list(range(24))  # every request, once
    assert all(s.success for s in samples)
    assert drivers.shard_nodes == {0: node} and host_node(node) == node
    # On the service's clock: every request started within the run, as the service saw it.
    assert all(before < s.start_time and s.start_time + s.latency < after for s in samples)
    assert 0 < duration < after - before
    [clock] = drivers.clocks
    assert clock["node_id"] == node and clock["shard"] == 0
    # One machine, one monotonic clock: the offset is within the measurement's uncertainty.
    assert 0 < clock["uncertainty_s"] < 0.1
    assert abs(clock["offset_s"]) <= clock["uncertainty_s"] + 0.005
    assert drivers.beats and all(before < b["t"] < after for b in drivers.beats)


def test_driver_nodes_spreads_the_shards_over_that_many_nodes(
        cluster: Any, backend: RayDriverBackend, stub: str) -> None:
    node = worker_node(cluster)
    spec = RunSpec(input_len=8, output_len=4, num_prompts=16, max_concurrency=4, seed=2,
                   driver_nodes=2)
    drivers = backend.drivers_for("r-ray-two", spec, stub, "stub", 1000, 30, hang_s=HANG_S, node_id=node)
    samples: list[Sample] = []
    asyncio.run(drivers.run(samples.append))

    assert sorted(s.index for s in samples) == list(range(16))
    assert len(drivers.configs) == 2 and drivers.shard_nodes[0] == node
    assert len(set(drivers.shard_nodes.values())) == 2
    assert {c["node_id"] for c in drivers.clocks} == set(drivers.shard_nodes.values())
    assert all(host_node(n) == n for n in drivers.shard_nodes.values())


def test_more_driver_nodes_than_the_cluster_has_fail_the_run(
        cluster: Any, backend: RayDriverBackend, stub: str) -> None:
    spec = RunSpec(input_len=8, output_len=4, num_prompts=4, driver_nodes=9)
    drivers = backend.drivers_for("r-ray-nine", spec, stub, "stub", 1000, 30, hang_s=HANG_S,
                                  node_id=worker_node(cluster))
    with pytest.raises(DriverError, match="on 9 nodes"):
        asyncio.run(drivers.run(lambda s: None))


def test_a_node_lost_mid_run_fails_it_by_name_and_keeps_its_samples(
        cluster: Any, backend: RayDriverBackend, stub: str) -> None:
    doomed = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    node = str(doomed.node_id)
    ip = str(doomed.node_ip_address)
    # About 8 s of requests at 25 a second; the node goes after the first ten samples.
    spec = RunSpec(input_len=8, output_len=4, num_prompts=200, max_concurrency=4, request_rate=25.0,
                   seed=3)
    # A hang bound well above the time the node's loss takes to be noticed (asserted below):
    # on a loaded machine (4 workers on 2 cores, or 3 busy loops beside the test) the new
    # node's first driver once sent nothing for 10 s, and the run failed as hung before it began.
    drivers = backend.drivers_for("r-ray-lost", spec, stub, "stub", 1000, 30, hang_s=30, node_id=node)
    samples: list[Sample] = []
    removed: list[float] = []

    async def drive() -> None:
        enough = asyncio.Event()

        def on_sample(sample: Sample) -> None:
            samples.append(sample)
            if len(samples) >= 10:
                enough.set()

        async def remove() -> None:
            await enough.wait()
            removed.append(time.perf_counter())
            await asyncio.to_thread(cluster.remove_node, doomed)

        remover = asyncio.create_task(remove())
        try:
            await drivers.run(on_sample)
        finally:
            # A run that ended before its tenth sample would leave the remover waiting
            # forever: it ends here, and the assertions below say what the run did.
            if not enough.is_set():
                remover.cancel()
            await asyncio.gather(remover, return_exceptions=True)

    began = time.perf_counter()
    with pytest.raises(DriverError) as failed:
        asyncio.run(drive())
    ended = time.perf_counter()

    assert node in str(failed.value) and ip in str(failed.value)
    assert removed and len(samples) >= 10, (len(samples), str(failed.value))
    indexes = [s.index for s in samples]
    assert len(indexes) == len(set(indexes)) and len(indexes) < 200
    # Noticed well before the run would have ended or the hang timeout passed.
    assert ended - removed[0] < 10, (ended - removed[0], ended - began)


def test_stop_sending_ends_the_run_early_with_what_was_sent(
        cluster: Any, backend: RayDriverBackend, stub: str) -> None:
    spec = RunSpec(input_len=8, output_len=4, num_prompts=200, max_concurrency=4, request_rate=25.0,
                   seed=4)
    drivers = backend.drivers_for("r-ray-stop", spec, stub, "stub", 1000, 30, hang_s=HANG_S,
                                  node_id=worker_node(cluster))
    samples: list[Sample] = []

    async def drive() -> float:
        def on_sample(sample: Sample) -> None:
            samples.append(sample)
            if len(samples) == 10:
                asyncio.get_running_loop().create_task(drivers.stop_sending("itl_ci"))

        return await drivers.run(on_sample)

    duration = asyncio.run(drive())
    assert drivers.stopped_rule == "itl_ci" and 10 <= drivers.sent < 200
    # Every request sent finished and came back, once.
    assert sorted(s.index for s in samples) == sorted({s.index for s in samples})
    assert len(samples) == drivers.sent and duration < 8


def test_cancel_stops_the_shards_and_hands_on_what_they_sent(
        cluster: Any, backend: RayDriverBackend, stub: str) -> None:
    spec = RunSpec(input_len=8, output_len=4, num_prompts=200, max_concurrency=4, request_rate=25.0,
                   seed=5)
    drivers = backend.drivers_for("r-ray-cancel", spec, stub, "stub", 1000, 30, hang_s=HANG_S,
                                  node_id=worker_node(cluster))
    samples: list[Sample] = []
    took: list[float] = []

    async def drive() -> None:
        enough = asyncio.Event()

        def on_sample(sample: Sample) -> None:
            samples.append(sample)
            if len(samples) >= 10:
                enough.set()

        run = asyncio.create_task(drivers.run(on_sample))
        # A run that ends before its tenth sample (a shard found hung) fails the test with
        # its error, never leaves it waiting for samples that will not come.
        waiting = asyncio.create_task(enough.wait())
        await asyncio.wait({run, waiting}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        assert enough.is_set(), (len(samples), run.exception() if run.done() else "no ten samples in 120 s")
        began = time.perf_counter()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        took.append(time.perf_counter() - began)

    asyncio.run(drive())
    indexes = [s.index for s in samples]
    assert 10 <= len(indexes) < 200 and len(indexes) == len(set(indexes))
    # SIGTERM reached the shard: it flushed and went, no SIGKILL after STOP_WAIT_S.
    assert took[0] < 2.5, took


def test_a_host_stops_a_shard_the_service_stopped_asking_about(cluster: Any, stub: str) -> None:
    # A service that died leaves its shards on hosts that outlive it (detached actors).
    strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(worker_node(cluster),
                                                                              soft=False)
    host = _REMOTE_HOST.options(num_cpus=0, scheduling_strategy=strategy).remote(NAMESPACE, 0, 1.0)
    try:
        [config] = run_configs("r-ray-orphan", RunSpec(input_len=8, output_len=4, num_prompts=4),
                               stub, "stub", 1000, 30)
        key = ray.get(host.open.remote(config.model_dump_json(), "r-ray-orphan.driver0.log"), timeout=60)
        assert ray.get(host.lines.remote(key, 0, 0.5), timeout=30)[1] is None  # running
        time.sleep(3)
        with pytest.raises(ray.exceptions.RayTaskError, match="KeyError"):
            ray.get(host.lines.remote(key, 0, 0.1), timeout=30)
    finally:
        ray.get(host.close.remote(), timeout=30)
        ray.kill(host)


def test_times_from_another_host_are_moved_onto_the_services_clock() -> None:
    config = DriverConfig(run_id="r", spec=LoadShape.of(RunSpec(num_prompts=1)), base_url="http://x",
                          served_model="m", vocab_size=None, request_timeout_s=1)
    run = ShardedRun([config], hang_s=1)
    got: list[Sample] = []
    sample = {"index": 0, "prompt_len": 1, "output_tokens": 2, "ttft": 0.5, "itl": [0.25],
              "latency": 1.0, "start_time": 110.0, "success": True, "due_time": 109.5,
              "sent_time": None}
    run.take(0, {"kind": "sample", "sample": sample}, got.append, offset=100.0)
    run.take(0, {"kind": "beat", "t": 112.0, "cpu": 0.1, "lag_ms": 0.0, "open": 1,
                 "last_data": 111.0, "oldest_open": 110.0}, got.append, offset=100.0)
    [moved] = got
    # Instants move; spans (ttft, itl, latency) stay as measured.
    assert (moved.start_time, moved.due_time, moved.sent_time) == (10.0, 9.5, None)
    assert (moved.ttft, moved.itl, moved.latency) == (0.5, [0.25], 1.0)
    assert run.beats[0]["t"] == 12.0 and run.progress[0] == (1, 11.0, 10.0, 12.0)
