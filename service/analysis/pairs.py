"""Fill against prefill from pairs of trials, how many pairs would decide, and the
sequential rule that runs pairs until a point is decided.

A *pair* is a fill trial and a prefill trial of one sweep point queued back to back
(their order drawn per pair). Drift of the machine between trials reaches both trials
of a pair alike, so it cancels in their ratio: the fill/prefill figure is the geometric
mean of the per-pair ratios with a Student t interval on their logs (n - 1 degrees of
freedom). An unpaired Welch interval is used only where some trials lack their partner.

How many pairs would decide: from the spread ``s`` of the per-pair log ratios, the
least ``n`` with ``t(n - 1) * s / sqrt(n) <= 0.05``, that is an interval within about
+-5% of the ratio: narrow enough to lie within the match band [0.95, 1.05] when the
ratio is near 1. One pair has no spread: ``PRIOR_LOG_SD`` (or the pooled spread of the
sweep's other points) stands in.

The sequential rule (a sweep's ``until_decided``) is the design of the stop rule within
a run (``service.analysis.stopping``): looks at planned counts only (the first pairs,
then doubling, then the budget), each look's interval at confidence 1 - 5%/K for K
planned looks (Bonferroni), so the interval a point reports misses the true ratio in
at most 5% of sweeps, whichever look it stopped at.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

from service.analysis.intervals import CONFIDENCE, Ratio
from service.analysis.looks import Looks, planned_looks

PAIRED = "paired t over pairs"
# Half-width on the log scale of an interval that decides (about +-5%).
DECIDING_HALF_WIDTH = 0.05
# The spread (sd of per-pair log ratios) assumed when a point has one pair and no other
# point of its sweep has two: 5 pairs at 4096 x 1 on this project's 2-core test machine
# gave 1.00 [0.97, 1.03], an sd of 0.024; 0.04 leaves room for noisier machines and
# asks for 5 pairs.
PRIOR_LOG_SD = 0.04
# No answer above this: a spread this wide will not be decided by adding pairs.
MAX_NEEDED = 1000
# The most pairs a point is advised to run (and may be added at once): past it the advice
# is that the difference is too small for the machine's noise, not a count nobody will run.
SENSIBLE_PAIRS = 32


def log_ratios(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    """log(b_i / a_i) of the pairs whose two values are positive."""
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    keep = (x > 0) & (y > 0) & np.isfinite(x) & np.isfinite(y)
    out: np.ndarray = np.log(y[keep]) - np.log(x[keep])
    return out


def ratio_by_pairs(a: Sequence[float], b: Sequence[float],
                   confidence: float = CONFIDENCE) -> Ratio | None:
    """B/A as the geometric mean of the per-pair ratios ``b_i / a_i``, with a Student t
    interval on their logs; None with fewer than two pairs of positive values."""
    d = log_ratios(a, b)
    if d.size < 2:
        return None
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    method = PAIRED if confidence == CONFIDENCE else f"{PAIRED}, {100 * confidence:.3g}% per look"
    if sd == 0.0:
        return Ratio(math.exp(mean), math.exp(mean), math.exp(mean), method, int(d.size), 0.0)
    lo, hi = stats.t.interval(confidence, d.size - 1, loc=mean, scale=sd / math.sqrt(d.size))
    return Ratio(math.exp(mean), math.exp(float(lo)), math.exp(float(hi)), method, int(d.size), sd)


def pairs_needed(log_sd: float, half_width: float = DECIDING_HALF_WIDTH,
                 confidence: float = CONFIDENCE) -> int | None:
    """The least number of pairs ``n >= 2`` with ``t(n - 1) * log_sd / sqrt(n) <=
    half_width`` (``n >= (t * s / half_width)^2``, t for that n); None above ``MAX_NEEDED``."""
    if not math.isfinite(log_sd):
        return None
    q = 0.5 + confidence / 2
    for n in range(2, MAX_NEEDED + 1):
        if float(stats.t.ppf(q, n - 1)) * log_sd / math.sqrt(n) <= half_width:
            return n
    return None


def pooled_log_sd(sds: Sequence[tuple[float, int]]) -> float | None:
    """The pooled sd of several points' per-pair log ratios (``(sd, pairs)`` each, pairs
    >= 2); None without any."""
    usable = [(sd, n) for sd, n in sds if n >= 2 and math.isfinite(sd)]
    if not usable:
        return None
    return math.sqrt(sum((n - 1) * sd**2 for sd, n in usable) / sum(n - 1 for _, n in usable))


def pair_looks(first: int, max_pairs: int) -> Looks:
    """The planned looks of a sweep's ``until_decided`` rule: ``first`` pairs, doubling,
    and the budget ``max_pairs``."""
    return planned_looks(first, max_pairs)


def next_look(plan: Looks, pairs: int) -> int | None:
    """The count of pairs of the next planned look after ``pairs``; None past the last."""
    return next((c for c in plan.counts if c > pairs), None)
