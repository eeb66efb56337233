"""A capacity search as stored, read into the planner's terms (``service.analysis.capacity``):
its probe runs by input length and concurrency (``probe_runs``), the looks taken over their
trials (``take_look``, ``take_looks``) and read back (``look_state``, ``probe_state``), what
the runs' servers hold (``server_bounds``), and every input length assessed (``assess``):
the planner's step over its probes, the runs it spent and its wall time."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from service.analysis.capacity import (
    TRIAL_CAP,
    Bound,
    Probe,
    Step,
    capped_reason,
    next_step,
    per_user_rate,
    sla_figure,
)
from service.analysis.intervals import CONFIDENCE, Interval
from service.analysis.probe_units import Drift, drift_from_looks
from service.analysis.roofline import step_growth
from service.core.capacity_records import ProbeLook, SearchLooks
from service.core.ids import utcnow
from service.core.mode import Mode
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.core.status import FINISHED, RunStatus
from service.storage.tables import Run


def refused_reason(run: Run) -> str | None:
    """The KV arithmetic a run was refused with (``checks.infeasible``), or None."""
    if run.status == RunStatus.failed.value and run.error and run.error.startswith("infeasible"):
        return run.error
    return None


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

    def needs_look(self, looks: SearchLooks) -> bool:
        """Whether every trial has ended and the succeeded ones are not the latest look's."""
        if self.unfinished() or self.capped() is not None or self.refused() is not None:
            return False
        ids = tuple(r.id for r in self.succeeded())
        look = looks.probe(self.input_len, self.concurrency)
        return bool(ids) and (look is None or look.runs != ids)


def probe_runs(runs: Iterable[Run]) -> dict[int, dict[int, ProbeRuns]]:
    """A search's decode probe runs by input length and concurrency, each probe's by trial
    (its prefill runs, ``service.analysis.prefill_rate``, left out)."""
    out: dict[int, dict[int, ProbeRuns]] = {}
    for run in runs:
        if Mode.of(run.spec).prefills_measured:
            continue
        length, c = int(run.spec["input_len"]), int(run.spec["max_concurrency"])
        out.setdefault(length, {}).setdefault(c, ProbeRuns(length, c)).runs.append(run)
    for probes in out.values():
        for p in probes.values():
            p.runs.sort(key=lambda r: (r.trial or 0, r.created_at))
    return out


def _finite(x: float) -> float | None:
    # JSON has no infinity: an end nothing bounds yet is stored as null.
    return x if math.isfinite(x) else None


def _stored(interval: Interval | None) -> tuple[float, float | None, float | None] | None:
    return None if interval is None else (interval.value, _finite(interval.lo), _finite(interval.hi))


def take_look(trials: Sequence[Sequence[Sample]], run_ids: Sequence[str], metric: str,
              concurrency: int, per_look: float, max_ms: float | None = None,
              drift: Drift | None = None) -> ProbeLook:
    """A probe's look over its succeeded trials: the runs, the
    SLA figure (ms) with its interval at ``per_look`` (run-to-run ``drift`` pooled from the
    search's other looks carried in, ``probe_units.drift_from_looks``), a tail limit's
    attainment of ``max_ms``, what they rest on (units, trial levels, the drift, the
    method) and the per-stream decode rate (tokens/s) with its 95% interval. CPU work:
    called in a thread."""
    found = sla_figure(trials, metric, concurrency, per_look, max_ms, drift)
    look = ProbeLook(runs=tuple(run_ids), confidence=per_look,
                     per_user=_stored(per_user_rate(trials, concurrency, drift)))
    if found is None:
        return look
    return look.model_copy(update=dict(
        figure=_stored(found.figure), method=found.method, units=found.units, levels=tuple(found.levels),
        within=tuple(found.within), drift_sd=_finite(found.sd), drift_df=found.drift.df,
        disagreement_p=found.disagreement_p, drifts=found.drifts, attainment=_stored(found.attainment),
        target=found.target, units_needed=found.needed))


@dataclass(frozen=True)
class LookDue:
    """A probe whose trials all ended since its last look: its key, concurrency and trials."""

    key: str
    concurrency: int
    trials: Sequence[Sequence[Sample]]
    run_ids: Sequence[str]


def take_looks(due: Sequence[LookDue], looks: SearchLooks, metric: str, per_look: float,
               max_ms: float) -> SearchLooks:
    """The search's looks with every probe in ``due`` looked at (``take_look``), each with
    the drift between runs pooled from every other look (``drift_from_looks``). Probes
    whose trials ended together are looked at twice: first for their trials' levels, then
    each with the others' new levels pooled in, so that no look depends on the order they
    are taken in (an aimed pair's second trials end together). CPU work: called in a thread."""
    taken = looks.copy()
    for _ in range(2 if len(due) > 1 else 1):
        for probe in due:
            taken.probes[probe.key] = take_look(probe.trials, probe.run_ids, metric, probe.concurrency,
                                         per_look, max_ms, drift_from_looks(taken, leave_out=probe.key))
    return taken


def stored_interval(stored: Sequence[float | None] | None, confidence: float) -> Interval | None:
    """An interval as a look keeps it ((value, lo, hi), an end nothing bounds as None)."""
    if stored is None:
        return None
    value, lo, hi = stored
    return Interval(float(value or 0.0), -math.inf if lo is None else float(lo),
                    math.inf if hi is None else float(hi), confidence)


def look_state(concurrency: int, look: ProbeLook) -> Probe:
    """What a probe's look says: its trials, figure, attainment and drift."""
    return Probe(concurrency=concurrency, trials=len(look.runs),
                 figure=stored_interval(look.figure, look.confidence),
                 attainment=stored_interval(look.attainment, look.confidence),
                 target=look.target, drifts=look.drifts, typical=look.typical_ms)


def probe_state(p: ProbeRuns, looks: SearchLooks, cancelled_by_search: bool) -> Probe:
    """What the planner knows of a probe from its runs and its latest look."""
    look = looks.probe(p.input_len, p.concurrency)
    ids = tuple(r.id for r in p.succeeded())
    looked = look is not None and look.runs == ids
    failed = [r for r in p.runs if r.status == RunStatus.failed.value and refused_reason(r) is None]
    cancelled = next((r.id for r in p.runs if r.status == RunStatus.cancelled.value), None)
    capped = p.capped()
    pending = len(p.unfinished())
    if ids and not looked and capped is None:
        pending += 1
    seen = look_state(p.concurrency, look) if looked and look else Probe(p.concurrency)
    return replace(
        seen, pending=pending, capped=capped, refused=p.refused(), failed=len(failed),
        last_error=failed[-1].error if failed else None,
        cancelled=None if cancelled_by_search else cancelled)


def growth_of(runs: Sequence[Run], input_len: int) -> Callable[[float], float] | None:
    """The roofline prior of these probes' servers (``roofline.step_growth``) at their mean
    decode context (the input and half the output), from the first run whose connector
    reported the facts; None without any."""
    facts = next((f for r in runs if isinstance(f := (r.provenance or {}).get("roofline"), dict)), None)
    if facts is None:
        return None
    context = input_len + (tokens_per_request(runs) - input_len) / 2
    return step_growth(facts, context)


def tokens_per_request(runs: Sequence[Run]) -> int:
    """KV tokens the longest request of these probes needs (input plus output)."""
    return RunSpec.stored(runs[0].spec).longest_request_tokens()


@dataclass
class Context:
    """One input length of a search as the API shows it."""

    input_len: int
    step: Step
    # Its probes' runs and what the planner knows of each, by concurrency.
    probes: list[ProbeRuns]
    states: dict[int, Probe]
    runs: int
    wall_s: float | None
    # Why it stopped undecided (the budget spent, a probe that could not be run), once it did.
    ended: str | None = None
    per_user: Interval | None = None
    # The mean TPOT (s) of each succeeded trial at the boundary (``boundary_tpots``).
    tpot_trials: list[float] = field(default_factory=list)

    @property
    def decided(self) -> bool:
        """Whether the boundary was found."""
        return self.ended is None and self.step.done


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
           looks: SearchLooks, ended: Mapping[str, str], cancelled: bool = False,
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
        step = next_step(states, max_ms, bounds, trial_cap, growth=growth_of(mine, length) if mine else None)
        context = Context(length, step, [p for _, p in sorted(probes.items())], states, len(mine),
                          wall_s(mine, now), ended.get(str(length)))
        if step.last_pass and step.last_pass in probes:
            look = looks.probe(length, step.last_pass)
            context.per_user = stored_interval(None if look is None else look.per_user, CONFIDENCE)
            context.tpot_trials = boundary_tpots(probes[step.last_pass].runs, step.last_pass)
        out.append(context)
    return out


def boundary_tpots(runs: Sequence[Run], concurrency: int) -> list[float]:
    """The mean TPOT (s) of each succeeded trial of the probe at ``concurrency``, from its
    summary (vLLM's ``mean_tpot_ms``: per request (latency - TTFT) / (tokens - 1))."""
    out = []
    for run in runs:
        if run.status != RunStatus.succeeded.value or run.spec.get("max_concurrency") != concurrency:
            continue
        mean = (run.summary or {}).get("mean_tpot_ms")
        if isinstance(mean, int | float) and mean > 0:
            out.append(float(mean) / 1000)
    return out


def ceiling_bound(max_concurrency: int | None, ceiling: int) -> Bound:
    """The asked bound of a search (or the default one it planned for)."""
    if max_concurrency is not None:
        return Bound(ceiling, "max_concurrency", f"max_concurrency {ceiling} (asked)")
    return Bound(ceiling, "max_concurrency",
                 f"the default ceiling of {ceiling} (no max_concurrency asked)")
