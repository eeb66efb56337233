"""The prefill side of a capacity search: the highest request rate a server prefills at
one input length while the p99 TTFT stays under a limit.

A *rate probe* is one real-prefill run (``service.core.capacity.prefill_spec``): one
output token per request, requests sent at the rate (Poisson arrivals, the base's
burstiness), as many as the search asks. Its verdict is its p99 TTFT against the limit,
by the run's point estimate (one run per rate; the summary's bootstrap interval is shown
beside it, not used): above the rate the server prefills, requests queue and TTFT grows
with the run, so the verdict turns sharply.

The search per input length (``next_rate``): double from the start rate until a rate
fails or the maximum passes, then bisect (geometric mean) between the last passing and
the first failing rate until they are within the asked precision. The answer is the last
passing rate R: P = R requests/s, R x input_len prefill tokens/s, given as the bracket
[R, first failing rate) (x input_len): the rate where the limit is crossed lies in it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.core.status import FINISHED, RunStatus
from service.storage.tables import Run

PASS, FAIL, PENDING, FAILED = "pass", "fail", "pending", "failed"
# Rate probes one input length may spend; its prefill stops undecided beyond them.
MAX_PREFILL_RUNS = 16
# Where a search's ``ended`` keeps why an input length's prefill search stopped unanswered.
PREFILL_KEY = "prefill {}"
# Rates are kept to this many significant digits (a run's request_rate, a folder name).
DIGITS = 4


def is_prefill_run(run: Run) -> bool:
    """Whether a run of a capacity search is a rate probe (not a decode probe)."""
    return run.spec.get("mode") == "prefill"


def rounded(rate: float) -> float:
    """A rate as the search asks for it: ``DIGITS`` significant digits."""
    return float(f"{rate:.{DIGITS}g}")


@dataclass(frozen=True)
class RateProbe:
    """One rate's run and what it showed."""

    rate: float
    run_id: str
    status: str
    p99_ttft_ms: float | None = None
    ci_ms: tuple[float, float] | None = None
    error: str | None = None

    def verdict(self, max_ms: float) -> str:
        """``pass`` / ``fail`` by the p99 TTFT, ``pending`` until the run ended, ``failed``
        when it ended without numbers."""
        if self.status not in FINISHED:
            return PENDING
        if self.p99_ttft_ms is None:
            return FAILED
        return PASS if self.p99_ttft_ms <= max_ms else FAIL


def rate_probes(runs: Iterable[Run], input_len: int) -> list[RateProbe]:
    """The rate probes of one input length, by rate (its latest run where one was repeated)."""
    out: dict[float, RateProbe] = {}
    for run in sorted(runs, key=lambda r: r.created_at):
        if not is_prefill_run(run) or int(run.spec["input_len"]) != input_len:
            continue
        summary = (run.summary or {}) if run.status == RunStatus.succeeded.value else {}
        p99 = summary.get("p99_ttft_ms")
        ci = summary.get("p99_ttft_ms_ci")
        rate = float(run.spec["request_rate"])
        out[rate] = RateProbe(rate, run.id, run.status,
                              float(p99) if isinstance(p99, int | float) else None,
                              (float(ci[0]), float(ci[1])) if isinstance(ci, list) else None, run.error)
    return [out[r] for r in sorted(out)]


@dataclass(frozen=True)
class RateStep:
    """Where the prefill search of one input length stands: ``queue`` a run at that rate,
    ``wait``, or ``done`` (``error`` when it stopped without an answer). ``last_pass``
    (None: none passed) and ``first_fail`` (None: none failed) bracket the answer."""

    last_pass: float | None
    first_fail: float | None
    queue: float | None = None
    wait: bool = False
    done: bool = False
    error: str | None = None
    bound_reached: bool = False
    verdicts: Mapping[float, str] = field(default_factory=dict)


def next_rate(probes: Sequence[RateProbe], max_ms: float, start_rate: float, max_rate: float,
              precision: float) -> RateStep:
    """The prefill search's next move over ``probes`` (see the module docstring)."""
    verdicts = {p.rate: p.verdict(max_ms) for p in probes}
    fails = [r for r, v in verdicts.items() if v == FAIL]
    first_fail = min(fails, default=None)
    last_pass = max((r for r, v in verdicts.items() if v == PASS
                     and (first_fail is None or r < first_fail)), default=None)
    known = RateStep(last_pass, first_fail, verdicts=verdicts)
    if PENDING in verdicts.values():
        return RateStep(last_pass, first_fail, wait=True, verdicts=verdicts)
    failed = [p for p in probes if verdicts[p.rate] == FAILED]
    if failed:
        return _stop(known, f"the prefill run at {failed[0].rate:g} requests/s ({failed[0].run_id}) "
                            f"ended {failed[0].status} without numbers: {failed[0].error}")
    if not probes:
        return _ask(known, rounded(start_rate))
    if last_pass is None:
        return _stop(known, f"the first rate, {min(verdicts):g} requests/s, already failed the TTFT "
                            "limit: lower prefill.start_rate")
    if first_fail is None:
        if last_pass >= max_rate:
            return RateStep(last_pass, None, done=True, bound_reached=True, verdicts=verdicts)
        return _ask(known, rounded(min(2 * last_pass, max_rate)))
    if first_fail <= last_pass * (1 + precision):
        return RateStep(last_pass, first_fail, done=True, verdicts=verdicts)
    between = rounded(math.sqrt(last_pass * first_fail))
    if not last_pass < between < first_fail:
        return RateStep(last_pass, first_fail, done=True, verdicts=verdicts)
    return _ask(known, between)


def _ask(known: RateStep, rate: float) -> RateStep:
    return RateStep(known.last_pass, known.first_fail, queue=rate, verdicts=known.verdicts)


def _stop(known: RateStep, why: str) -> RateStep:
    return RateStep(known.last_pass, known.first_fail, done=True, error=why, verdicts=known.verdicts)


@dataclass(frozen=True)
class PrefillRate:
    """A prefill server's measured rate at one input length, as a bracket: the last
    passing rate and the first failing one (the bound when none failed)."""

    input_len: int
    requests_per_s: float
    requests_per_s_hi: float

    @property
    def tokens_per_s(self) -> float:
        """Prefill tokens/s at the last passing rate."""
        return self.requests_per_s * self.input_len

    @property
    def tokens_per_s_hi(self) -> float:
        """Prefill tokens/s at the first failing rate (the bracket's top)."""
        return self.requests_per_s_hi * self.input_len


def measured(step: RateStep, input_len: int) -> PrefillRate | None:
    """The measured rate of a finished prefill search, or None (not done, or none passed)."""
    if not step.done or step.error is not None or step.last_pass is None:
        return None
    return PrefillRate(input_len, step.last_pass, step.first_fail or step.last_pass)


def plan_of(prefill: Mapping[str, Any]) -> tuple[float, float, float, float, int]:
    """A stored prefill request's limit, start rate, max rate, precision and prompts."""
    return (float(prefill["ttft_p99_max_ms"]), float(prefill["start_rate"]), float(prefill["max_rate"]),
            float(prefill["precision"]), int(prefill["num_prompts"]))


def step_of(runs: Iterable[Run], input_len: int,
            prefill: Mapping[str, Any]) -> tuple[list[RateProbe], RateStep]:
    """The rate probes of one input length and the search's step over them, with the cap
    on its runs applied."""
    max_ms, start, top, precision, _ = plan_of(prefill)
    probes = rate_probes(runs, input_len)
    step = next_rate(probes, max_ms, start, top, precision)
    if step.queue is not None and len(probes) >= MAX_PREFILL_RUNS:
        step = _stop(step, f"{MAX_PREFILL_RUNS} prefill runs spent before the rate was bracketed")
    return probes, step
