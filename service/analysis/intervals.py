"""Intervals and comparisons for the figures a run reports, with scipy.

Three kinds of uncertainty, each with its own method:

- Within one trial, a statistic of per-request values (median TTFT, p99 TPOT) gets a
  percentile-bootstrap interval over requests (``scipy.stats.bootstrap``).
- Inter-token gaps of one request are correlated (they share its batch, its position in
  the KV cache, its moments of client starvation), so a statistic over gaps pooled from
  many requests resamples whole requests (a cluster bootstrap), never single gaps:
  resampling gaps would treat 128 gaps of one request as 128 independent draws and make
  the interval far too narrow.
- Across repeated trials of one point, the mean of the trials' values gets a Student-t
  interval (on the logs where a positive figure's interval would reach below zero), and
  the spread its coefficient of variation. Run-to-run drift on a shared
  machine is usually larger than the noise within one trial, so when trials exist they
  are what a comparison rests on.

A comparison of two arms (B against A) is the ratio B/A of one statistic: a two-sample
bootstrap over requests when either arm has a single trial, else a Welch t interval on
the logs of the trials' values (the ratio of their geometric means).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
# Resamples per interval. The interval's ends move by well under 1% of the median
# between seeds at this count on runs of 16-1000 requests.
RESAMPLES = 999
# Resamples evaluated at once: bounds the memory to BATCH x pooled values.
BATCH = 32


@dataclass(frozen=True)
class Interval:
    """A statistic with its ``confidence`` interval ``[lo, hi]``."""

    value: float
    lo: float
    hi: float
    confidence: float = CONFIDENCE

    def half_width_pct(self) -> float:
        """The larger distance from the value to an end, in percent of the value (inf for
        a value of 0 or an interval that could not be computed)."""
        if not self.value or not np.isfinite(self.lo) or not np.isfinite(self.hi):
            return float("inf")
        return 100.0 * max(self.value - self.lo, self.hi - self.value) / abs(self.value)

    def scaled(self, factor: float) -> Interval:
        """The same interval in other units."""
        return replace(self, value=self.value * factor, lo=self.lo * factor, hi=self.hi * factor)

    def pair(self) -> list[float]:
        """``[lo, hi]``, as the API returns it."""
        return [self.lo, self.hi]


# Bins of the sorted pooled values (below) and the most cells of the group-by-bin table
# (8 bytes each: 8 MB; a resample's work is about groups x bins, so fewer is faster too).
MAX_BINS = 2048
MAX_TABLE = 1_000_000


# Per request, the values a statistic pools: its gaps, or its one value.
Groups = Sequence[Sequence[float] | np.ndarray]


class PooledValues:
    """The values of many groups (one group per request), ready for bootstraps that
    resample whole groups: ``resampled(picked, q)`` is the ``q`` quantile (numpy's linear
    interpolation) of the values of the groups drawn in each resample, each value counted
    as often as its group was drawn: what ``np.quantile`` of the concatenated drawn groups
    gives, without concatenating. Made once, it serves every quantile of those values.

    The pooled values are sorted once and cut into bins of consecutive positions, with a
    table of how many values of each group fall in each bin. A resample's count per bin
    is then one matrix product (draw counts x table), which finds the bin holding the
    wanted order statistic; only that bin's values are weighed one by one. Exact, and
    about bins + values-per-bin work per resample instead of every value.

    Only groups with a finite value are kept (``len`` counts them), each without its
    values that are not finite.
    """

    def __init__(self, groups: Groups) -> None:
        arrays = [np.asarray(g, dtype=np.float64).ravel() for g in groups]
        # A copy only of a group with a value to drop.
        arrays = [a if (finite := np.isfinite(a)).all() else a[finite] for a in arrays]
        arrays = [a for a in arrays if a.size]
        self.n_groups = len(arrays)
        sizes = [a.size for a in arrays]
        self.sizes = np.array(sizes, dtype=np.float64)
        # Pooled values run to millions (every gap of a long run): each temporary is let go
        # as soon as it is used, and groups are numbered in 32 bits. Equal values may fall
        # in any order (the sort is not stable): an order statistic is the same value.
        values = np.concatenate(arrays) if arrays else np.empty(0)
        del arrays
        order = np.argsort(values)
        self.values = values[order]
        del values
        self.owner = np.repeat(np.arange(self.n_groups, dtype=np.int32), sizes)[order]
        del order
        n = self.values.size
        n_bins = max(1, min(n, MAX_BINS, MAX_TABLE // max(1, self.n_groups)))
        self.starts = np.linspace(0, n, n_bins + 1).astype(np.int64)
        lengths = np.diff(self.starts)
        self.width = int(lengths.max()) if n else 0
        # Bin by bin (a bin is a run of consecutive sorted values): no array as long as the
        # values. Filled a bin to a row, which is contiguous; used as groups x bins.
        by_bin = np.empty((n_bins, self.n_groups), dtype=np.float64)
        for b in range(n_bins):
            by_bin[b] = np.bincount(self.owner[self.starts[b]:self.starts[b + 1]], minlength=self.n_groups)
        self.table = np.ascontiguousarray(by_bin.T)
        del by_bin

    def __len__(self) -> int:
        return self.n_groups

    def value(self, q: float) -> float:
        """The ``q`` quantile of all the values."""
        return float(np.quantile(self.values, q))

    def resampled(self, picked: np.ndarray, q: float) -> np.ndarray:
        """``picked``: group indices drawn with replacement, one row per resample."""
        picked = np.atleast_2d(picked).astype(np.int64)
        rows = picked.shape[0]
        flat = (np.arange(rows)[:, None] * self.n_groups + picked).ravel()
        counts = np.bincount(flat, minlength=rows * self.n_groups).reshape(rows, self.n_groups)
        counts = counts.astype(np.float64)
        total = counts @ self.sizes
        h = (total - 1) * q
        k = np.floor(h)
        k_next = np.minimum(k + 1, total - 1)
        per_bin = counts @ self.table
        running = np.cumsum(per_bin, axis=1)
        low, high = self._order_stat(counts, per_bin, running, k), self._order_stat(
            counts, per_bin, running, k_next)
        result: np.ndarray = low + (h - k) * (high - low)
        return result

    def _order_stat(self, counts: np.ndarray, per_bin: np.ndarray, running: np.ndarray,
                    k: np.ndarray) -> np.ndarray:
        # The k-th smallest drawn value (from 0): the first position whose running count
        # passes k, found first among the bins, then within the one bin.
        rows = np.arange(counts.shape[0])
        b = np.argmax(running > k[:, None], axis=1)
        before = running[rows, b] - per_bin[rows, b]
        start, end = self.starts[b], self.starts[b + 1]
        position = start[:, None] + np.arange(self.width)[None, :]
        inside = position < end[:, None]
        position = np.minimum(position, self.values.size - 1)
        weight = np.where(inside, counts[rows[:, None], self.owner[position]], 0.0)
        at = np.argmax(before[:, None] + np.cumsum(weight, axis=1) > k[:, None], axis=1)
        found: np.ndarray = self.values[position[rows, at]]
        return found


def pooled(groups: Groups | PooledValues) -> PooledValues:
    """``groups`` ready for a bootstrap (as they are when they already are)."""
    return groups if isinstance(groups, PooledValues) else PooledValues(groups)


def pooled_quantile_ci(groups: Groups | PooledValues, q: float,
                       confidence: float = CONFIDENCE, n_resamples: int = RESAMPLES,
                       seed: int = 0) -> Interval | None:
    """The ``q`` quantile of all values of ``groups`` pooled (``np.quantile`` of the
    concatenation), with a percentile-bootstrap interval that resamples whole groups.
    None with fewer than two non-empty groups. ``groups`` may come as ``PooledValues``,
    made once for several quantiles."""
    values = pooled(groups)
    if len(values) < 2:
        return None

    def statistic(picked: np.ndarray, axis: int = -1) -> np.ndarray:
        return values.resampled(np.moveaxis(picked, axis, -1), q)

    result = stats.bootstrap(
        (np.arange(len(values)),), statistic, vectorized=True, batch=BATCH,
        n_resamples=n_resamples, confidence_level=confidence, method="percentile",
        random_state=np.random.default_rng(seed),
    )
    ci = result.confidence_interval
    return Interval(values.value(q), float(ci.low), float(ci.high), confidence)


def pooled_median_ci(groups: Groups | PooledValues, confidence: float = CONFIDENCE,
                     n_resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """``pooled_quantile_ci`` of the median."""
    return pooled_quantile_ci(groups, 0.5, confidence, n_resamples, seed)


def quantile_ci(values: Sequence[float] | np.ndarray, q: float, confidence: float = CONFIDENCE,
                n_resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """The ``q`` quantile of per-request values with a percentile-bootstrap interval over
    requests; None with fewer than two values."""
    return pooled_quantile_ci([[v] for v in np.asarray(values, dtype=np.float64).ravel()], q,
                              confidence, n_resamples, seed)


# How the interval of a mean over trials was found.
T_MEAN = "Student t over trials"
T_LOGS = "Student t on the logs over trials (the interval on the mean would fall below zero)"


@dataclass(frozen=True)
class Spread:
    """Repeated trials of one figure: their mean with a Student-t interval, the
    coefficient of variation (sample std / mean) and the number of trials. With one
    trial the interval and the CV are unknown (NaN). ``method``: ``T_MEAN``, or ``T_LOGS``
    for a positive figure whose interval on the mean would reach below zero."""

    mean: float
    lo: float
    hi: float
    cv: float
    n: int
    method: str = T_MEAN

    def as_dict(self) -> dict[str, float | int | list[float] | None]:
        """For the API: NaN becomes None."""
        finite = math.isfinite(self.lo) and math.isfinite(self.hi)
        return {"mean": self.mean, "ci": [self.lo, self.hi] if finite else None,
                "cv": self.cv if math.isfinite(self.cv) else None, "n": self.n}


def across_trials(values: Sequence[float] | np.ndarray, confidence: float = CONFIDENCE) -> Spread | None:
    """The mean of the trials' values with its Student-t interval (n - 1 degrees of
    freedom) and CV; None without values. Where every value is positive (a latency, a
    throughput) and that interval would reach below zero, the t interval is taken on the
    logs instead (around the geometric mean, which a positive figure's interval keeps above
    zero), and ``method`` says so."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if not x.size:
        return None
    mean = float(x.mean())
    if x.size < 2:
        return Spread(mean, math.nan, math.nan, math.nan, 1)
    sd = float(x.std(ddof=1))
    if sd == 0.0:
        return Spread(mean, mean, mean, 0.0, int(x.size))
    lo, hi = stats.t.interval(confidence, x.size - 1, loc=mean, scale=sd / math.sqrt(x.size))
    cv = sd / mean if mean else math.nan
    if lo <= 0 and bool((x > 0).all()):
        logs = np.log(x)
        lo, hi = np.exp(stats.t.interval(confidence, x.size - 1, loc=float(logs.mean()),
                                         scale=float(logs.std(ddof=1)) / math.sqrt(x.size)))
        # The mean lies above the geometric mean; an interval that must hold it is widened to it.
        return Spread(mean, float(lo), max(float(hi), mean), cv, int(x.size), T_LOGS)
    return Spread(mean, float(lo), float(hi), cv, int(x.size))


@dataclass(frozen=True)
class Ratio:
    """B/A of one statistic with its interval, and how the interval was found."""

    value: float
    lo: float
    hi: float
    method: str
    # Of an interval over pairs: how many, and the sd of their log ratios.
    pairs: int | None = None
    log_sd: float | None = None

    def differs(self) -> bool:
        """True when the interval excludes 1: B differs from A at the interval's confidence."""
        return self.lo > 1.0 or self.hi < 1.0

    def within(self, band: tuple[float, float]) -> bool:
        """True when the whole interval lies inside ``band``."""
        return band[0] <= self.lo and self.hi <= band[1]

    def outside(self, band: tuple[float, float]) -> bool:
        """True when the whole interval lies outside ``band``."""
        return self.lo > band[1] or self.hi < band[0]


BOOTSTRAP = "bootstrap over requests"
T_TRIALS = "Welch t over trials"


# What a bootstrap resample without a ratio (its A statistic 0) counts as: far above any
# ratio, yet small enough that scipy's standard error of the resamples stays finite.
UNBOUNDED = 1e100


def ratio_by_requests(a: Groups | PooledValues, b: Groups | PooledValues,
                      q: float, confidence: float = CONFIDENCE, n_resamples: int = RESAMPLES,
                      seed: int = 0) -> Ratio | None:
    """The ratio of the pooled ``q`` quantiles of B's and A's groups (one group per
    request: its gaps, or its one value), with a two-sample bootstrap that resamples each
    arm's requests on their own. None when an arm has under two requests or a zero
    statistic. Either arm may come as ``PooledValues``, made once for several quantiles."""
    qa, qb = pooled(a), pooled(b)
    if len(qa) < 2 or len(qb) < 2:
        return None
    base, other = qa.value(q), qb.value(q)
    if base <= 0 or other <= 0:
        return None

    def statistic(pa: np.ndarray, pb: np.ndarray, axis: int = -1) -> np.ndarray:
        va = qa.resampled(np.moveaxis(pa, axis, -1), q)
        vb = qb.resampled(np.moveaxis(pb, axis, -1), q)
        with np.errstate(divide="ignore", invalid="ignore"):
            # A resample whose A statistic is 0 has no ratio: UNBOUNDED stands for it (an
            # infinity would make the percentiles' interpolation and the spread inf - inf).
            out: np.ndarray = np.where(va > 0, vb / np.where(va > 0, va, 1.0), UNBOUNDED)
        return out

    result = stats.bootstrap(
        (np.arange(len(qa)), np.arange(len(qb))), statistic, vectorized=True,
        paired=False, batch=BATCH, n_resamples=n_resamples, confidence_level=confidence,
        method="percentile", random_state=np.random.default_rng(seed),
    )
    ci = result.confidence_interval
    if not (np.isfinite(ci.low) and np.isfinite(ci.high)) or ci.high >= UNBOUNDED / 2:
        return None  # zero statistics within the interval: no bound on the ratio
    return Ratio(other / base, float(ci.low), float(ci.high), BOOTSTRAP)


def ratio_by_trials(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray,
                    confidence: float = CONFIDENCE) -> Ratio | None:
    """The ratio of the geometric means of B's and A's trial values, with a Welch t
    interval on their logs; None unless each arm has two positive values."""
    la = np.log([v for v in a if v is not None and v > 0])
    lb = np.log([v for v in b if v is not None and v > 0])
    if la.size < 2 or lb.size < 2:
        return None
    va, vb = la.var(ddof=1) / la.size, lb.var(ddof=1) / lb.size
    diff = float(lb.mean() - la.mean())
    se = math.sqrt(va + vb)
    if se == 0.0:
        return Ratio(math.exp(diff), math.exp(diff), math.exp(diff), T_TRIALS)
    # Welch-Satterthwaite degrees of freedom.
    df = (va + vb) ** 2 / (va**2 / (la.size - 1) + vb**2 / (lb.size - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, df)) * se
    return Ratio(math.exp(diff), math.exp(diff - half), math.exp(diff + half), T_TRIALS)
