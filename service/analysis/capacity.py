"""Capacity search: the largest concurrency at which a decode figure stays under a limit.

A *probe* at concurrency C is a fill run holding C streams in flight
(``service.core.capacity.probe_spec``). Its *figure* is the SLA statistic (median or p99
of decode ITL or TPOT) over the gaps during which all C requests were decoding (the
steady decode window of ``service.analysis.metrics`` with ``min_decoding=C``), pooled over
the probe's trials, with a bootstrap interval that resamples whole requests.

The search, per input length (``next_step``, a pure function of what the probes showed):

- bracket: probe 1, 2, 4, ... doubling until a probe fails or the bound is reached (the
  asked ``max_concurrency``; what the server's KV cache holds at that length; its
  ``max_num_seqs``; a probe the server capped or refused, less one);
- bisect between the last pass and the first fail to the integer boundary;
- a probe's verdict comes from its interval: *pass* when it lies wholly at or under the
  limit, *fail* when wholly over, else one more trial at C (pooled), up to ``TRIAL_CAP``
  trials; at the cap the point estimate decides, and the answer says so;
- the last pass and the first fail get ``BOUNDARY_TRIALS`` trials each at least, the
  missing ones queued together, so drift between runs cannot decide the boundary alone.

Confidence. The search looks at an interval each time a probe's trials have all ended:
at most ``TRIAL_CAP`` looks per probe, and, while no interval misses, at most
``max_probes(ceiling)`` probes judged on the way (bracket and bisection, whatever the bound
learnt on the way). So ``K = TRIAL_CAP * max_probes(ceiling)`` looks are planned before the
search starts, and each interval is taken at confidence 1 - 5%/K (Bonferroni): the chance
that any interval the search takes misses its probe's true figure is at most 5%. When none
misses, every verdict made by an interval is right, and with none made by a point estimate
the boundary is the true one (for a figure that grows with concurrency): the stated 95%.
A probe decided by its point estimate voids that statement; the answer names it.
``tests/test_capacity_plan.py`` simulates searches to check both.

A probe whose server ran fewer than C requests at once (its ``max_num_seqs`` below C, or
the run's ``queued_in_server`` / ``preempted`` warnings from the server's own metrics) is
neither pass nor fail: it is *capped*, says why, and bounds the search below C. A probe
whose batch cannot fit the KV cache is *refused* by its runner with the arithmetic
(``service.analysis.checks.infeasible``) and bounds the search the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import numpy as np

from service.analysis.intervals import CONFIDENCE, Interval, pooled_quantile_ci
from service.analysis.steady_window import steady_gaps
from service.core.ids import utcnow
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.core.status import FINISHED, RunStatus
from service.storage.tables import Run

# Trials a probe may get; its interval is looked at after each.
TRIAL_CAP = 3
# Trials the last passing and the first failing probe get at least.
BOUNDARY_TRIALS = 2
# Runs of one probe that may fail (not refused, not capped) before its input length stops.
MAX_FAILED_RUNS = 2

PASS, FAIL, UNDECIDED, UNMEASURED = "pass", "fail", "undecided", "unmeasured"
CAPPED, REFUSED = "capped", "refused"
BY_INTERVAL, BY_POINT = "interval", "point estimate"
# Warnings of a run that say the server did not hold the asked batch (``checks.server_warnings``).
CAPPING_WARNINGS = ("queued_in_server", "preempted")

# The statistic of each SLA metric: over what per request (its full-batch gaps, or their
# mean, its TPOT) and which quantile.
STATISTICS: dict[str, tuple[str, float]] = {
    "decode_median_itl_ms": ("itl", 0.5),
    "decode_p99_itl_ms": ("itl", 0.99),
    "decode_median_tpot_ms": ("tpot", 0.5),
    "decode_p99_tpot_ms": ("tpot", 0.99),
}


# --- the plan --------------------------------------------------------------------------


def max_probes(ceiling: int) -> int:
    """The most probes a search up to ``ceiling`` judges when every verdict is right:
    doubling to the largest power of two under it (and the ceiling itself), then bisecting
    the widest gap the bracket can leave. A bound learnt on the way (KV cache, a capped
    probe) never makes the path longer (``tests/test_capacity_plan.py`` checks it)."""
    if ceiling < 1:
        raise ValueError(f"ceiling must be at least 1, got {ceiling}")
    m = ceiling.bit_length() - 1
    doubling = max(1, 2 * m)  # a fail at 2^k: k + 1 probes, then k - 1 bisecting 2^(k-1)
    if ceiling == 1 << m:
        return doubling
    gap = ceiling - (1 << m)  # a fail at the ceiling after 2^m passed
    return max(doubling, m + 2 + math.ceil(math.log2(gap)))


@dataclass(frozen=True)
class Plan:
    """What a search plans before it starts: the highest concurrency, how many looks at an
    interval it may take (``looks``) and the confidence of each."""

    ceiling: int
    trial_cap: int = TRIAL_CAP
    looks: int = 0
    per_look: float = CONFIDENCE
    confidence: float = CONFIDENCE

    def as_dict(self) -> dict[str, Any]:
        """As stored with the search and shown by the API."""
        return {"ceiling": self.ceiling, "trial_cap": self.trial_cap,
                "boundary_trials": BOUNDARY_TRIALS, "looks": self.looks,
                "per_look_confidence": self.per_look, "confidence": self.confidence,
                "method": "Bonferroni over the planned looks"}


def plan_for(ceiling: int, trial_cap: int = TRIAL_CAP) -> Plan:
    """The plan of a search up to ``ceiling``: K = trial_cap x max_probes(ceiling) looks,
    each at 1 - 5%/K."""
    looks = trial_cap * max_probes(ceiling)
    return Plan(ceiling, trial_cap, looks, 1 - (1 - CONFIDENCE) / looks, CONFIDENCE)


# --- figures of a probe ----------------------------------------------------------------


def full_batch_values(trials: Iterable[Sequence[Sample]], concurrency: int, kind: str) -> list[np.ndarray]:
    """Per request of every trial, in seconds: its gaps while all ``concurrency`` requests
    of its run were decoding and none waited for its first token (``kind`` "itl"), or their
    mean (its TPOT over that window, ``kind`` "tpot"); requests without such gaps left out."""
    groups: list[np.ndarray] = []
    for samples in trials:
        for gaps in steady_gaps(samples, min_decoding=concurrency):
            if gaps.size:
                groups.append(gaps if kind == "itl" else np.array([gaps.mean()]))
    return groups


def sla_figure(trials: Iterable[Sequence[Sample]], metric: str, concurrency: int,
               confidence: float) -> Interval | None:
    """The SLA ``metric`` (ms) over the full-batch window of the trials, pooled, with its
    bootstrap interval over requests at ``confidence``; None with under two requests
    that have such gaps."""
    kind, q = STATISTICS[metric]
    found = pooled_quantile_ci(full_batch_values(trials, concurrency, kind), q, confidence)
    return None if found is None else found.scaled(1000.0)


def per_user_rate(trials: Iterable[Sequence[Sample]], concurrency: int) -> Interval | None:
    """Decode output tokens/s of one stream at ``concurrency``: 1 / the median full-batch
    TPOT, with the 95% bootstrap interval over requests turned over; None without one."""
    tpot = pooled_quantile_ci(full_batch_values(trials, concurrency, "tpot"), 0.5)
    if tpot is None or tpot.lo <= 0:
        return None
    return Interval(1.0 / tpot.value, 1.0 / tpot.hi, 1.0 / tpot.lo, tpot.confidence)


# --- what a probe run says about the server --------------------------------------------


def capped_reason(concurrency: int, warnings: Sequence[Mapping[str, Any]] | None,
                  provenance: Mapping[str, Any] | None) -> str | None:
    """Why the server did not run ``concurrency`` requests at once in this run (its
    ``max_num_seqs``, or what its metrics showed), or None."""
    engine = (provenance or {}).get("engine") or {}
    seqs = engine.get("max_num_seqs")
    if isinstance(seqs, int) and seqs < concurrency:
        return (f"the server's max_num_seqs is {seqs}: it runs at most {seqs} requests at once, "
                f"fewer than {concurrency}")
    for warning in warnings or []:
        if warning.get("code") in CAPPING_WARNINGS:
            return f"{warning['code']}: {warning.get('message')}"
    return None


def refused_reason(run: Run) -> str | None:
    """The KV arithmetic a run was refused with (``checks.infeasible``), or None."""
    if run.status == RunStatus.failed.value and run.error and run.error.startswith("infeasible"):
        return run.error
    return None


@dataclass(frozen=True)
class Bound:
    """The highest concurrency that may be probed, what sets it and why."""

    value: int
    kind: str
    reason: str


def server_bounds(runs: Iterable[Run], tokens_per_request: int) -> list[Bound]:
    """What the runs' servers hold: the requests of ``tokens_per_request`` tokens their KV
    cache fits (fewest over the runs), and their ``max_num_seqs``."""
    out: list[Bound] = []
    kv = [t for r in runs if isinstance(t := (r.provenance or {}).get("kv_cache_tokens"), int)]
    if kv:
        tokens = min(kv)
        fits = tokens // tokens_per_request
        out.append(Bound(fits, "kv_cache", (
            f"the server's KV cache holds {tokens:,} tokens: {fits} requests of "
            f"{tokens_per_request:,} tokens (input + output) at once")))
    seqs = [s for r in runs
            if isinstance(s := ((r.provenance or {}).get("engine") or {}).get("max_num_seqs"), int)]
    if seqs:
        out.append(Bound(min(seqs), "max_num_seqs",
                         f"the server's max_num_seqs is {min(seqs)}: it runs no more at once"))
    return out


# --- the search ------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """What the runs at one concurrency showed so far."""

    concurrency: int
    # Succeeded trials in its latest look, and that look's figure (ms) at the plan's confidence.
    trials: int = 0
    figure: Interval | None = None
    # Trials queued or running, or ended and not looked at yet.
    pending: int = 0
    capped: str | None = None
    refused: str | None = None
    failed: int = 0
    last_error: str | None = None
    # A run of it cancelled on its own (not by the search's cancel): the run's id.
    cancelled: str | None = None


@dataclass(frozen=True)
class Judgement:
    """A probe's verdict (``pass``, ``fail``, ``undecided``, ``unmeasured``) and what made it."""

    verdict: str
    by: str | None = None


def judge(probe: Probe, max_ms: float, trial_cap: int = TRIAL_CAP) -> Judgement:
    """The verdict of a probe with trials: from its interval, or at ``trial_cap`` trials
    from its point estimate."""
    figure = probe.figure
    if figure is None:
        return Judgement(UNMEASURED)
    if figure.hi <= max_ms:
        return Judgement(PASS, BY_INTERVAL)
    if figure.lo > max_ms:
        return Judgement(FAIL, BY_INTERVAL)
    if probe.trials >= trial_cap:
        return Judgement(PASS if figure.value <= max_ms else FAIL, BY_POINT)
    return Judgement(UNDECIDED)


@dataclass(frozen=True)
class Step:
    """Where a search over one input length stands and what it does next: ``queue`` one
    trial at each concurrency named (in order), ``wait`` for runs, or it is ``done`` (or
    stopped with an ``error``). ``last_pass`` (0: none) and ``first_fail`` are the
    boundary as known so far; ``bound`` the highest concurrency that may be probed."""

    last_pass: int
    first_fail: int | None
    bound: Bound
    queue: tuple[int, ...] = ()
    wait: bool = False
    done: bool = False
    error: str | None = None
    # Probes whose verdict came from their point estimate at the trial cap.
    by_point_estimate: tuple[int, ...] = ()
    # Where the boundary lies by the verdicts of intervals alone: above every probe whose
    # interval passed, below every one whose interval failed (and within the bound). With
    # every interval holding its true figure, the true boundary is in it.
    surely: tuple[int, int] = (0, 0)
    judged: Mapping[int, Judgement] = field(default_factory=dict)


def next_step(probes: Mapping[int, Probe], max_ms: float, bounds: Sequence[Bound],
              trial_cap: int = TRIAL_CAP) -> Step:
    """The search's next move given the ``probes`` so far (see the module docstring).
    ``bounds``: the asked ceiling first, then what the servers showed (``server_bounds``)."""
    limits = list(bounds)
    for c, p in sorted(probes.items()):
        if p.capped is not None:
            limits.append(Bound(c - 1, CAPPED, f"the probe at {c} was capped: {p.capped}"))
        elif p.refused is not None:
            limits.append(Bound(c - 1, REFUSED, f"the probe at {c} was refused: {p.refused}"))
    bound = min(limits, key=lambda b: b.value)
    judged = {c: judge(p, max_ms, trial_cap) for c, p in probes.items()
              if c <= bound.value and p.trials > 0 and p.capped is None and p.refused is None}
    fails = [c for c, j in judged.items() if j.verdict == FAIL]
    first_fail = min(fails, default=None)
    last_pass = max((c for c, j in judged.items()
                     if j.verdict == PASS and (first_fail is None or c < first_fail)), default=0)
    sure_fails = [c for c, j in judged.items() if j.verdict == FAIL and j.by == BY_INTERVAL]
    below = min(sure_fails) - 1 if sure_fails else bound.value
    above = max((c for c, j in judged.items()
                 if j.verdict == PASS and j.by == BY_INTERVAL and c <= below), default=0)
    known = Step(last_pass, first_fail, bound, judged=judged, surely=(above, below))
    if any(p.pending for p in probes.values()):
        return replace(known, wait=True)
    for c, p in sorted(probes.items()):
        if p.cancelled is not None:
            return replace(known, error=f"run {p.cancelled} (the probe at {c}) was cancelled")
        if p.failed >= MAX_FAILED_RUNS and c <= bound.value and p.capped is None and p.refused is None:
            return replace(known, error=(f"{p.failed} runs of the probe at {c} failed; the last: "
                                        f"{p.last_error}"))
    unmeasured = [c for c, j in judged.items() if j.verdict == UNMEASURED]
    if unmeasured:
        c = min(unmeasured)
        return replace(known, error=(
            f"the probe at {c} has no decode gaps while all {c} requests were decoding: too few "
            "output tokens for a steady window, or the server never held the batch"))
    ceiling = first_fail - 1 if first_fail is not None else bound.value
    open_ = sorted(c for c, j in judged.items() if j.verdict == UNDECIDED and last_pass < c <= ceiling)
    if open_:
        return replace(known, queue=(open_[0],))
    if last_pass < ceiling:
        if first_fail is None:
            upward = 1 if last_pass == 0 else min(2 * last_pass, bound.value)
            return replace(known, queue=(upward,))
        return replace(known, queue=((last_pass + first_fail) // 2,))
    short = tuple(c for c in (last_pass, first_fail)
                  if c is not None and c in judged and probes[c].trials < BOUNDARY_TRIALS)
    if short:
        return replace(known, queue=short)
    points = tuple(sorted(c for c, j in judged.items() if j.by == BY_POINT))
    return replace(known, done=True, by_point_estimate=points)


# --- a search as stored: its runs and looks, per input length --------------------------


def look_key(input_len: int, concurrency: int) -> str:
    """Where a probe's latest look is kept in the search's ``looks``."""
    return f"{input_len}:{concurrency}"


@dataclass
class ProbeRuns:
    """The runs of one probe, by trial."""

    input_len: int
    concurrency: int
    runs: list[Run] = field(default_factory=list)

    def succeeded(self) -> list[Run]:
        """Its trials that succeeded, by trial."""
        return [r for r in self.runs if r.status == RunStatus.succeeded.value]

    def unfinished(self) -> list[Run]:
        """Its trials queued, starting or running."""
        return [r for r in self.runs if r.status not in FINISHED]

    def capped(self) -> str | None:
        """Why a succeeded trial's server did not hold the batch, or None."""
        for run in self.succeeded():
            reason = capped_reason(self.concurrency, run.warnings, run.provenance)
            if reason is not None:
                return reason
        return None

    def refused(self) -> str | None:
        """The KV arithmetic a trial was refused with, or None."""
        return next((reason for r in self.runs if (reason := refused_reason(r)) is not None), None)

    def needs_look(self, looks: Mapping[str, Any]) -> bool:
        """Whether every trial has ended and the succeeded ones are not the latest look's."""
        if self.unfinished() or self.capped() is not None or self.refused() is not None:
            return False
        ids = [r.id for r in self.succeeded()]
        look = looks.get(look_key(self.input_len, self.concurrency))
        return bool(ids) and (look is None or look.get("runs") != ids)


def probe_runs(runs: Iterable[Run]) -> dict[int, dict[int, ProbeRuns]]:
    """A search's decode probe runs by input length and concurrency, each probe's by trial
    (its prefill runs, ``service.analysis.prefill_rate``, left out)."""
    out: dict[int, dict[int, ProbeRuns]] = {}
    for run in runs:
        if run.spec.get("mode") == "prefill":
            continue
        length, c = int(run.spec["input_len"]), int(run.spec["max_concurrency"])
        out.setdefault(length, {}).setdefault(c, ProbeRuns(length, c)).runs.append(run)
    for probes in out.values():
        for p in probes.values():
            p.runs.sort(key=lambda r: (r.trial or 0, r.created_at))
    return out


def take_look(trials: Sequence[Sequence[Sample]], run_ids: Sequence[str], metric: str,
              concurrency: int, per_look: float) -> dict[str, Any]:
    """A probe's look over its succeeded trials, as the search stores it: the runs, the
    SLA figure (ms) with its interval at ``per_look`` and the per-stream decode rate
    (tokens/s) with its 95% interval. CPU work: called in a thread."""
    figure = sla_figure(trials, metric, concurrency, per_look)
    rate = per_user_rate(trials, concurrency)
    return {"runs": list(run_ids),
            "figure": None if figure is None else [figure.value, figure.lo, figure.hi],
            "confidence": per_look,
            "per_user": None if rate is None else [rate.value, rate.lo, rate.hi]}


def _interval(stored: Sequence[float] | None, confidence: float) -> Interval | None:
    if stored is None:
        return None
    return Interval(float(stored[0]), float(stored[1]), float(stored[2]), confidence)


def probe_state(p: ProbeRuns, looks: Mapping[str, Any], cancelled_by_search: bool) -> Probe:
    """What the planner knows of a probe from its runs and its latest look."""
    look = looks.get(look_key(p.input_len, p.concurrency))
    ids = [r.id for r in p.succeeded()]
    looked = look is not None and look.get("runs") == ids
    failed = [r for r in p.runs if r.status == RunStatus.failed.value and refused_reason(r) is None]
    cancelled = next((r.id for r in p.runs if r.status == RunStatus.cancelled.value), None)
    capped = p.capped()
    pending = len(p.unfinished())
    if ids and not looked and capped is None:
        pending += 1
    return Probe(
        concurrency=p.concurrency,
        trials=len(ids) if looked else 0,
        figure=_interval(look.get("figure"), float(look["confidence"])) if looked and look else None,
        pending=pending, capped=capped, refused=p.refused(), failed=len(failed),
        last_error=failed[-1].error if failed else None,
        cancelled=None if cancelled_by_search else cancelled)


def tokens_per_request(runs: Sequence[Run]) -> int:
    """KV tokens the longest request of these probes needs (input plus output)."""
    return RunSpec.stored(runs[0].spec).longest_request_tokens()


@dataclass
class Context:
    """One input length of a search as the API shows it."""

    input_len: int
    step: Step
    probes: list[dict[str, Any]]
    runs: int
    wall_s: float | None
    # Why it stopped undecided (the budget spent, a probe that could not be run), once it did.
    ended: str | None = None
    per_user: Interval | None = None

    @property
    def decided(self) -> bool:
        """Whether the boundary was found."""
        return self.ended is None and self.step.done


def _probe_view(p: ProbeRuns, state: Probe, judgement: Judgement | None,
                looks: Mapping[str, Any]) -> dict[str, Any]:
    look = looks.get(look_key(p.input_len, p.concurrency))
    if state.capped is not None:
        verdict: str = CAPPED
    elif state.refused is not None:
        verdict = REFUSED
    elif state.pending:
        verdict = "running" if any(r.status != RunStatus.queued.value for r in p.runs) else "queued"
    elif judgement is not None:
        verdict = judgement.verdict
    else:
        verdict = "failed" if state.failed else "not judged"
    figure = state.figure
    if figure is None and look is not None and look.get("figure") is not None:
        figure = _interval(look["figure"], float(look["confidence"]))  # the latest look, while another runs
    return {
        "concurrency": p.concurrency,
        "trials": len(p.succeeded()),
        "run_ids": [r.id for r in p.runs],
        "group_id": p.runs[0].group_id if p.runs else None,
        "figure_ms": None if figure is None else figure.value,
        "ci_ms": None if figure is None else [figure.lo, figure.hi],
        "confidence": None if figure is None else figure.confidence,
        "verdict": verdict,
        "decided_by": judgement.by if judgement is not None and state.pending == 0 else None,
        "capped": state.capped,
        "refused": state.refused,
        "per_user": None if look is None else look.get("per_user"),
    }


def wall_s(runs: Sequence[Run], now: datetime) -> float | None:
    """Seconds from the first run's start to the last one's end (``now`` for a run not ended)."""
    starts = [r.started_at for r in runs if r.started_at is not None]
    if not starts:
        return None
    ends = [r.finished_at or now for r in runs if r.started_at is not None]
    return (_aware(max(ends)) - _aware(min(starts))).total_seconds()


def _aware(t: datetime) -> datetime:
    # SQLite gives naive datetimes back; every one the service stores is UTC.
    return t if t.tzinfo is not None else t.replace(tzinfo=utcnow().tzinfo)


def assess(input_lens: Sequence[int], max_ms: float, ceiling: Bound, runs: Sequence[Run],
           looks: Mapping[str, Any], ended: Mapping[str, str], cancelled: bool = False,
           trial_cap: int = TRIAL_CAP) -> list[Context]:
    """Every input length of a search: its probes, the planner's step over them, the runs
    it spent and its wall time. ``ended``: why input lengths stopped undecided, by length;
    ``cancelled``: the search was cancelled (its cancelled runs are no probe's fault)."""
    by_length = probe_runs(runs)
    now = utcnow()
    out = []
    for length in input_lens:
        probes = by_length.get(length, {})
        mine = [r for p in probes.values() for r in p.runs]
        states = {c: probe_state(p, looks, cancelled) for c, p in probes.items()}
        bounds = [ceiling, *(server_bounds(mine, tokens_per_request(mine)) if mine else [])]
        step = next_step(states, max_ms, bounds, trial_cap)
        views = [_probe_view(p, states[c], step.judged.get(c), looks) for c, p in sorted(probes.items())]
        context = Context(length, step, views, len(mine), wall_s(mine, now), ended.get(str(length)))
        if step.last_pass and step.last_pass in probes:
            look = looks.get(look_key(length, step.last_pass)) or {}
            context.per_user = _interval(look.get("per_user"), CONFIDENCE)
        out.append(context)
    return out


@dataclass(frozen=True)
class ServersRatio:
    """Decode servers per prefill server at one input length, with its inputs:

    - a prefill server admits P = prefill tokens/s / input_len requests/s;
    - a decode server finishes D = C_max / (output_len x TPOT at C_max) requests/s;
    - so P / D decode servers keep up with one prefill server.

    The prefill rate is given (exact: ``prefill_tokens_per_s_hi`` equals it) or measured
    (a bracket: from the last passing rate to the first failing one); the ratio's interval
    runs from the bracket's bottom over D's top to its top over D's bottom.
    """

    prefill_tokens_per_s: float
    prefill_tokens_per_s_hi: float
    measured: bool
    input_len: int
    output_len: int
    max_concurrency: int
    # The median full-batch TPOT at C_max (s), and D and P / D, with 95% intervals.
    tpot_s: Interval
    decode_requests_per_s: Interval
    ratio: Interval

    @property
    def prefill_requests_per_s(self) -> float:
        """P (at the bottom of a measured bracket)."""
        return self.prefill_tokens_per_s / self.input_len

    @property
    def prefill_requests_per_s_hi(self) -> float:
        """P at the top of a measured bracket (P itself when given)."""
        return self.prefill_tokens_per_s_hi / self.input_len


def servers_ratio(prefill_tokens_per_s: float, input_len: int, output_len: int, max_concurrency: int,
                  per_user: Interval, prefill_tokens_per_s_hi: float | None = None) -> ServersRatio | None:
    """P / D from the prefill rate (given, or measured up to ``prefill_tokens_per_s_hi``) and
    the boundary's per-stream decode rate (1 / its median TPOT); None without a boundary (no
    probe passed) or a positive rate."""
    if max_concurrency < 1 or per_user.lo <= 0:
        return None
    p = prefill_tokens_per_s / input_len
    p_hi = (prefill_tokens_per_s_hi or prefill_tokens_per_s) / input_len
    # D = C / (output_len x TPOT) = C x (1 / TPOT) / output_len: it moves with the rate, so
    # the rate's interval carries over, end to end (and turns over for 1 / D).
    d = per_user.scaled(max_concurrency / output_len)
    tpot = Interval(1.0 / per_user.value, 1.0 / per_user.hi, 1.0 / per_user.lo, per_user.confidence)
    ratio = Interval(p / d.value, p / d.hi, p_hi / d.lo, per_user.confidence)
    return ServersRatio(prefill_tokens_per_s, p_hi * input_len, prefill_tokens_per_s_hi is not None,
                        input_len, output_len, max_concurrency, tpot, d, ratio)


def ceiling_bound(max_concurrency: int | None, ceiling: int) -> Bound:
    """The asked bound of a search (or the default one it planned for)."""
    if max_concurrency is not None:
        return Bound(ceiling, "max_concurrency", f"max_concurrency {ceiling} (asked)")
    return Bound(ceiling, "max_concurrency",
                 f"the default ceiling of {ceiling} (no max_concurrency asked)")
