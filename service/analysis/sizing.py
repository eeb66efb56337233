"""Sizing a disaggregated deployment: decode servers per prefill server at one input length,
from a prefill rate (given, or measured by ``service.analysis.prefill_rate``) and a capacity
search's boundary and its mean TPOT (``service.analysis.capacity_runs.boundary_tpots``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from service.analysis.intervals import Spread, across_trials


@dataclass(frozen=True)
class ServersRatio:
    """Decode servers per prefill server at one input length, with its inputs:

    - a prefill server admits P = prefill tokens/s / input_len requests/s: given (exact),
      or measured, a bracket from the last passing rate to the first failing one (open at
      the top, ``prefill_requests_per_s_hi`` None, where the highest rate asked passed);
    - a decode server finishes D = C_max / (output_len x mean TPOT at C_max) requests/s:
      request throughput needs the mean TPOT (the median would not do), taken per trial of
      the boundary's probe, with a 95% Student-t interval over those trials;
    - so P / D decode servers keep up with one prefill server.

    Its range carries every input's own: P's bracket, D's interval over trials and C_max's
    range (``concurrency_range``, the search's): D's bottom is C_max's bottom over the TPOT
    interval's top, its top C_max's top over the TPOT's bottom (a TPOT that grows with
    concurrency makes both ends wider than the truth, never narrower). It holds when the
    P bracket and C_max's range are right and D's interval holds: no single probability
    is stated for it (``confidence`` is None).
    """

    prefill_requests_per_s: float
    prefill_requests_per_s_hi: float | None
    measured: bool
    input_len: int
    output_len: int
    max_concurrency: int
    concurrency_range: tuple[int, int]
    # The mean TPOT at C_max (s) with its 95% interval over trials; NaN ends with one trial.
    tpot_s: Spread
    decode_requests_per_s: float
    decode_requests_per_s_range: tuple[float, float | None]
    ratio: float
    ratio_range: tuple[float, float | None]

    @property
    def prefill_tokens_per_s(self) -> float:
        """P in tokens/s (at the bottom of a measured bracket)."""
        return self.prefill_requests_per_s * self.input_len

    @property
    def prefill_tokens_per_s_hi(self) -> float | None:
        """P's top in tokens/s (P itself when given; None when open)."""
        hi = self.prefill_requests_per_s_hi
        return None if hi is None else hi * self.input_len

    def sentence(self) -> str:
        """The answer in a planner's words: '1 decode server per 16 prefill servers
        (between 1 per 20 and 1 per 12)'; "at least" or "at most" where one end is open or
        0, and "its range is unbounded" where both are (no verdict with a confidence on
        either side: a C_max range from 0 makes D's bottom 0 and the top open)."""
        lo, hi = self.ratio_range
        if hi is None:
            between = ("its range is unbounded: no verdict with a confidence bounds it" if lo <= 0
                       else f"at least {planner_words(lo)}")
        else:
            between = (f"at most {planner_words(hi)}" if lo <= 0
                       else f"between {planner_words(lo)} and {planner_words(hi)}")
        return f"{planner_words(self.ratio)} ({between})"


def planner_words(ratio: float) -> str:
    """Decode servers per prefill server as a planner reads it: '3.2 decode servers per
    prefill server', or under one, '1 decode server per 16 prefill servers'."""
    if ratio <= 0:
        return "no decode server"
    if ratio >= 1:
        return f"{ratio:.3g} decode server{'s' if ratio != 1 else ''} per prefill server"
    return f"1 decode server per {1 / ratio:.3g} prefill servers"


def servers_ratio(prefill_tokens_per_s: float, input_len: int, output_len: int, max_concurrency: int,
                  tpot_trials_s: Sequence[float], concurrency_range: tuple[int, int] | None = None,
                  prefill_tokens_per_s_hi: float | None = None, measured: bool = False,
                  prefill_range: tuple[float, float | None] | None = None) -> ServersRatio | None:
    """P / D from the prefill rate (given; or ``measured`` up to ``prefill_tokens_per_s_hi``,
    None for an open top) and the mean TPOT (s) of each trial at the boundary; None without
    a boundary (no probe passed) or a positive TPOT. ``prefill_range`` (tokens/s): where a
    measured P lies by the verdicts that carry a confidence (``prefill_rate.sure_bracket``),
    which the ratio's range carries instead of the bracket of point verdicts."""
    tpot = across_trials(tpot_trials_s)
    if max_concurrency < 1 or tpot is None or tpot.mean <= 0:
        return None
    c_lo, c_hi = concurrency_range or (max_concurrency, max_concurrency)
    p = prefill_tokens_per_s / input_len
    p_hi = (None if measured and prefill_tokens_per_s_hi is None
            else (prefill_tokens_per_s_hi or prefill_tokens_per_s) / input_len)
    d = max_concurrency / (output_len * tpot.mean)
    # With one trial the TPOT has no interval: its value stands for both ends (said so).
    t_lo = tpot.lo if math.isfinite(tpot.lo) and tpot.lo > 0 else tpot.mean
    t_hi = tpot.hi if math.isfinite(tpot.hi) else tpot.mean
    d_lo = c_lo / (output_len * t_hi)
    d_hi = c_hi / (output_len * t_lo)
    r_lo, r_hi = (p, p_hi) if prefill_range is None else (
        prefill_range[0] / input_len, None if prefill_range[1] is None else prefill_range[1] / input_len)
    ratio_lo = r_lo / d_hi
    ratio_hi = None if r_hi is None or d_lo <= 0 else r_hi / d_lo
    return ServersRatio(p, p_hi, measured, input_len, output_len, max_concurrency, (c_lo, c_hi), tpot,
                        d, (d_lo, d_hi), p / d, (ratio_lo, ratio_hi))
