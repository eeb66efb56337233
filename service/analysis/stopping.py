"""Stop rules: when a run has measured enough, and the record of why it stopped.

A run with ``stop.itl_ci_pct`` keeps sending until the 95% interval of its median
decode ITL (the steady-decode gaps of ``metrics.steady_gaps``, resampled by whole
requests) lies within +-``itl_ci_pct`` percent of the median. While the run goes on,
the gaps are taken from the answered requests only; a request still waiting for its
first token is not known yet, so a few gaps that overlap it may count as steady until
the final summary, which sees every request. Pure functions; the runner calls them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from service.analysis.intervals import Interval, pooled_median_ci
from service.analysis.metrics import steady_gaps
from service.core.sample import Sample
from service.core.spec import RunSpec

# Rules, as recorded in ``Run.stopped_by["rule"]``.
ITL_CI = "itl_ci"
DURATION = "duration"
MAX_PROMPTS = "max_prompts"
NUM_PROMPTS = "num_prompts"


def itl_interval(samples: Sequence[Sample]) -> Interval | None:
    """Median decode ITL (s) of the answered requests with its 95% interval; None with
    fewer than two requests that have steady gaps."""
    return pooled_median_ci(steady_gaps(samples))


def itl_rule_met(spec: RunSpec, samples: Sequence[Sample]) -> Interval | None:
    """The interval, when ``spec``'s interval rule is met by these samples; else None."""
    if spec.stop is None or spec.stop.itl_ci_pct is None:
        return None
    if sum(s.success for s in samples) < spec.stop_min_prompts():
        return None
    interval = itl_interval(samples)
    if interval is None or interval.half_width_pct() > spec.stop.itl_ci_pct:
        return None
    return interval


def record(rule: str, spec: RunSpec, sent: int, interval: Interval | None) -> dict[str, Any]:
    """``Run.stopped_by``: the rule that ended the sending, in a sentence, with the interval
    of the median decode ITL the run reached (ms)."""
    out: dict[str, Any] = {"rule": rule, "requests": sent}
    if interval is not None and math.isfinite(interval.half_width_pct()):
        out |= {
            "median_itl_ms": interval.value * 1000,
            "itl_ci_ms": [interval.lo * 1000, interval.hi * 1000],
            "itl_ci_pct": interval.half_width_pct(),
        }
        known = (f"median decode ITL {interval.value * 1000:.3g} ms "
                 f"[{interval.lo * 1000:.3g}, {interval.hi * 1000:.3g}], "
                 f"+-{interval.half_width_pct():.2g}%")
    else:
        # Fewer than two requests with steady gaps, or a median of 0 (streams that reached
        # the client all at once): no interval to give.
        known = "no interval of the median decode ITL (too few requests with decode gaps, or a median of 0)"
    asked = spec.stop.itl_ci_pct if spec.stop is not None else None
    if rule == ITL_CI:
        text = f"interval reached after {sent} requests: {known} (asked: +-{asked:g}%)"
    elif rule == DURATION:
        assert spec.stop is not None and spec.stop.duration_s is not None
        text = f"time box of {spec.stop.duration_s:g} s reached after {sent} requests; {known}"
    elif rule == MAX_PROMPTS:
        text = f"all {sent} requests allowed were sent"
        if asked is not None:
            text += f" before the interval was within +-{asked:g}%"
        text += f"; {known}"
    else:
        text = f"fixed count of {sent} requests (num_prompts); {known}"
    out["message"] = text
    return out
