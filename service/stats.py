"""Intervals for the figures a run reports, with scipy's bootstrap.

Inter-token gaps of one request are correlated (they share its batch, its position in
the KV cache, its moments of client starvation), so an interval of a statistic over
gaps pooled from many requests resamples whole requests (a cluster bootstrap), never
single gaps: resampling gaps would treat 128 gaps of one request as 128 independent
draws and make the interval far too narrow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
# Resamples per interval. The interval's ends move by well under 1% of the median
# between seeds at this count on runs of 16-1000 requests, and a check stays cheap
# (about 0.1 s for 500 requests x 128 gaps).
RESAMPLES = 999
# Resamples evaluated at once: bounds the memory to BATCH x pooled values.
BATCH = 32


@dataclass(frozen=True)
class Interval:
    """A statistic with its ``confidence`` interval ``[lo, hi]``."""

    value: float
    lo: float
    hi: float

    def half_width_pct(self) -> float:
        """The larger distance from the value to an end, in percent of the value (inf for
        a value of 0 or an interval that could not be computed)."""
        if not self.value or not np.isfinite(self.lo) or not np.isfinite(self.hi):
            return float("inf")
        return 100.0 * max(self.value - self.lo, self.hi - self.value) / abs(self.value)


def pooled_median_ci(groups: Sequence[np.ndarray], confidence: float = CONFIDENCE,
                     n_resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """The median of all values of ``groups`` pooled (what ``np.median`` of the
    concatenation gives), with a percentile-bootstrap interval that resamples whole
    groups. None when there are fewer than two non-empty groups."""
    groups = [np.asarray(g, dtype=np.float64) for g in groups]
    groups = [g for g in groups if g.size]
    if len(groups) < 2:
        return None
    sizes = np.array([g.size for g in groups])
    values = np.concatenate(groups)
    owner = np.repeat(np.arange(len(groups)), sizes)
    order = np.argsort(values, kind="stable")
    values, owner = values[order], owner[order]
    n_groups = len(groups)
    # Any pooled median lies between the lowest group's lower middle value and the highest
    # group's upper middle value (below the first, every group has fewer than half its
    # values; from the second on, every group has more than half). Only the values in
    # that window are weighed per resample; the ones below it count per group.
    middles = [np.sort(g)[[(g.size - 1) // 2, g.size // 2]] for g in groups]
    start = int(np.searchsorted(values, min(m[0] for m in middles), side="left"))
    end = int(np.searchsorted(values, max(m[1] for m in middles), side="right"))
    below = np.bincount(owner[:start], minlength=n_groups)
    window, window_owner = values[start:end], owner[start:end]

    def statistic(picked: np.ndarray, axis: int = -1) -> np.ndarray:
        # ``picked``: group indices drawn with replacement, one row per resample. A
        # resample's pooled values are the sorted values weighted by how often their group
        # was drawn; its median is where the running weight reaches half the total.
        picked = np.atleast_2d(np.moveaxis(picked, axis, -1)).astype(np.int64)
        rows = picked.shape[0]
        counts = np.zeros((rows, n_groups), dtype=np.int64)
        np.add.at(counts, (np.arange(rows)[:, None], picked), 1)
        total = (counts @ sizes)[:, None]
        weight = (counts @ below)[:, None] + np.cumsum(counts[:, window_owner], axis=1)
        # Lower and upper middle, averaged like np.median does for an even count.
        low = np.argmax(2 * weight >= total, axis=1)
        high = np.argmax(2 * weight > total, axis=1)
        middle: np.ndarray = (window[low] + window[high]) / 2
        return middle

    result = stats.bootstrap(
        (np.arange(n_groups),), statistic, vectorized=True, batch=BATCH,
        n_resamples=n_resamples, confidence_level=confidence, method="percentile",
        random_state=np.random.default_rng(seed),
    )
    ci = result.confidence_interval
    return Interval(float(np.median(values)), float(ci.low), float(ci.high))
