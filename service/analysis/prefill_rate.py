"""The prefill side of a capacity search: the highest request rate a server prefills at
one input length while the p99 TTFT stays under a limit.

A *rate probe* is the real-prefill runs (``service.core.capacity.prefill_spec``) at one
rate: one output token per request, requests sent at the rate (Poisson arrivals, the
base's burstiness), as many as the search asks. Its figure is the p99 TTFT over the
requests of its runs pooled, with a 95% bootstrap interval over requests (one run: the
run summary's own ``p99_ttft_ms_ci``; more: a look taken when the last ended,
``take_look``). It *passes* when the interval lies at or under the limit, *fails* when it
lies over, else gets one more run at that rate (the next seed), up to ``RATE_TRIAL_CAP``
runs; at the cap its point estimate decides, and the answer says so. Above the rate the
server prefills, requests queue and TTFT grows through the run, so a rate away from
the crossing is decided by its first run's interval.

The search per input length (``next_rate``): double from the start rate until a rate
fails or the maximum passes, then bisect (geometric mean) between the last passing and
the first failing rate until they are within the asked precision; a rate between them
that is undecided gets its next run first. The answer is the last passing rate R: P = R
requests/s, R x input_len prefill tokens/s, given as the bracket [R, first failing rate)
(x input_len): the rate where the limit is crossed lies in it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.analysis.intervals import CONFIDENCE, pooled_quantile_ci
from service.analysis.summary_intervals import request_values
from service.core.sample import Sample
from service.core.status import FINISHED, RunStatus
from service.storage.tables import Run

PASS, FAIL, PENDING, FAILED, UNDECIDED = "pass", "fail", "pending", "failed", "undecided"
BY_INTERVAL, BY_POINT = "interval", "point estimate"
# Runs one rate may get; its interval is looked at after each.
RATE_TRIAL_CAP = 3
# Prefill runs one input length may spend; its prefill stops undecided beyond them.
MAX_PREFILL_RUNS = 24
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


def look_key(input_len: int, rate: float) -> str:
    """Where the pooled look at a rate's runs is kept in the search's ``looks``."""
    return f"prefill {input_len}@{rate:g}"


@dataclass(frozen=True)
class RateProbe:
    """What the runs at one rate showed: ``run_id`` and ``status`` its latest run's (or the
    one that ended without numbers), ``trials`` its succeeded runs, the p99 TTFT (ms) over
    them with its interval, and ``pending`` while a run is unfinished or not looked at."""

    rate: float
    run_id: str
    status: str
    p99_ttft_ms: float | None = None
    ci_ms: tuple[float, float] | None = None
    error: str | None = None
    trials: int = 1
    run_ids: tuple[str, ...] = ()
    pending: bool = False

    def judgement(self, max_ms: float, trial_cap: int = RATE_TRIAL_CAP) -> tuple[str, str | None]:
        """The verdict and what made it: ``pass`` / ``fail`` by the interval of the p99
        TTFT, or by its point estimate at ``trial_cap`` runs (or without an interval);
        ``undecided`` below the cap; ``pending`` until the runs ended and were looked at;
        ``failed`` when a run ended without numbers."""
        if self.pending or self.status not in FINISHED:
            return PENDING, None
        if self.p99_ttft_ms is None:
            return FAILED, None
        if self.ci_ms is not None:
            if self.ci_ms[1] <= max_ms:
                return PASS, BY_INTERVAL
            if self.ci_ms[0] > max_ms:
                return FAIL, BY_INTERVAL
            if self.trials < trial_cap:
                return UNDECIDED, None
        return (PASS if self.p99_ttft_ms <= max_ms else FAIL), BY_POINT

    def verdict(self, max_ms: float) -> str:
        """``judgement``'s verdict alone."""
        return self.judgement(max_ms)[0]


def _runs_at(runs: Iterable[Run], input_len: int) -> dict[float, list[Run]]:
    by_rate: dict[float, list[Run]] = {}
    for run in sorted(runs, key=lambda r: r.created_at):
        if is_prefill_run(run) and int(run.spec["input_len"]) == input_len:
            by_rate.setdefault(float(run.spec["request_rate"]), []).append(run)
    return by_rate


def _p99(run: Run) -> float | None:
    p99 = (run.summary or {}).get("p99_ttft_ms") if run.status == RunStatus.succeeded.value else None
    return float(p99) if isinstance(p99, int | float) else None


def rate_probes(runs: Iterable[Run], input_len: int, looks: Mapping[str, Any]) -> list[RateProbe]:
    """The rate probes of one input length, by rate: one run's figure from its summary,
    several runs' from their pooled look in ``looks`` (pending until it is taken)."""
    out: list[RateProbe] = []
    for rate, at in sorted(_runs_at(runs, input_len).items()):
        ids = tuple(r.id for r in at)
        spoilt = next((r for r in at if r.status in FINISHED and _p99(r) is None), None)
        if spoilt is not None:
            out.append(RateProbe(rate, spoilt.id, spoilt.status, error=spoilt.error, trials=len(at),
                                 run_ids=ids))
            continue
        last = at[-1]
        if any(r.status not in FINISHED for r in at):
            out.append(RateProbe(rate, last.id, last.status, trials=len(at), run_ids=ids, pending=True))
            continue
        if len(at) == 1:
            ci = (last.summary or {}).get("p99_ttft_ms_ci")
            out.append(RateProbe(rate, last.id, last.status, _p99(last),
                                 (float(ci[0]), float(ci[1])) if isinstance(ci, list) else None,
                                 run_ids=ids))
            continue
        look = looks.get(look_key(input_len, rate))
        if look is None or look.get("runs") != list(ids) or look.get("figure") is None:
            out.append(RateProbe(rate, last.id, last.status, trials=len(at), run_ids=ids,
                                 pending=look is None or look.get("runs") != list(ids)))
            continue
        value, lo, hi = (float(x) for x in look["figure"])
        out.append(RateProbe(rate, last.id, last.status, value, (lo, hi), trials=len(at), run_ids=ids))
    return out


def looks_due(runs: Iterable[Run], input_len: int, looks: Mapping[str, Any]) -> list[tuple[float, list[str]]]:
    """The rates of one input length whose several runs all succeeded since their last
    look: (rate, the runs' ids) each."""
    due = []
    for rate, at in sorted(_runs_at(runs, input_len).items()):
        ids = [r.id for r in at]
        if len(at) < 2 or any(_p99(r) is None for r in at):
            continue
        look = looks.get(look_key(input_len, rate))
        if look is None or look.get("runs") != ids:
            due.append((rate, ids))
    return due


def take_look(samples: Sequence[Sequence[Sample]], run_ids: Sequence[str]) -> dict[str, Any]:
    """The p99 TTFT (ms) of the runs' requests pooled, with its 95% bootstrap interval over
    requests (as a run summary's ``p99_ttft_ms_ci``), as kept in ``looks``."""
    groups = [g for trial in samples for g in request_values(trial)["ttft"]]
    found = pooled_quantile_ci(groups, 0.99)
    figure = None if found is None else found.scaled(1000.0)
    return {"runs": list(run_ids), "confidence": CONFIDENCE,
            "figure": None if figure is None else [figure.value, figure.lo, figure.hi]}


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
    open_ = sorted(r for r, v in verdicts.items() if v == UNDECIDED
                   and (last_pass is None or r > last_pass) and (first_fail is None or r < first_fail))
    if open_:
        return _ask(known, open_[0])  # its next run
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


def step_of(runs: Iterable[Run], input_len: int, prefill: Mapping[str, Any],
            looks: Mapping[str, Any]) -> tuple[list[RateProbe], RateStep]:
    """The rate probes of one input length and the search's step over them, with the cap
    on its runs applied."""
    max_ms, start, top, precision, _ = plan_of(prefill)
    probes = rate_probes(runs, input_len, looks)
    step = next_rate(probes, max_ms, start, top, precision)
    if step.queue is not None and sum(len(p.run_ids) for p in probes) >= MAX_PREFILL_RUNS:
        step = _stop(step, f"{MAX_PREFILL_RUNS} prefill runs spent before the rate was bracketed")
    return probes, step
