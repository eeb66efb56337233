"""Stop rules: when a run has measured enough, and the record of why it stopped.

A run with ``stop.itl_ci_pct`` keeps sending until the interval of its median decode ITL
(the steady-decode gaps of ``steady_window.steady_gaps``, resampled by whole requests) lies
within +-``itl_ci_pct`` percent of the median.

Looking at a 95% interval again and again and stopping the first time it is narrow is
optional stopping: among many looks one is narrow by chance, and the interval given at
that stop holds the true median less often than 95%. So the rule looks only at counts of
answered requests planned from the spec (``service.analysis.looks``): ``min_prompts``, then each time the
count doubles, and the budget; K looks at most, K known before the run. Each look's
interval has confidence 1 - 5%/K, so the chance that any of the K intervals misses the
true median is at most 5% (Bonferroni): the interval a run reports misses it in at most
5% of runs, whichever look each stopped at. A look is taken over the requests answered
up to its count (in the order they were answered), so the rule gives the same answer
however often it is asked: asking more often adds no looks. A sweep's ``until_decided``
rule over pairs of trials plans its looks the same way (``planned_looks``; see
``service.analysis.pairs``).

The interval reported with a run that has the rule is taken over every answered request
at the looks' confidence, whatever ended the run (after a stop, the look's requests and
the few that were in flight). While a run goes on, the gaps are taken
from the answered requests only; a request still waiting for its first token is not
known yet, so a few gaps that overlap it may count as steady until the final summary,
which sees every request. The runner calls these functions; their answers depend on
their arguments only (the looks' intervals are cached, see ``_Taken``).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from service.analysis.intervals import Interval, pooled_median_ci
from service.analysis.looks import Looks, planned_looks
from service.analysis.steady_window import steady_gaps
from service.core.sample import Sample
from service.core.spec import RunSpec

# Rules, as recorded in ``Run.stopped_by["rule"]``.
ITL_CI = "itl_ci"
DURATION = "duration"
MAX_PROMPTS = "max_prompts"
NUM_PROMPTS = "num_prompts"

METHOD = "Bonferroni over the planned looks"


def looks(spec: RunSpec) -> Looks | None:
    """The looks of ``spec``'s interval rule; None without one."""
    if spec.stop is None or spec.stop.itl_ci_pct is None:
        return None
    return planned_looks(spec.stop_min_prompts(), spec.prompt_budget())


@dataclass(frozen=True)
class RuleInterval(Interval):
    """The interval of a run with an interval rule (at its looks' confidence) and what the
    rule did: it took the first ``taken`` of the looks ``counts`` and was met at the look
    of ``met_at`` answered requests (None: at none of them)."""

    counts: tuple[int, ...] = ()
    taken: int = 0
    met_at: int | None = None


class _Taken:
    """The intervals of the looks taken, by a digest of their gaps and confidence. The
    runner asks the rule about once a second and a look's answer never changes, so each
    look is bootstrapped once: asking between looks costs the steady gaps and a hash, and
    the run's record finds its looks again. Keeps the latest ``size``; the runner asks
    from worker threads, hence the lock."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._known: OrderedDict[bytes, Interval | None] = OrderedDict()

    def interval(self, groups: list[np.ndarray], confidence: float) -> Interval | None:
        """``pooled_median_ci(groups, confidence)``, computed once per content."""
        digest = hashlib.blake2b(np.float64(confidence).tobytes(), digest_size=16)
        for g in groups:
            digest.update(np.int64(g.size).tobytes())
            digest.update(np.ascontiguousarray(g, dtype=np.float64).tobytes())
        key = digest.digest()
        with self._lock:
            if key in self._known:
                self._known.move_to_end(key)
                return self._known[key]
        interval = pooled_median_ci(groups, confidence)
        with self._lock:
            self._known[key] = interval
            while len(self._known) > self.size:
                self._known.popitem(last=False)
        return interval


_TAKEN = _Taken(256)


def _take_looks(spec: RunSpec, plan: Looks, samples: Sequence[Sample]) -> tuple[int, Interval | None]:
    """The looks ``samples`` have reached, in order, until one is within the asked width:
    how many were taken, and that one's interval."""
    assert spec.stop is not None and spec.stop.itl_ci_pct is not None
    answered = [i for i, s in enumerate(samples) if s.success]
    taken = 0
    for count in plan.counts[:plan.reached(len(answered))]:
        taken += 1
        interval = _TAKEN.interval(steady_gaps(samples[:answered[count - 1] + 1]), plan.confidence)
        if interval is not None and interval.half_width_pct() <= spec.stop.itl_ci_pct:
            return taken, interval
    return taken, None


def itl_rule_met(spec: RunSpec, samples: Sequence[Sample]) -> Interval | None:
    """The interval of the look at which ``spec``'s interval rule is met by these samples
    (in the order they were answered); else None."""
    plan = looks(spec)
    if plan is None:
        return None
    return _take_looks(spec, plan, samples)[1]


def itl_interval(samples: Sequence[Sample], spec: RunSpec | None = None) -> Interval | None:
    """Median decode ITL (s) of the answered requests with its 95% interval, or with
    ``spec``'s interval rule its looks' interval and what the rule did (a ``RuleInterval``);
    None with fewer than two requests that have steady gaps."""
    plan = looks(spec) if spec is not None else None
    if spec is None or plan is None:
        return pooled_median_ci(steady_gaps(samples))
    interval = pooled_median_ci(steady_gaps(samples), plan.confidence)
    if interval is None:
        return None
    taken, met = _take_looks(spec, plan, samples)
    return RuleInterval(**asdict(interval), counts=plan.counts, taken=taken,
                        met_at=plan.counts[taken - 1] if met is not None else None)


def _pct(confidence: float) -> str:
    return f"{100 * confidence:.3g}%"


def _meaning(interval: Interval) -> str:
    """What the interval is, in a sentence or two."""
    if not isinstance(interval, RuleInterval):
        return f"The interval is a {_pct(interval.confidence)} bootstrap interval over requests."
    k = len(interval.counts)
    at = ", ".join(str(c) for c in interval.counts)
    return (f"The interval is a {_pct(interval.confidence)} bootstrap interval over requests: "
            f"the rule may look at {k} counts of answered requests ({at}) and gives each look "
            f"1/{k} of the 5% chance to miss the true median, so its looks together miss it "
            f"at most 5% of the time, whichever look a run stops at ({METHOD}); this run took "
            f"{interval.taken} look{'s' if interval.taken != 1 else ''}. The summary's 95% "
            "intervals are computed as for a fixed count of requests.")


def record(rule: str, spec: RunSpec, sent: int, interval: Interval | None) -> dict[str, Any]:
    """``Run.stopped_by``: the rule that ended the sending, in a sentence, with the interval
    of the median decode ITL the run reached (ms), what that interval is, and with an
    interval rule its looks."""
    out: dict[str, Any] = {"rule": rule, "requests": sent}
    if interval is not None and math.isfinite(interval.half_width_pct()):
        out |= {
            "median_itl_ms": interval.value * 1000,
            "itl_ci_ms": [interval.lo * 1000, interval.hi * 1000],
            "itl_ci_pct": interval.half_width_pct(),
            "itl_ci_confidence": interval.confidence,
            "itl_ci_means": _meaning(interval),
        }
        if isinstance(interval, RuleInterval):
            out["looks"] = {"planned": len(interval.counts), "counts": list(interval.counts),
                            "taken": interval.taken, "met_at": interval.met_at,
                            "confidence": interval.confidence, "method": METHOD}
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
    if "itl_ci_means" in out:
        text += ". " + out["itl_ci_means"]
    out["message"] = text
    return out
