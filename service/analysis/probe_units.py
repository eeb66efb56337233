"""The independent units of a decode probe, and the figure and verdict built on them.

vLLM decodes every running request in the same engine steps, so the C requests of one wave
share their inter-token times, and a run on a shared machine drifts as a whole (20-27% from
run to run was seen on a busy 2-core machine). So:

- Within a trial the unit is an engine step for ITL (the full-batch gaps at one token
  position of one wave, the C requests started together: their median) and a wave for TPOT
  (the mean full-batch TPOT of its requests). Units of one trial are taken as independent
  of each other once the trial's level is known; the requests of one wave never are.
- Across trials the unit is the trial. Its *level* is the log of its units' median. The
  spread of levels between trials of one probe is pooled over the search's probes that have
  two trials or more (``Drift``), and a Student t quantile on those pooled degrees of freedom
  carries it into every interval: drift is never assumed away. With nothing pooled yet there
  is no interval, and the probe gets another trial.
- A median metric's figure is that of the typical (median) run: the geometric mean of the
  trials' medians, with a t interval on their logs at the look's confidence.
- A p99 metric is judged by attainment: the share of units at or under the limit, each
  trial's units scaled to the trials' common level, with an exact Clopper-Pearson bound at
  half the look's error; the other half goes to the common level's own t interval, by
  which the limit is moved before units are counted. A pass needs ``needed_units`` units at
  least: fewer can only fail by interval, and otherwise reach a verdict by point estimate.

``tests/test_capacity_units.py`` checks the coverage on a lock-step stand-in engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from service.analysis.intervals import Interval
from service.analysis.steady_window import steady_masks
from service.core.capacity_records import SearchLooks
from service.core.sample import Sample

# The statistic of each SLA metric: over which units (steps' ITL, waves' TPOT) and which quantile.
STATISTICS: dict[str, tuple[str, float]] = {
    "decode_median_itl_ms": ("itl", 0.5),
    "decode_p99_itl_ms": ("itl", 0.99),
    "decode_median_tpot_ms": ("tpot", 0.5),
    "decode_p99_tpot_ms": ("tpot", 0.99),
}
# A quantile above this is a tail limit, judged by attainment.
TAIL = 0.9
# Trials whose units disagree beyond their runs' own spread at this level (Kruskal-Wallis)
# are said to drift, and a boundary probe among them gets every trial the cap allows.
DRIFT_P = 0.01
# The least variance of a trial's level (log units): identical units would otherwise make a
# trial's own interval zero wide.
WITHIN_FLOOR = 1e-8
# The asymptotic variance of a sample median is pi/2 x sigma^2 / n (normal units); sigma
# from the interquartile range (1.349 sigma), which tail steps barely move.
MEDIAN_VARIANCE = math.pi / 2
IQR_PER_SIGMA = 1.349

UNIT_NAMES = {"itl": "engine steps (the gaps at one token position of one wave)",
              "tpot": "waves (the C requests run together)"}


def kind_of(metric: str) -> str:
    """Which units a metric is taken over: ``itl`` (engine steps) or ``tpot`` (waves)."""
    return STATISTICS[metric][0]


def is_tail(metric: str) -> bool:
    """Whether a metric is a tail limit, judged by attainment."""
    return STATISTICS[metric][1] > TAIL


def method_text(metric: str) -> str:
    """How a probe of ``metric`` is judged, in words, for the stored look and the API."""
    kind, q = STATISTICS[metric]
    units = UNIT_NAMES[kind]
    drift = ("runs drift as a whole: the spread of trials' levels, pooled over the search's probes "
             "with two trials or more, widens every interval through a Student t quantile on "
             "those pooled degrees of freedom")
    if q > TAIL:
        return (f"attainment: the share of {units} at or under the limit, each trial's units scaled "
                f"to the trials' common level, with an exact Clopper-Pearson bound at half the look's "
                f"error and the level's t interval at the other half; passes when the bound is at "
                f"least {q:.0%}; {drift}")
    return (f"the typical run's {'median' if q == 0.5 else f'p{q * 100:g}'} over {units}: the "
            f"geometric mean of the trials' figures with a t interval on their logs; {drift}")


def trial_units(samples: Sequence[Sample], concurrency: int, kind: str) -> np.ndarray:
    """The independent units of one trial (seconds), over its full-batch gaps (while all
    ``concurrency`` requests decoded and none waited for its first token): per engine step
    (``kind`` "itl") the median of the gaps at one token position of one wave, per wave
    (``kind`` "tpot") the mean of its requests' TPOT over their full-batch gaps. A wave is
    ``concurrency`` requests consecutive in start time."""
    ok = [s for s in samples if s.success]
    if not ok:
        return np.empty(0)
    masks = steady_masks(ok, min_decoding=concurrency)
    # Requests sent C at a time start together and, with one output length, end together:
    # the k-th C of them by start time ran as one batch, in the same engine steps.
    ranks = np.empty(len(ok), dtype=np.int64)
    ranks[np.argsort([s.start_time for s in ok], kind="stable")] = np.arange(len(ok))
    waves = ranks // max(1, concurrency)
    kept = [(int(w), np.flatnonzero(keep), np.asarray(s.itl, dtype=np.float64))
            for s, keep, w in zip(ok, masks, waves, strict=True)]
    kept = [(w, idx, itl) for w, idx, itl in kept if idx.size]
    if not kept:
        return np.empty(0)
    if kind == "tpot":
        wave = np.array([w for w, _, _ in kept])
        tpot = np.array([itl[idx].mean() for _, idx, itl in kept])
        _, inverse = np.unique(wave, return_inverse=True)
        means: np.ndarray = np.bincount(inverse, weights=tpot) / np.bincount(inverse)
        return means
    width = 1 + max(itl.size for _, _, itl in kept)
    keys = np.concatenate([w * width + idx for w, idx, _ in kept])
    values = np.concatenate([itl[idx] for _, idx, itl in kept])
    order = np.lexsort((values, keys))
    keys, values = keys[order], values[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    counts = np.diff(np.r_[starts, keys.size])
    medians: np.ndarray = (values[starts + (counts - 1) // 2] + values[starts + counts // 2]) / 2
    return medians


@dataclass(frozen=True)
class Level:
    """A trial's level: the log of its units' median, the variance of that within the trial
    (from the units' interquartile range) and how many units it has."""

    log: float
    within: float
    units: int


def trial_level(units: np.ndarray) -> Level | None:
    """The level of a trial from its units (seconds); None without a positive unit."""
    logs = np.log(units[units > 0])
    if not logs.size:
        return None
    n = int(logs.size)
    # numpy's percentiles: scipy's iqr costs ten times as much, paid per trial per look.
    quartiles = np.percentile(logs, [25.0, 75.0])
    spread = float(quartiles[1] - quartiles[0]) / IQR_PER_SIGMA if n >= 2 else math.inf
    within = MEDIAN_VARIANCE * spread**2 / n if math.isfinite(spread) else math.inf
    return Level(float(np.median(logs)), max(within, WITHIN_FLOOR), n)


@dataclass(frozen=True)
class Drift:
    """The between-trial spread of levels pooled over probes: the sum of squared deviations
    of trials' levels from their probe's mean, and its degrees of freedom (trials - 1 per
    probe)."""

    ss: float = 0.0
    df: int = 0

    def add(self, levels: Sequence[float]) -> Drift:
        """With one more probe's trial levels."""
        if len(levels) < 2:
            return self
        x = np.asarray(levels, dtype=np.float64)
        return Drift(self.ss + float(((x - x.mean()) ** 2).sum()), self.df + x.size - 1)

    @property
    def variance(self) -> float:
        """The pooled variance of one trial's level (NaN with no degrees of freedom)."""
        return self.ss / self.df if self.df else math.nan


def drift_from_looks(looks: SearchLooks, leave_out: str | None = None) -> Drift:
    """The drift pooled over a search's decode looks (their trials' ``levels``), but the one
    at ``leave_out`` (the probe being looked at again)."""
    pooled = Drift()
    for key, look in looks.probes.items():
        if key != leave_out and look.levels:
            pooled = pooled.add(look.levels)
    return pooled


def needed_units(confidence: float, target: float) -> int:
    """The fewest units that can show a share of at least ``target`` by the Clopper-Pearson
    bound taken at ``confidence`` (all of them meeting the limit; none of the level's
    widening): its lower end for n of n is ((1 - confidence) / 2) ^ (1 / n)."""
    return math.ceil(math.log((1 - confidence) / 2) / math.log(target))


@dataclass(frozen=True)
class ProbeFigure:
    """A probe's figure (ms; an interval end may be infinite: nothing bounds it yet) and, for
    a tail limit, its attainment (share of units meeting the limit, with its bounds), with
    what they rest on."""

    figure: Interval
    levels: tuple[float, ...]
    within: tuple[float, ...]
    units: int
    # The pooled spread used (this probe's own trials in it) and the per-trial sd taken.
    drift: Drift
    sd: float
    # The chance of the trials' disagreement were the runs alike (``disagreement_p``).
    disagreement_p: float | None
    attainment: Interval | None
    target: float | None
    needed: int | None
    method: str

    @property
    def drifts(self) -> bool:
        """Whether the trials disagree beyond their run intervals."""
        return self.disagreement_p is not None and self.disagreement_p < DRIFT_P


def disagreement_p(units_by_trial: Sequence[np.ndarray]) -> float | None:
    """The chance that trials' units differ as much as they do were the runs alike (a
    Kruskal-Wallis test: distribution-free, so tail steps do not pass for drift, and it
    weighs each run's own spread as measured: a run's four waves say little of it); None
    with under two trials."""
    groups = [u for u in units_by_trial if u.size]
    if len(groups) < 2:
        return None
    if np.ptp(np.concatenate(groups)) == 0:
        return 1.0  # every unit alike: nothing differs
    return float(stats.kruskal(*groups).pvalue)


def clopper_pearson(k: int, n: int, confidence: float) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a share from ``k`` of ``n``: what
    ``scipy.stats.binomtest(k, n).proportion_ci(method="exact")`` gives, read straight off
    the beta quantiles it solves for (that call finds them by root finding, twenty times
    slower, and a search pays it at every look)."""
    tail = (1 - confidence) / 2
    low = float(stats.beta.ppf(tail, k, n - k + 1)) if k > 0 else 0.0
    high = float(stats.beta.ppf(1 - tail, k + 1, n - k)) if k < n else 1.0
    return low, high


def probe_figure(units_by_trial: Sequence[np.ndarray], metric: str, confidence: float,
                 max_ms: float | None = None, drift: Drift | None = None) -> ProbeFigure | None:
    """A probe's figure from its trials' units (seconds) at ``confidence``, the drift pooled
    from the search's other probes (``drift``) and, for a tail limit, its attainment at
    ``max_ms``; None without a trial with units."""
    trials = [(u, level) for u in units_by_trial if (level := trial_level(u)) is not None]
    if not trials:
        return None
    _, q = STATISTICS[metric]
    levels = np.array([lv.log for _, lv in trials])
    within = np.array([lv.within for _, lv in trials])
    n = levels.size
    centre = float(levels.mean())
    pooled = (drift or Drift()).add(levels.tolist())
    own = float(levels.var(ddof=1)) if n >= 2 else 0.0
    # A trial's level varies by the pooled drift; by more where this probe's own trials
    # spread more, or where its units are few: the largest of the three is taken.
    variance = max(pooled.variance, own, float(within.mean())) if pooled.df else math.inf
    alpha = 1 - confidence
    disagreement = disagreement_p([u for u, _ in trials])
    units = int(sum(lv.units for _, lv in trials))

    def half(error: float) -> float:
        if not pooled.df:
            return math.inf
        return float(stats.t.ppf(1 - error / 2, pooled.df)) * math.sqrt(variance / n)

    attainment = target = needed = None
    if q <= TAIL:
        h = half(alpha)
        figure = Interval(math.exp(centre), math.exp(centre - h), _exp(centre + h),
                          confidence).scaled(1000.0)
    else:
        # Every trial's units brought to the trials' common level: what remains is the shape
        # of a run's units, and the common level's own error (h) moves the limit.
        scaled = np.concatenate([u[u > 0] * math.exp(centre - lv.log) for u, lv in trials])
        h = half(alpha / 2)
        value = float(np.quantile(scaled, q))
        ci = stats.quantile_test(scaled, q=value, p=q).confidence_interval(1 - alpha / 2)
        lo = float(ci.low) * math.exp(-h) if np.isfinite(ci.low) else 0.0
        hi = float(ci.high) * _exp(h) if np.isfinite(ci.high) else math.inf
        figure = Interval(value * 1000.0, lo * 1000.0, hi * 1000.0, confidence)
        target, needed = q, needed_units(1 - alpha / 2, q)
        if max_ms is not None:
            limit, size = max_ms / 1000.0, int(scaled.size)
            low, _ = clopper_pearson(int(np.sum(scaled <= limit * math.exp(-h))), size, 1 - alpha / 2)
            _, high = clopper_pearson(int(np.sum(scaled <= limit * _exp(h))), size, 1 - alpha / 2)
            attainment = Interval(float(np.mean(scaled <= limit)), low, high, confidence)
    return ProbeFigure(figure=figure, levels=tuple(levels.tolist()), within=tuple(within.tolist()),
                       units=units, drift=pooled, sd=math.sqrt(variance), disagreement_p=disagreement,
                       attainment=attainment, target=target, needed=needed, method=method_text(metric))


def _exp(x: float) -> float:
    """e^x, infinite past what a float holds (a look of one trial beside one other has a
    drift interval wide enough that e^h overflows: nothing bounds it)."""
    return math.inf if x > 709.0 else math.exp(x)


def units_of(trials: Iterable[Sequence[Sample]], concurrency: int, metric: str) -> list[np.ndarray]:
    """The units of each trial for ``metric`` (``trial_units``)."""
    return [trial_units(samples, concurrency, kind_of(metric)) for samples in trials]
