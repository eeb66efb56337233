"""The running decode median a progress display reads: the summary's figure, kept as
requests end, whatever order they come in."""

from __future__ import annotations

import random

import pytest

from service.analysis.metrics import decode_stats
from service.analysis.running_decode import BIN_WIDTH, RunningDecode
from service.core.sample import Sample

pytestmark = pytest.mark.unit


def _run(n: int, concurrency: int, seed: int, failed_every: int = 0) -> list[Sample]:
    """A closed-loop run: ``concurrency`` slots, each request waiting a random time for its
    first token (a prefill), then decoding ``gaps`` gaps of jittered length."""
    rng = random.Random(seed)
    free = [0.0] * concurrency
    samples = []
    for i in range(n):
        slot = min(range(concurrency), key=free.__getitem__)
        start = free[slot] + rng.uniform(0, 0.002)
        ttft = rng.choice([0.001, 0.01, 0.2]) * rng.uniform(0.5, 1.5)
        itl = [rng.uniform(0.004, 0.03) for _ in range(rng.randint(0, 40))]
        latency = ttft + sum(itl)
        free[slot] = start + latency
        ok = not (failed_every and i % failed_every == 0)
        samples.append(Sample(index=i, prompt_len=8, output_tokens=len(itl) + 1, ttft=ttft, itl=itl,
                              latency=latency, start_time=start, success=ok))
    return samples


def _by_end(samples: list[Sample]) -> list[Sample]:
    return sorted(samples, key=lambda s: s.start_time + s.latency)


@pytest.mark.parametrize(("n", "concurrency", "seed"), [(1, 1, 0), (2, 1, 1), (200, 8, 2), (600, 64, 3)])
def test_the_running_median_is_the_summarys_whatever_order_the_requests_end_in(
        n: int, concurrency: int, seed: int) -> None:
    samples = _run(n, concurrency, seed, failed_every=7)
    expected = decode_stats(samples)
    for order in (_by_end(samples), random.Random(seed).sample(samples, len(samples))):
        running = RunningDecode()
        for k in range(0, len(order), 13):  # in batches, as the runner saves them
            running.add(order[k:k + 13])
        median, gaps = running.figure()
        assert gaps == expected["decode_gaps"]
        if expected["decode_gaps"]:
            assert median == pytest.approx(expected["decode_median_itl_ms"], rel=BIN_WIDTH)
        else:
            assert median is None


def test_a_later_prefill_takes_the_gaps_it_stalled_out_of_the_figure() -> None:
    # A decodes two 10 ms gaps, then three of 50 ms: B's prefill, which waits from 0.13 s to
    # 0.28 s for its first token. B ends after A: until it comes, A's slow gaps count.
    a = Sample(index=0, prompt_len=8, output_tokens=6, ttft=0.1, itl=[0.01, 0.01, 0.05, 0.05, 0.05],
               latency=0.27, start_time=0.0, success=True)
    b = Sample(index=1, prompt_len=8, output_tokens=3, ttft=0.15, itl=[0.01, 0.01], latency=0.17,
               start_time=0.13, success=True)
    running = RunningDecode()
    running.add([a])
    assert running.figure() == (pytest.approx(50.0, rel=BIN_WIDTH), 5)
    running.add([b])
    assert decode_stats([a, b])["decode_gaps"] == 4
    assert running.figure() == (pytest.approx(10.0, rel=BIN_WIDTH), 4)


def test_nothing_answered_has_no_median() -> None:
    running = RunningDecode()
    running.add([Sample(index=0, prompt_len=8, output_tokens=0, ttft=0.0, itl=[], latency=0.0,
                        start_time=0.0, success=False)])
    assert running.figure() == (None, 0)
