"""A capacity search as the API shows it: per input length the boundary, how sure it is,
its probes and the decode rates there (from ``service.analysis.capacity_runs.assess``).

Two figures per user are shown, each named for what it is: ``tokens_per_s_per_user``, the
decode rate a stream sees while it decodes (1 / the median full-batch TPOT), which a
planner sizes by; and ``output_tokens_per_s_per_user``, output throughput over concurrency
as vLLM's ``plot_pareto`` computes it from the vllm-sweep export, lower by the time to
first token and the gaps between requests."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from service.analysis import prefill_rate
from service.analysis.capacity import BY_POINT, CAPPED, REFUSED, UNDECIDED, Judgement, Probe
from service.analysis.capacity_runs import (
    Context,
    ProbeRuns,
    assess,
    ceiling_bound,
    stored_interval,
    wall_s,
)
from service.analysis.intervals import CONFIDENCE, Interval
from service.analysis.sizing import ServersRatio, servers_ratio
from service.core.capacity import Sla
from service.core.capacity_records import ProbeLook, SearchLooks, SearchPlan
from service.core.ids import utcnow
from service.core.provenance import hardware_line
from service.core.shapes import is_shape, shape_of
from service.core.status import RunStatus
from service.storage import capacity
from service.storage.tables import CapacitySearch, Run
from service.web.schemas import (
    CapacityContext,
    CapacityProbe,
    CapacityPublic,
    Caveat,
    Figure,
    PrefillProbe,
    PrefillPublic,
    ServersRatioPublic,
)


@dataclass(frozen=True)
class Stored:
    """A search with its limit, plan and looks, each read from its JSON once per view."""

    search: CapacitySearch
    sla: Sla
    plan: SearchPlan
    looks: SearchLooks

    @classmethod
    def read(cls, search: CapacitySearch) -> Stored:
        """Read and validated (``CapacitySearch.read_sla`` and the others)."""
        return cls(search, search.read_sla(), search.read_plan(), search.read_looks())


def status_of(search: CapacitySearch, runs: Sequence[Run]) -> str:
    """``queued`` until a probe run has left the queue, then ``running``, then how it ended."""
    if search.status != capacity.ACTIVE:
        return search.status
    return "running" if any(r.status != RunStatus.queued.value for r in runs) else "queued"


def _figure(interval: Interval | None, scale: float = 1.0) -> Figure | None:
    if interval is None:
        return None
    return Figure(value=interval.value * scale, ci=[interval.lo * scale, interval.hi * scale],
                  confidence=interval.confidence)


def _statement(stored: Stored, context: Context, decided: bool) -> str:
    """The answer in a sentence: the boundary, the range that holds it at the plan's
    confidence, and what a point estimate decided."""
    step = context.step
    asked = stored.sla
    sla = f"{asked.metric} <= {asked.max_ms:g} ms"
    confidence = stored.plan.confidence
    low, high = step.surely
    where = f"[{low}, {high}]" if low != high else f"{low}"
    if not decided:
        return (f"not decided yet: {step.last_pass} passed {sla} so far"
                + (f", {step.first_fail} failed" if step.first_fail is not None else ""))
    found = f"largest concurrency with {sla} at input_len {context.input_len}: {step.last_pass}"
    if step.first_fail is None and step.bound.kind == "max_concurrency":
        # Nothing above the asked ceiling was probed: the true boundary is only bounded below.
        found = (f"largest concurrency with {sla} at input_len {context.input_len}: at least "
                 f"{step.last_pass} (the highest asked, {step.bound.reason}, passed; higher was not probed)")
        where = f"at least {low}"
        sure = f"with {confidence:.0%} confidence it is {where}"
    else:
        if step.first_fail is None:
            found += f" (bound reached: {step.bound.reason})"
        sure = (f"with {confidence:.0%} confidence it is {where}" if low == high
                else f"with {confidence:.0%} confidence it lies in {where}")
    if step.by_point_estimate:
        points = ", ".join(map(str, step.by_point_estimate))
        sure += (f"; decided at {points} by the point estimate after "
                 f"{stored.plan.trial_cap} trials (the interval straddled the limit)")
    if step.drifting:
        # Drift said where it was seen: the range already carries it (``probe_units``).
        sure += (f"; the trials at {', '.join(map(str, step.drifting))} disagree beyond their run "
                 "intervals: runs drift, and the range carries that spread")
    return f"{found}; {sure}"


def output_per_user(probe: Mapping[str, Any], runs: Mapping[str, Run]) -> float | None:
    """Output tokens/s per stream as vLLM's ``plot_pareto`` divides it: each succeeded
    trial's output throughput over the probe's concurrency, their mean; None for a capped
    probe (its concurrency is not what the server ran) or one without a measured trial."""
    if probe["capped"]:
        return None
    rates = []
    for run_id in probe["run_ids"]:
        run = runs.get(run_id)
        if run is None or run.status != RunStatus.succeeded.value:
            continue
        throughput = (run.summary or {}).get("output_throughput")
        if isinstance(throughput, int | float):
            rates.append(float(throughput) / probe["concurrency"])
    return sum(rates) / len(rates) if rates else None


def _probe_public(probe: dict[str, Any], runs: Mapping[str, Run]) -> CapacityProbe:
    stored = probe.pop("per_user", None)
    rate = (None if stored is None
            else Interval(float(stored[0]), float(stored[1]), float(stored[2]), CONFIDENCE))
    return CapacityProbe(**probe, tokens_per_s_per_user=_figure(rate),
                         tokens_per_s_per_server=_figure(rate, probe["concurrency"]),
                         output_tokens_per_s_per_user=output_per_user(probe, runs))


def _top(value: float | None, fmt: str = ".4g") -> str:
    return "open" if value is None else format(value, fmt)


def ratio_public(ratio: ServersRatio) -> ServersRatioPublic:
    """P / D with its inputs, as the API shows it."""
    p_lo, p_hi = ratio.prefill_requests_per_s, ratio.prefill_requests_per_s_hi
    if not ratio.measured:
        prefill = f"{ratio.prefill_tokens_per_s:g} tok/s (given)"
    elif p_hi is None:
        prefill = (f"at least {ratio.prefill_tokens_per_s:.4g} tok/s (measured; the highest rate "
                   "asked passed)")
    else:
        prefill = (f"{ratio.prefill_tokens_per_s:.4g} tok/s (measured; the rate where the TTFT limit "
                   f"is crossed lies up to {_top(ratio.prefill_tokens_per_s_hi)})")
    tpot = ratio.tpot_s
    single = tpot.n < 2
    formula = (f"P = {prefill} / {ratio.input_len} = {p_lo:.4g} req/s; D = {ratio.max_concurrency} / "
               f"({ratio.output_len} x mean TPOT {tpot.mean * 1000:.4g} ms) = "
               f"{ratio.decode_requests_per_s:.4g} req/s; P / D = {ratio.ratio:.3g} "
               "decode servers per prefill server")
    c_lo, c_hi = ratio.concurrency_range
    holds_if = ("the range holds where the prefill rate "
                + ("given is right" if not ratio.measured else
                   "lies where the verdicts of intervals and backlogs put it (the prefill side's "
                   "sure_tokens_per_s_range, wider than the bracket of point estimates)")
                + f", the boundary lies in [{c_lo}, {c_hi}] as the search states, and the mean TPOT "
                + ("lies in its 95% interval over the boundary's trials" if not single
                   else "of the boundary's one trial stands (no interval: one trial)")
                + "; no single probability is stated for it")
    d_lo, d_hi = ratio.decode_requests_per_s_range
    r_lo, r_hi = ratio.ratio_range
    tpot_figure = (None if single else
                   Figure(value=tpot.mean * 1000, ci=[tpot.lo * 1000, tpot.hi * 1000], confidence=CONFIDENCE))
    return ServersRatioPublic(
        sentence=ratio.sentence(), formula=formula, holds_if=holds_if,
        prefill_source="measured" if ratio.measured else "given",
        prefill_tokens_per_s=ratio.prefill_tokens_per_s,
        prefill_tokens_per_s_range=[ratio.prefill_tokens_per_s, ratio.prefill_tokens_per_s_hi],
        input_len=ratio.input_len, prefill_requests_per_s=p_lo, prefill_requests_per_s_range=[p_lo, p_hi],
        output_len=ratio.output_len, max_concurrency=ratio.max_concurrency,
        concurrency_range=[c_lo, c_hi], tpot_ms=tpot_figure, tpot_trials=tpot.n,
        decode_requests_per_s=ratio.decode_requests_per_s, decode_requests_per_s_range=[d_lo, d_hi],
        ratio=ratio.ratio, ratio_range=[r_lo, r_hi])


PREFILL_METHOD = ("real-prefill runs of one output token at each rate, each lasting the asked duration "
                  "(rate x duration_s requests, at least min_prompts); a rate fails when its TTFT "
                  "climbs through a run (Theil-Sen slope above zero, a climb over half the limit: a "
                  "queue that grows), else passes when the exact interval of its p99 TTFT (order "
                  "statistics over its runs' requests, at the per-look confidence of the planned "
                  "looks) lies at or under the limit, fails when it lies over, else gets another "
                  f"run, up to {prefill_rate.RATE_TRIAL_CAP}, where the point estimate decides; "
                  "doubling from the start rate to the first failure, then bisecting")


def prefill_public(stored: Stored, runs: Sequence[Run], input_len: int) -> PrefillPublic | None:
    """What the search measured of the prefill side at ``input_len``; None when it measures none."""
    search, asked = stored.search, stored.plan.prefill
    if asked is None:
        return None
    max_ms = asked.ttft_p99_max_ms
    probes, step = prefill_rate.step_of(runs, input_len, asked, stored.looks)
    stopped = search.ended.get(prefill_rate.PREFILL_KEY.format(input_len))
    if step.done and step.error is None and stopped is None:
        state = "decided"
    elif stopped is not None or step.error is not None or search.status != capacity.ACTIVE:
        state = "stopped"
    else:
        state = "measuring"
    rate = prefill_rate.measured(step, input_len) if state == "decided" else None
    limit = f"p99 TTFT <= {max_ms:g} ms"
    pointed = sorted(p.rate for p in probes if p.judgement(max_ms)[1] == prefill_rate.BY_POINT)
    caveat = ("" if not pointed else
              f"; {', '.join(f'{r:g}' for r in pointed)} requests/s decided by the point estimate "
              f"after {prefill_rate.RATE_TRIAL_CAP} runs (the interval straddled the limit)")
    if rate is not None and step.bound_reached:
        statement = (f"a prefill server sustains at least {rate.requests_per_s:.4g} requests/s with "
                     f"{limit} (the highest rate asked, max_rate, passed: its true rate is only "
                     f"bounded below): at least {rate.tokens_per_s:.4g} prefill tokens/s at input_len "
                     f"{input_len}{caveat}")
    elif rate is not None:
        statement = (f"a prefill server sustains {rate.requests_per_s:.4g} requests/s with {limit} "
                     f"({rate.requests_per_s_hi:.4g} failed): {rate.tokens_per_s:.4g} prefill "
                     f"tokens/s at input_len {input_len}, the crossing in [{rate.tokens_per_s:.4g}, "
                     f"{rate.tokens_per_s_hi:.4g}) when every verdict is right{caveat}")
    if rate is not None:
        low, high = rate.surely
        statement += (f"; by the verdicts that carry a confidence (intervals, backlogs) the crossing lies in "
                      f"[{low * input_len:.4g}, {_top(None if high is None else high * input_len)}) "
                      "prefill tokens/s")
    else:
        statement = (f"not decided: {step.last_pass:g} requests/s passed {limit} so far"
                     if step.last_pass is not None else f"not decided: no rate has passed {limit} yet")
    return PrefillPublic(
        ttft_p99_max_ms=max_ms, state=state, max_rate=step.last_pass, first_failing_rate=step.first_fail,
        bound_reached=step.bound_reached,
        tokens_per_s=None if rate is None else rate.tokens_per_s,
        tokens_per_s_range=None if rate is None else [rate.tokens_per_s, rate.tokens_per_s_hi],
        sure_tokens_per_s_range=None if rate is None else [
            rate.surely[0] * input_len, None if rate.surely[1] is None else rate.surely[1] * input_len],
        method=PREFILL_METHOD, statement=statement,
        probes=[_rate_view(p, max_ms) for p in probes],
        runs=sum(len(p.run_ids) for p in probes), error=stopped or step.error)


def _rate_view(probe: prefill_rate.RateProbe, max_ms: float) -> PrefillProbe:
    verdict, by = probe.judgement(max_ms)
    looked = probe.p99_ttft_ms is not None
    return PrefillProbe(request_rate=probe.rate, run_id=probe.run_id, run_ids=list(probe.run_ids),
                        trials=probe.trials, status=probe.status, p99_ttft_ms=probe.p99_ttft_ms,
                        ci_ms=None if probe.ci_ms is None else list(probe.ci_ms),
                        confidence=probe.confidence if looked else None,
                        climb_ms=None if probe.climb_ms is None else list(probe.climb_ms),
                        verdict=verdict, decided_by=by)


def context_public(stored: Stored, context: Context, runs: Sequence[Run] = (),
                   prefill_tokens_per_s: float | None = None) -> CapacityContext:
    """One input length as the API shows it; with a prefill rate (given, or measured by the
    search), decode servers per prefill server at its boundary."""
    step = context.step
    decided = context.decided
    state = "decided" if decided else ("stopped" if context.ended is not None else "probing")
    per_user = context.per_user
    rate = _figure(per_user)
    by_id = {r.id: r for r in runs}
    search = stored.search
    prefill = prefill_public(stored, runs, context.input_len)
    ratio = None
    if context.tpot_trials:
        found = None
        output_len = int(search.base["output_len"])
        c_range = (step.surely[0], step.surely[1]) if decided else None
        if prefill_tokens_per_s is not None:
            found = servers_ratio(prefill_tokens_per_s, context.input_len, output_len, step.last_pass,
                                  context.tpot_trials, c_range)
        elif prefill is not None and prefill.tokens_per_s_range is not None:
            low, high = prefill.tokens_per_s_range
            sure_lo, sure_hi = prefill.sure_tokens_per_s_range or [0.0, None]
            found = servers_ratio(low, context.input_len, output_len, step.last_pass, context.tpot_trials,
                                  c_range, None if prefill.bound_reached else high, measured=True,
                                  prefill_range=(sure_lo or 0.0, sure_hi))
        ratio = None if found is None else ratio_public(found)
    return CapacityContext(
        input_len=context.input_len, state=state, decided=decided,
        max_concurrency=step.last_pass, first_failing=step.first_fail,
        limited_by="sla" if step.first_fail is not None else step.bound.kind,
        limit_reason=(f"the probe at {step.first_fail} failed the SLA" if step.first_fail is not None
                      else step.bound.reason),
        confidence=stored.plan.confidence, boundary_range=list(step.surely),
        at_least=decided and step.first_fail is None and step.bound.kind == "max_concurrency",
        decided_by_point_estimate=list(step.by_point_estimate),
        statement=_statement(stored, context, decided),
        probes=[_probe_public(view, by_id) for view in probe_views(context, stored.looks)],
        tokens_per_s_per_user=rate,
        tokens_per_s_per_server=_figure(per_user, step.last_pass) if step.last_pass else None,
        decode_servers_per_prefill_server=ratio, prefill=prefill,
        runs=context.runs, wall_s=context.wall_s, error=context.ended or step.error)


def probe_views(context: Context, looks: SearchLooks) -> list[dict[str, Any]]:
    """Every probe of an input length as the API lists it (``probe_view``), by concurrency."""
    return [probe_view(p, context.states[p.concurrency], context.step.judged.get(p.concurrency), looks)
            for p in context.probes]


def probe_view(p: ProbeRuns, state: Probe, judgement: Judgement | None,
               looks: SearchLooks) -> dict[str, Any]:
    """One probe as the API lists it: its verdict (or why it has none yet), its figure with
    the interval its latest look took, and what that look rests on."""
    look = looks.probe(p.input_len, p.concurrency)
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
    if figure is None and look is not None:
        # The latest look, while another trial runs.
        figure = stored_interval(look.figure, look.confidence)
    bounded = figure is not None and math.isfinite(figure.lo) and math.isfinite(figure.hi)
    decided_by = judgement.by if judgement is not None and state.pending == 0 else None
    return {
        "concurrency": p.concurrency,
        "trials": len(p.succeeded()),
        "run_ids": [r.id for r in p.runs],
        "group_id": p.runs[0].group_id if p.runs else None,
        "figure_ms": None if figure is None else figure.value,
        "ci_ms": [figure.lo, figure.hi] if figure is not None and bounded else None,
        "confidence": None if figure is None else figure.confidence,
        "verdict": verdict,
        "decided_by": decided_by,
        "capped": state.capped,
        "refused": state.refused,
        "per_user": None if look is None or look.per_user is None else list(look.per_user),
        "method": None if look is None else look.method,
        "units": None if look is None else look.units,
        "attainment": None if look is None or look.attainment is None else list(look.attainment),
        "attainment_target": None if look is None else look.target,
        "units_needed": None if look is None else look.units_needed,
        "notes": [] if look is None else _notes(look, decided_by, verdict),
    }


def _notes(look: ProbeLook, decided_by: str | None, verdict: str) -> list[str]:
    """What a reader of a probe must know beside its figure: drift between its trials, an
    interval nothing bounds yet, a tail verdict too few units could decide."""
    notes = []
    if look.drifts:
        notes.append(f"its trials disagree beyond their run intervals (p = {look.disagreement_p or 0.0:.2g}"
                     "): runs drift; the interval carries a spread between runs of "
                     f"{math.expm1(look.drift_sd or 0.0):.0%} (pooled over the search's probes, and "
                     "this one's)")
    figure = look.figure
    if figure is not None and (figure[1] is None or figure[2] is None) and not look.drift_df:
        notes.append("no interval yet: no probe has two trials to measure the drift between runs")
    needed, units, target = look.units_needed, look.units, look.target
    if needed is not None and units is not None and target is not None and (
            decided_by == BY_POINT or verdict == UNDECIDED):
        notes.append(f"{units} independent units; showing at least {target:.0%} of them meet the "
                     f"limit at {look.confidence:.2%} takes {needed} or more, all meeting "
                     f"it{': the verdict is by point estimate' if decided_by == BY_POINT else ''}")
    return notes


def ran_on(base: Mapping[str, Any], runs: Sequence[Run]) -> str | None:
    """What a search's probes ran on, in a line: the model with its depth (a bundled
    shape's layers of its published total), dtype, weights and hardware, from the first
    probe run that has a provenance (else from the base as asked); None before any ran."""
    model = str(base.get("model", ""))
    engine_asked = base.get("engine") or {}
    provenance = next((r.provenance for r in runs if r.provenance), None)
    if provenance is None:
        return None
    engine_ran = provenance.get("engine") or {}
    layers = engine_asked.get("num_layers")
    depth = ""
    if is_shape(model):
        total = shape_of(model).layers
        depth = f" at {layers} of its {total} layers" if layers else f" at all {total} layers"
    elif layers:
        depth = f" at {layers} layers"
    dtype = engine_ran.get("dtype") or engine_asked.get("dtype")
    parts = [f"{model}{depth}"]
    if dtype:
        parts.append(str(dtype).removeprefix("torch."))
    parts.append(f"{provenance.get('weights') or 'real'} weights")
    hardware = hardware_line(provenance.get("hardware"))
    return ", ".join(parts) + (f", on {hardware}" if hardware else "")


def caveats(runs: Sequence[Run]) -> list[Caveat]:
    """Every warning the search's runs carry, once per code (its first message), with how
    many runs carry it, most common first."""
    found: dict[str, Caveat] = {}
    for run in runs:
        for code in {str(w.get("code")) for w in run.warnings or []}:
            first = next(w for w in run.warnings or [] if str(w.get("code")) == code)
            seen = found.get(code)
            found[code] = (Caveat(code=code, message=str(first.get("message", "")), runs=1) if seen is None
                           else seen.model_copy(update={"runs": seen.runs + 1}))
    return sorted(found.values(), key=lambda c: (-c.runs, c.code))


def capacity_public(engine: Engine, search_id: str,
                    prefill_tokens_per_s: float | None = None) -> CapacityPublic:
    """A search with its status, plan and, per input length, where it stands; decode servers
    per prefill server at the prefill rate given here, else the search's own (given, or
    measured), if any."""
    search, runs = capacity.get_search(engine, search_id)
    error, shown_on, warned, public = search.error, None, [], []
    try:
        stored = Stored.read(search)
        plan = stored.plan
        prefill = prefill_tokens_per_s or plan.prefill_tokens_per_s
        contexts = assess(search.input_lens, stored.sla.max_ms,
                          ceiling_bound(search.max_concurrency, plan.ceiling), runs, stored.looks,
                          search.ended, cancelled=search.status == "cancelled", trial_cap=plan.trial_cap)
        public = [context_public(stored, c, runs, prefill) for c in contexts]
        shown_on, warned = ran_on(search.base, runs), caveats(runs)
    except (LookupError, TypeError, ValueError) as exc:
        # A run or look this version cannot read (a stored spec that no longer validates): the
        # search is shown with why, never a 500; its look ends it failed (``control.capacity``).
        error = error or f"its runs cannot be read: {type(exc).__name__}: {exc}"
    return CapacityPublic(
        id=search.id, status=status_of(search, runs), created_at=search.created_at,
        finished_at=search.finished_at, base=search.base, input_lens=search.input_lens,
        sla=search.sla, max_concurrency=search.max_concurrency, max_runs=search.max_runs,
        plan=search.plan, runs=len(runs), wall_s=wall_s(runs, utcnow()), error=error,
        ran_on=shown_on, caveats=warned, contexts=public)


def sweep_keys(base: Mapping[str, Any]) -> list[str]:
    """A search's probes as a sweep's grid (the vllm-sweep export's folders): input length
    and concurrency, and the server's tensor-parallel size, the GPUs ``plot_pareto`` divides
    a server's throughput by (a ``SERVE--`` part, as a server parameter)."""
    keys = ["input_len", "max_concurrency"]
    if "tensor_parallel_size" in (base.get("engine") or {}):
        keys.append("engine.tensor_parallel_size")
    return keys


# The export's columns: one row per probe, with its input length's answer beside it.
TABLE_COLUMNS = (
    "input_len", "concurrency", "verdict", "decided_by", "trials", "sla_metric", "sla_max_ms",
    "figure_ms", "figure_ms_lo", "figure_ms_hi", "confidence",
    "tokens_per_s_per_user", "tokens_per_s_per_user_lo", "tokens_per_s_per_user_hi",
    "tokens_per_s_per_server", "tokens_per_s_per_server_lo", "tokens_per_s_per_server_hi",
    "output_tokens_per_s_per_user", "capped", "refused", "run_ids",
    "context_max_concurrency", "context_first_failing", "context_decided", "context_confidence",
)


def _ends(figure: Figure | None) -> tuple[float | None, float | None, float | None]:
    if figure is None:
        return None, None, None
    return figure.value, figure.ci[0], figure.ci[1]


def capacity_table(search: CapacityPublic) -> tuple[list[str], list[dict[str, Any]]]:
    """A search as one table, a row per probe (the CSV and JSON exports)."""
    rows = []
    for c in search.contexts:
        for p in c.probes:
            user, user_lo, user_hi = _ends(p.tokens_per_s_per_user)
            server, server_lo, server_hi = _ends(p.tokens_per_s_per_server)
            rows.append(dict(zip(TABLE_COLUMNS, (
                c.input_len, p.concurrency, p.verdict, p.decided_by, p.trials, search.sla["metric"],
                search.sla["max_ms"], p.figure_ms, *(p.ci_ms or (None, None)), p.confidence,
                user, user_lo, user_hi, server, server_lo, server_hi, p.output_tokens_per_s_per_user,
                p.capped, p.refused,
                " ".join(p.run_ids), c.max_concurrency, c.first_failing, c.decided, c.confidence),
                strict=True)))
    return list(TABLE_COLUMNS), rows
