"""Whole capacity searches on the stand-in engine (``tests/lockstep_engine.py``): the range
a search states holds the true boundary, with drift between runs as large as 27%, and
without drift the search still finds the boundary itself. Every step is the real one:
``next_step`` plans, ``take_look`` looks (the drift pooled from the search's other looks, as
``control.capacity.advance`` pools it), ``look_state`` reads the look back."""

from __future__ import annotations

import numpy as np
import pytest

from service.analysis import capacity
from service.core.capacity import SLA_METRICS
from tests.lockstep_engine import BOUNDARY, CEILING, limit_of, search

# --- whole searches: the stated range holds the true boundary ----------------------------


def simulated_search(rng: np.random.Generator, metric: str, sigma: float,
                     max_runs: int = 32) -> tuple[capacity.Step, int]:
    """One search on the stand-in (``lockstep_engine.search``): its last step and runs spent."""
    step, runs = search(rng, metric, sigma, limit_of(metric), CEILING, max_runs=max_runs)
    return step, runs



@pytest.mark.usefixtures("no_rate")
def test_simulated_searches_hold_the_true_boundary_in_their_stated_range() -> None:
    # 1,000 searches, a third each at sigma 0, 0.2 and 0.27, every metric in turn (ceiling
    # 16: 24 looks planned, each at 99.79%; budget 32 runs). Measured (seeds as here):
    # - the stated range held the true boundary (6) in all of them, at every sigma;
    # - without drift the answer was 6 in 1.00 / 1.00 / 0.92 / 1.00 of the searches (median
    #   ITL / median TPOT / p99 ITL / p99 TPOT); a median limit's range was exactly [6, 6] in
    #   0.99 (a p99 limit cannot pass by interval on a few hundred units: its range stays
    #   open below); drift was said (wrongly) in 0.03; 14 runs in the median, 24 at most;
    # - at sigma 0.2 the answer was 6 in 0.93 / 0.94 / 0.87 / 0.84, at 0.27 in 0.80 / 0.75 /
    #   0.81 / 0.80, by point estimate, drift said in every search: with drift that large no
    #   interval decides at 99.79% on three runs, and the stated range is honestly the whole
    #   bracket [0, 16].
    rng = np.random.default_rng(46)
    sigmas = (0.0, 0.2, 0.27)
    results: list[tuple[float, str, capacity.Step, int]] = []
    for i in range(1000):
        sigma, metric = sigmas[i % 3], SLA_METRICS[(i // 3) % 4]
        step, runs = simulated_search(rng, metric, sigma)
        results.append((sigma, metric, step, runs))
    held = [s.surely[0] <= BOUNDARY <= s.surely[1] for _, _, s, _ in results]
    assert np.mean(held) >= 0.93
    for sigma in sigmas:
        mine = [h for (sg, *_), h in zip(results, held, strict=True) if sg == sigma]
        assert np.mean(mine) >= 0.93, (sigma, np.mean(mine))
    steady = [(m, s) for sg, m, s, _ in results if sg == 0.0]
    found_six = {m: np.mean([s.last_pass == BOUNDARY for mm, s in steady if mm == m]) for m in SLA_METRICS}
    assert min(found_six.values()) >= 0.8, found_six
    # ... and a median limit's range is the boundary itself: every verdict by an interval.
    exact = [s.surely == (BOUNDARY, BOUNDARY) for m, s in steady if "median" in m]
    assert np.mean(exact) >= 0.8, np.mean(exact)
    assert all(s.surely[0] <= s.last_pass <= s.surely[1] for _, _, s, _ in results)


