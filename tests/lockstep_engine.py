"""A stand-in decode engine whose truth is known, for the capacity search's proofs: it
decodes in lock-step (the C requests of a wave share every engine step's time), drifts from
run to run (a lognormal factor per run) and has tail steps (occasional slow ones). It makes
the ``Sample`` objects a load driver would record, and says the true figure of each SLA
metric in the typical run (factor 1), so that a stated interval can be checked against it."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy import optimize, stats

from service.analysis.probe_units import STATISTICS
from service.core.capacity import probe_prompts
from service.core.sample import Sample

# The stand-in engine. A step at concurrency c takes BASE x (1 + SLOPE c) seconds, KNEE times
# that from KNEE_AT on (the batch no longer fits something): the true boundary of every limit
# below is 6, the 6/7 of the stand-in. Each step is jittered (lognormal, JITTER) and
# TAIL_SHARE of them are TAIL_FACTOR times slower; a run multiplies all its steps by its factor.
BASE, SLOPE, KNEE, KNEE_AT = 0.020, 0.08, 1.5, 7
JITTER, TAIL_SHARE, TAIL_FACTOR = 0.05, 0.03, 2.0
OUTPUT_LEN = 16  # 15 steps a wave: enough for a steady window, small enough to be quick
TTFT = 0.05
CEILING = 16
BOUNDARY = 6


def step_s(c: int) -> float:
    """A step's time at concurrency ``c`` in the typical run, before jitter and tail."""
    return BASE * (1 + SLOPE * c) * (KNEE if c >= KNEE_AT else 1.0)


def trial(rng: np.random.Generator, c: int, sigma: float, index: int = 0,
          step: Callable[[int], float] = step_s) -> list[Sample]:
    """One probe run at ``c`` on the stand-in, as a load driver records it: waves of ``c``
    requests started together, each request's gaps its wave's steps (``step``: a step's
    time at a concurrency in the typical run, the stand-in's own by default)."""
    n = probe_prompts(c)
    waves = -(-n // c)
    factor = math.exp(sigma * rng.standard_normal())
    shape = (waves, OUTPUT_LEN - 1)
    steps = (step(c) * factor * np.exp(JITTER * rng.standard_normal(shape))
             * np.where(rng.random(shape) < TAIL_SHARE, TAIL_FACTOR, 1.0))
    out: list[Sample] = []
    start = float(index) * 1000.0
    for w in range(waves):
        gaps = steps[w].tolist()
        latency = TTFT + sum(gaps)
        out += [Sample(index=len(out) + r, prompt_len=1024, output_tokens=OUTPUT_LEN, ttft=TTFT,
                       itl=gaps, latency=latency, start_time=start, success=True)
                for r in range(min(c, n - w * c))]
        start += latency + 1e-4
    return out


# --- the truth: a step's and a wave's TPOT distribution in the typical run (factor 1) ----


def step_cdf(x: float) -> float:
    """P(step <= x x step_s(c)) for any c: jitter, and the tail's share at TAIL_FACTOR."""
    return float((1 - TAIL_SHARE) * stats.norm.cdf(math.log(x) / JITTER)
                 + TAIL_SHARE * stats.norm.cdf(math.log(x / TAIL_FACTOR) / JITTER))


def _wave_tpots() -> np.ndarray:
    # A wave's TPOT over step_s(c): the mean of its steps; drawn once, a million waves.
    rng = np.random.default_rng(2026)
    shape = (1_000_000, OUTPUT_LEN - 1)
    steps = np.exp(JITTER * rng.standard_normal(shape)) * np.where(rng.random(shape) < TAIL_SHARE,
                                                                   TAIL_FACTOR, 1.0)
    return np.sort(steps.mean(axis=1))


WAVE_TPOTS = _wave_tpots()


@functools.cache
def true_figure(metric: str, c: int) -> float:
    """The metric (ms) of the typical run at ``c``: its units' quantile."""
    kind, q = STATISTICS[metric]
    if kind == "itl":
        shape = float(optimize.brentq(lambda x: step_cdf(x) - q, 0.5, 10.0))
    else:
        shape = float(np.quantile(WAVE_TPOTS, q))
    return 1000.0 * step_s(c) * shape


def true_share(metric: str, c: int, max_ms: float) -> float:
    """The typical run's share of units at or under ``max_ms``."""
    x = max_ms / 1000.0 / step_s(c)
    if STATISTICS[metric][0] == "itl":
        return step_cdf(x)
    return float(np.searchsorted(WAVE_TPOTS, x, side="right") / WAVE_TPOTS.size)


def limit_of(metric: str) -> float:
    """A limit halfway (geometrically) between the figures at 6 and 7: the boundary is 6."""
    return math.sqrt(true_figure(metric, BOUNDARY) * true_figure(metric, BOUNDARY + 1))


def true_boundary(metric: str, max_ms: float) -> int:
    """The largest concurrency whose typical run meets the limit."""
    return max(c for c in range(1, CEILING + 1) if true_figure(metric, c) <= max_ms)


# --- a whole search on the stand-in ------------------------------------------------------


def search(rng: np.random.Generator, metric: str, sigma: float, max_ms: float, ceiling: int,
           step: Callable[[int], float] = step_s, max_runs: int = 32, aimed: bool = True,
           growth: Callable[[float], float] | None = None) -> tuple[Any, int]:
    """One search on the stand-in as ``control.capacity.advance`` runs it: the planner's
    queue (``next_step``), a trial per queued probe, a look at each probe whose trials ended
    (``take_looks``: the drift pooled from the search's other looks). Its last step and the
    runs it spent (stopped before it would spend more than ``max_runs``)."""
    from service.analysis import capacity, capacity_runs
    from service.core.capacity_records import SearchLooks, probe_key

    plan = capacity.plan_for(ceiling)
    bounds = (capacity.Bound(ceiling, "max_concurrency", ""),)
    trials: dict[int, list[list[Sample]]] = {}
    looks = SearchLooks()
    probes: dict[int, Any] = {}
    runs = 0
    while True:
        found = capacity.next_step(probes, max_ms, bounds, plan.trial_cap, aimed=aimed, growth=growth)
        if found.done or found.error or runs + len(found.queue) > max_runs:
            return found, runs
        assert found.queue, found
        for c in found.queue:
            trials.setdefault(c, []).append(trial(rng, c, sigma, runs, step=step))
            runs += 1
        due = [capacity_runs.LookDue(probe_key(1024, c), c, trials[c],
                                [f"r{c}-{k}" for k in range(len(trials[c]))])
               for c in dict.fromkeys(found.queue)]
        looks = capacity_runs.take_looks(due, looks, metric, plan.per_look, max_ms)
        for probe in due:
            probes[probe.concurrency] = capacity_runs.look_state(probe.concurrency, looks.probes[probe.key])
