"""Intervals and comparisons against scipy.stats on fixed data, and verdicts on synthetic sets."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from service.analysis.intervals import (
    across_trials,
    pooled_quantile_ci,
    quantile_ci,
    ratio_by_requests,
    ratio_by_trials,
)
from service.analysis.metrics import summarize
from service.analysis.summary_intervals import summary_intervals
from service.core.sample import Sample

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("q", [0.5, 0.99])
def test_request_interval_is_scipys_bootstrap(q: float) -> None:
    x = np.random.default_rng(11).lognormal(size=80)
    mine = quantile_ci(x, q, seed=5)
    ref = stats.bootstrap(
        (x,), lambda s, axis: np.quantile(s, q, axis=axis), vectorized=True, n_resamples=999,
        method="percentile", random_state=np.random.default_rng(5)).confidence_interval
    assert mine is not None
    assert mine.value == np.quantile(x, q)
    assert (mine.lo, mine.hi) == pytest.approx((ref.low, ref.high), rel=1e-12)


@pytest.mark.parametrize("q", [0.0, 0.01, 0.5, 0.9, 0.99, 1.0])
def test_pooled_quantile_resamples_whole_requests(q: float) -> None:
    # Each resample's statistic is numpy's quantile of the drawn requests' gaps pooled,
    # so the interval is the percentile bootstrap a plain loop over the same draws gets.
    rng = np.random.default_rng(3)
    groups = [rng.gamma(2, 1 + i % 5, size=rng.integers(1, 40)) for i in range(30)]
    interval = pooled_quantile_ci(groups, q, n_resamples=499, seed=9)
    assert interval is not None
    assert interval.value == np.quantile(np.concatenate(groups), q)
    draws = np.random.default_rng(9).integers(0, 30, size=(499, 30))
    values = [np.quantile(np.concatenate([groups[i] for i in row]), q) for row in draws]
    assert [interval.lo, interval.hi] == pytest.approx(np.percentile(values, [2.5, 97.5]))
    assert pooled_quantile_ci(groups[:1], q) is None


def test_across_trials_is_a_student_t_interval_with_the_cv() -> None:
    values = [12.1, 12.9, 11.7, 12.4]
    spread = across_trials(values)
    assert spread is not None
    lo, hi = stats.t.interval(0.95, 3, loc=np.mean(values), scale=stats.sem(values))
    assert (spread.mean, spread.lo, spread.hi) == pytest.approx((np.mean(values), lo, hi))
    assert spread.cv == pytest.approx(np.std(values, ddof=1) / np.mean(values))
    one = across_trials([3.0])
    assert one is not None and one.n == 1 and math.isnan(one.lo)
    assert one.as_dict() == {"mean": 3.0, "ci": None, "cv": None, "n": 1}


def test_trial_ratio_is_welchs_interval_on_the_logs() -> None:
    a, b = [10.0, 10.4, 9.9, 10.2], [11.2, 10.8, 11.5]
    found = ratio_by_trials(a, b)
    assert found is not None
    ref = stats.ttest_ind(np.log(b), np.log(a), equal_var=False).confidence_interval(0.95)
    assert (found.lo, found.hi) == pytest.approx((math.exp(ref.low), math.exp(ref.high)))
    assert found.value == pytest.approx(stats.gmean(b) / stats.gmean(a))
    assert ratio_by_trials([1.0], b) is None


def _requests(rng: np.random.Generator, scale: float, n: int = 40, gaps: int = 64) -> list[np.ndarray]:
    # Requests whose gaps share a per-request level (correlated gaps), as real streams do.
    return [rng.normal(scale * rng.normal(1, 0.03), 0.05 * scale, size=gaps) for _ in range(n)]


@pytest.mark.parametrize("seed", [1, 2])
def test_ten_percent_apart_is_different_and_one_distribution_is_not(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, same, slower = _requests(rng, 10.0), _requests(rng, 10.0), _requests(rng, 11.0)
    differ = ratio_by_requests(a, slower, 0.5, seed=seed)
    assert differ is not None and differ.differs() and differ.lo > 1.0
    assert differ.value == pytest.approx(1.1, rel=0.03)
    alike = ratio_by_requests(a, same, 0.5, seed=seed)
    assert alike is not None and not alike.differs()
    # Trials: five per arm, each trial's level drifting by 2%.
    trials_a = rng.normal(10.0, 0.2, size=5)
    assert ratio_by_trials(trials_a, rng.normal(11.0, 0.22, size=5)).differs()  # type: ignore[union-attr]
    assert not ratio_by_trials(trials_a, rng.normal(10.0, 0.2, size=5)).differs()  # type: ignore[union-attr]


def test_one_distribution_is_called_different_about_one_time_in_twenty() -> None:
    # A 95% interval calls two draws of one distribution different 5% of the time (the
    # fixed-seed case above is one of the other 95%); 200 pairs of 16 requests show the
    # rate stays near that, and that a 10% change is found nearly every time.
    rng = np.random.default_rng(0)
    same = sum(ratio_by_requests(_requests(rng, 10.0, 16, 32), _requests(rng, 10.0, 16, 32), 0.5,
                                 seed=i).differs() for i in range(200))  # type: ignore[union-attr]
    apart = sum(ratio_by_requests(_requests(rng, 10.0, 16, 32), _requests(rng, 11.0, 16, 32), 0.5,
                                  seed=i).differs() for i in range(50))  # type: ignore[union-attr]
    assert 2 <= same <= 20
    assert apart >= 48


def test_summary_intervals_hold_the_summary_values() -> None:
    rng = np.random.default_rng(4)
    samples = []
    for i in range(30):
        gaps = list(rng.normal(0.01, 0.001, size=15))
        ttft = float(rng.normal(0.05, 0.005))
        samples.append(Sample(index=i, success=True, start_time=i * 0.5, ttft=ttft, itl=gaps,
                              latency=ttft + sum(gaps), output_tokens=16, prompt_len=32))
    summary = summarize(samples, 20.0)
    intervals = summary_intervals(samples)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("median", "p99"):
            lo, hi = intervals[f"{stat}_{name}_ms_ci"]
            assert lo <= summary[f"{stat}_{name}_ms"] <= hi  # type: ignore[operator]
    lo, hi = intervals["decode_median_itl_ms_ci"]
    assert lo <= summary["decode_median_itl_ms"] <= hi  # type: ignore[operator]
    assert summary_intervals(samples[:1]) == {}


def test_a_bootstrap_whose_resamples_reach_a_zero_statistic_gives_no_interval_and_no_warning() -> None:
    # Four of A's ten requests have a zero median gap (tokens that arrived together): some
    # resamples of A have a median of 0, where B/A has no bound. pytest turns warnings into
    # errors here, as it did when this made the percentiles compute inf - inf.
    a = [[0.0]] * 4 + [[0.01]] * 6
    b = [[0.01]] * 10
    assert ratio_by_requests(a, b, 0.5) is None
    # A's requests all positive: an interval as usual.
    found = ratio_by_requests([[0.01, 0.012]] * 5 + [[0.011]] * 5, b, 0.5)
    assert found is not None and found.lo <= found.value <= found.hi


def test_a_positive_figures_interval_over_trials_never_reaches_below_zero() -> None:
    from service.analysis.intervals import T_LOGS, T_MEAN, across_trials

    # Three trials of a p99 TPOT (ms) far apart: the t interval on their mean reaches below 0.
    values = [2.0, 28.0, 55.0]
    mean, sd = float(np.mean(values)), float(np.std(values, ddof=1))
    assert mean - float(stats.t.ppf(0.975, 2)) * sd / np.sqrt(3) < 0
    spread = across_trials(values)
    assert spread is not None and spread.method == T_LOGS
    assert spread.mean == pytest.approx(mean) and 0 < spread.lo <= spread.mean <= spread.hi
    # Close trials keep the interval on the mean; a signed figure keeps it whatever its ends.
    close = across_trials([10.0, 10.5, 9.8])
    assert close is not None and close.method == T_MEAN
    signed = across_trials([-3.0, 2.0, 9.0])
    assert signed is not None and signed.method == T_MEAN and signed.lo < 0
