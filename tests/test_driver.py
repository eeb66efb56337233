"""Load driver shards: how many, their part of the concurrency, and one schedule on one
clock across processes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.core.sample import Sample
from service.core.spec import RunSpec
from service.load.driver import DriverConfig, shard_concurrency, shard_count
from service.load.plan import LoadShape, make_plan
from service.load.shards import DriverPool, Drivers, Progress, ShardedRun


@pytest.mark.parametrize(("spec", "cpus", "shards"), [
    ({"max_concurrency": 16, "num_prompts": 1000}, 8, 1),
    ({"max_concurrency": 256, "num_prompts": 1000}, 8, 1),
    ({"max_concurrency": 257, "num_prompts": 1000}, 8, 2),
    ({"max_concurrency": 1024, "num_prompts": 2048}, 2, 2),
    ({"max_concurrency": 1024, "num_prompts": 2048}, 16, 4),
    ({"max_concurrency": None, "num_prompts": 600}, 8, 3),
    ({"max_concurrency": None, "num_prompts": 10, "request_rate": 5.0}, 8, 1),
])
def test_one_shard_per_256_streams_at_most_one_per_core(spec: dict[str, object], cpus: int,
                                                        shards: int) -> None:
    assert shard_count(RunSpec(**spec), cpus) == shards  # type: ignore[arg-type]


@pytest.mark.parametrize(("limit", "shards"), [(1024, 4), (1025, 4), (7, 2), (3, 3)])
def test_shards_split_the_concurrency_limit_exactly(limit: int, shards: int) -> None:
    parts = [shard_concurrency(limit, k, shards) for k in range(shards)]
    assert sum(p or 0 for p in parts) == limit and max(parts) - min(parts) <= 1  # type: ignore[operator]
    assert shard_concurrency(None, 0, shards) is None


def test_shards_in_separate_processes_follow_one_schedule_on_one_clock(stub: str, tmp_path: Path) -> None:
    spec = RunSpec(input_len=16, output_len=4, num_prompts=24, max_concurrency=6, request_rate=40.0,
                   warmup_prompts=2, seed=5)
    shape = LoadShape.of(spec)
    configs = [DriverConfig(run_id="r-shards", spec=shape, base_url=stub, served_model="stub",
                            vocab_size=1000, request_timeout_s=30, shard=k, shards=3) for k in range(3)]
    samples: list[Sample] = []

    async def drive() -> float:
        pool = DriverPool(tmp_path)
        pool.start()
        try:
            return await Drivers(configs, pool, hang_s=30).run(samples.append)
        finally:
            await pool.close()

    duration = asyncio.run(drive())
    assert sorted(s.index for s in samples) == list(range(24))  # every request once
    assert all(s.success for s in samples)
    # One schedule: each request was due at t0 + its offset of the one seeded plan, whatever
    # shard (process) sent it, on one clock.
    plan = make_plan(spec, 1000)
    by_index = sorted(samples, key=lambda s: s.index)
    dues = np.array([s.due_time for s in by_index])
    assert np.allclose(dues - dues[0], plan.offsets - plan.offsets[0], atol=1e-6)
    assert min(s.start_time for s in samples) >= dues[0] - 1e-3
    assert duration >= max(s.start_time + s.latency for s in samples) - dues[0] - 1e-3


def test_a_service_slow_to_read_delays_samples_not_their_timing(stub: str, tmp_path: Path) -> None:
    # The service's event loop stalls 4 s at the first sample while 8 streams of 200 tokens
    # go on (a token every 5 ms): about 40 KB of samples a second, so the 64 KiB pipe
    # fills long before the stall ends. The driver keeps timing its streams meanwhile.
    spec = RunSpec(input_len=8, output_len=200, num_prompts=48, max_concurrency=8, seed=3)
    samples: list[Sample] = []
    stalled: list[float] = []

    def on_sample(sample: Sample) -> None:
        if not stalled:
            stalled.append(time.perf_counter())
            time.sleep(4)  # blocks the event loop: nothing reads the driver's pipe
            stalled.append(time.perf_counter())
        samples.append(sample)

    async def drive() -> None:
        pool = DriverPool(tmp_path)
        pool.start()
        try:
            await Drivers.for_run("r-slow-reader", spec, stub, "stub", 1000, 30, pool,
                                  hang_s=30).run(on_sample)
        finally:
            await pool.close()

    asyncio.run(drive())
    assert sorted(s.index for s in samples) == list(range(48))  # every request, once
    assert all(s.success for s in samples)
    during = [s for s in samples if stalled[0] < s.start_time + s.latency and s.start_time < stalled[1]]
    assert len(during) >= 16, len(during)
    # Timed as the stub sent them: no gap near the stall's seconds. A driver blocked on the
    # full pipe (full after about 1.6 s) would show a gap of 2 s or more; a busy machine's
    # scheduling alone shows gaps of up to about 0.5 s.
    assert max(g for s in during for g in s.itl) < 1.0
    assert max(s.ttft for s in during) < 1.0


def test_quiet_is_how_long_open_streams_waited_for_bytes(tmp_path: Path) -> None:
    shape = LoadShape.of(RunSpec(input_len=8, output_len=4, num_prompts=6))
    configs = [DriverConfig(run_id="r-quiet", spec=shape, base_url="http://127.0.0.1:1",
                            served_model="stub", vocab_size=None, request_timeout_s=30,
                            shard=k, shards=3) for k in range(3)]
    drivers = Drivers(configs, DriverPool(tmp_path), hang_s=30)
    assert drivers.quiet() is None  # until every shard has beaten
    # Bytes 10 s ago; the only open stream opened 1 s ago, after a pause between requests.
    drivers.progress = {0: Progress(1, 90.0, 99.0, 100.0), 1: Progress(0, 90.0, None, 100.0),
                        2: Progress(0, 90.0, None, 100.0)}
    assert drivers.quiet() == (1, 1.0)
    # A stream open 10 s on one shard is not hidden by one that opened since on another.
    drivers.progress[1] = Progress(1, 90.0, 90.5, 100.0)
    assert drivers.quiet() == (2, 9.5)
    # Bytes since, on any shard, end the quiet; with nothing open, nothing waits.
    drivers.progress[2] = Progress(0, 99.5, None, 100.0)
    assert drivers.quiet() == (2, 0.5)
    drivers.progress = {k: Progress(0, 90.0, None, 100.0) for k in range(3)}
    assert drivers.quiet() == (0, 0.0)


def _beat(t: float, open_now: int, last_data: float, oldest_open: float | None) -> dict[str, Any]:
    return {"kind": "beat", "cpu": 0.1, "lag_ms": 0.0, "t": t, "open": open_now,
            "last_data": last_data, "oldest_open": oldest_open}


def test_a_finished_shard_does_not_hide_a_stuck_one(tmp_path: Path) -> None:
    shape = LoadShape.of(RunSpec(input_len=8, output_len=4, num_prompts=6))
    configs = [DriverConfig(run_id="r-stuck", spec=shape, base_url="http://127.0.0.1:1",
                            served_model="stub", vocab_size=None, request_timeout_s=600,
                            shard=k, shards=3) for k in range(3)]
    run = ShardedRun(configs, hang_s=30)
    ignore: list[Sample] = []
    # Shard 2 finished its requests before it ever beat; shard 0 at t=100, once its last
    # stream got its last bytes.
    run.take(2, {"kind": "done", "duration": 1.0, "sent": 2}, ignore.append)
    run.take(0, _beat(100.0, 0, 100.0, None), ignore.append)
    run.take(0, {"kind": "done", "duration": 100.0, "sent": 2}, ignore.append)
    # Shard 1's two streams got nothing after t=100 and it goes on beating.
    run.take(1, _beat(100.0, 2, 100.0, 95.0), ignore.append)
    assert run.quiet() == (2, 0.0)
    run.take(1, _beat(160.0, 2, 100.0, 95.0), ignore.append)
    assert run.quiet() == (2, 60.0)
    run.take(1, _beat(400.0, 2, 100.0, 95.0), ignore.append)
    assert run.quiet() == (2, 300.0)
