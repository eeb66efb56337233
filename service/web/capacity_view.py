"""A capacity search as the API shows it: per input length the boundary, how sure it is,
its probes and the decode rates there (from ``service.analysis.capacity.assess``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Engine

from service.analysis import prefill_rate
from service.analysis.capacity import Context, ServersRatio, assess, ceiling_bound, servers_ratio, wall_s
from service.analysis.intervals import CONFIDENCE, Interval
from service.core.ids import utcnow
from service.core.status import RunStatus
from service.storage import capacity
from service.storage.tables import CapacitySearch, Run
from service.web.schemas import (
    CapacityContext,
    CapacityProbe,
    CapacityPublic,
    Figure,
    PrefillProbe,
    PrefillPublic,
    ServersRatioPublic,
)


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


def _statement(search: CapacitySearch, context: Context, decided: bool) -> str:
    """The answer in a sentence: the boundary, the range that holds it at the plan's
    confidence, and what a point estimate decided."""
    step = context.step
    sla = f"{search.sla['metric']} <= {search.sla['max_ms']:g} ms"
    confidence = float(search.plan["confidence"])
    low, high = step.surely
    where = f"[{low}, {high}]" if low != high else f"{low}"
    if not decided:
        return (f"not decided yet: {step.last_pass} passed {sla} so far"
                + (f", {step.first_fail} failed" if step.first_fail is not None else ""))
    found = f"largest concurrency with {sla} at input_len {context.input_len}: {step.last_pass}"
    if step.first_fail is None:
        found += f" (bound reached: {step.bound.reason})"
    sure = (f"with {confidence:.0%} confidence it is {where}" if low == high
            else f"with {confidence:.0%} confidence it lies in {where}")
    if step.by_point_estimate:
        points = ", ".join(map(str, step.by_point_estimate))
        sure += (f"; decided at {points} by the point estimate after "
                 f"{search.plan['trial_cap']} trials (the interval straddled the limit)")
    return f"{found}; {sure}"


def _probe_public(probe: dict[str, Any]) -> CapacityProbe:
    stored = probe.pop("per_user", None)
    rate = (None if stored is None
            else Interval(float(stored[0]), float(stored[1]), float(stored[2]), CONFIDENCE))
    return CapacityProbe(**probe, tokens_per_s_per_user=_figure(rate),
                         tokens_per_s_per_server=_figure(rate, probe["concurrency"]))


def ratio_public(ratio: ServersRatio) -> ServersRatioPublic:
    """P / D with its inputs, as the API shows it."""
    p_range = [ratio.prefill_tokens_per_s, ratio.prefill_tokens_per_s_hi]
    prefill = (f"{ratio.prefill_tokens_per_s:.4g} tok/s (measured; the rate where the TTFT limit "
               f"is crossed lies up to {ratio.prefill_tokens_per_s_hi:.4g})" if ratio.measured
               else f"{ratio.prefill_tokens_per_s:g} tok/s")
    formula = (f"P = {prefill} / {ratio.input_len} = "
               f"{ratio.prefill_requests_per_s:.4g} req/s; D = {ratio.max_concurrency} / "
               f"({ratio.output_len} x {ratio.tpot_s.value * 1000:.4g} ms) = "
               f"{ratio.decode_requests_per_s.value:.4g} req/s; P / D = {ratio.ratio.value:.3g} "
               "decode servers per prefill server")
    return ServersRatioPublic(
        formula=formula, prefill_source="measured" if ratio.measured else "given",
        prefill_tokens_per_s=ratio.prefill_tokens_per_s, prefill_tokens_per_s_range=p_range,
        input_len=ratio.input_len, prefill_requests_per_s=ratio.prefill_requests_per_s,
        prefill_requests_per_s_range=[ratio.prefill_requests_per_s, ratio.prefill_requests_per_s_hi],
        output_len=ratio.output_len,
        max_concurrency=ratio.max_concurrency, tpot_ms=_figure(ratio.tpot_s, 1000.0),
        decode_requests_per_s=_figure(ratio.decode_requests_per_s), ratio=_figure(ratio.ratio))


PREFILL_METHOD = ("real-prefill runs of one output token at each rate; a rate passes when the 95% "
                  "interval of its p99 TTFT (bootstrap over requests, its runs pooled) lies at or "
                  "under the limit, fails when it lies over, else gets another run, up to "
                  f"{prefill_rate.RATE_TRIAL_CAP}, where the point estimate decides; doubling from "
                  "the start rate to the first failure, then bisecting")


def prefill_public(search: CapacitySearch, runs: Sequence[Run], input_len: int) -> PrefillPublic | None:
    """What the search measured of the prefill side at ``input_len``; None when it measures none."""
    asked = search.plan.get("prefill")
    if asked is None:
        return None
    max_ms = float(asked["ttft_p99_max_ms"])
    probes, step = prefill_rate.step_of(runs, input_len, asked, search.looks)
    stopped = search.ended.get(prefill_rate.PREFILL_KEY.format(input_len))
    if step.done and step.error is None and stopped is None:
        state = "decided"
    elif stopped is not None or step.error is not None or search.status != capacity.ACTIVE:
        state = "stopped"
    else:
        state = "measuring"
    rate = prefill_rate.measured(step, input_len) if state == "decided" else None
    limit = f"p99 TTFT <= {max_ms:g} ms"
    if rate is not None and step.bound_reached:
        statement = (f"a prefill server admits {rate.requests_per_s:.4g} requests/s ({limit}; the "
                     f"highest rate asked, max_rate, passed): at least {rate.tokens_per_s:.4g} "
                     f"prefill tokens/s at input_len {input_len}")
    elif rate is not None:
        statement = (f"a prefill server admits {rate.requests_per_s:.4g} requests/s with {limit} "
                     f"({rate.requests_per_s_hi:.4g} failed): {rate.tokens_per_s:.4g} prefill "
                     f"tokens/s at input_len {input_len}, under {rate.tokens_per_s_hi:.4g}")
    else:
        statement = (f"not decided: {step.last_pass:g} requests/s passed {limit} so far"
                     if step.last_pass is not None else f"not decided: no rate has passed {limit} yet")
    return PrefillPublic(
        ttft_p99_max_ms=max_ms, state=state, max_rate=step.last_pass, first_failing_rate=step.first_fail,
        bound_reached=step.bound_reached,
        tokens_per_s=None if rate is None else rate.tokens_per_s,
        tokens_per_s_range=None if rate is None else [rate.tokens_per_s, rate.tokens_per_s_hi],
        method=PREFILL_METHOD, statement=statement,
        probes=[_rate_view(p, max_ms) for p in probes],
        runs=sum(len(p.run_ids) for p in probes), error=stopped or step.error)


def _rate_view(probe: prefill_rate.RateProbe, max_ms: float) -> PrefillProbe:
    verdict, by = probe.judgement(max_ms)
    return PrefillProbe(request_rate=probe.rate, run_id=probe.run_id, run_ids=list(probe.run_ids),
                        trials=probe.trials, status=probe.status, p99_ttft_ms=probe.p99_ttft_ms,
                        ci_ms=None if probe.ci_ms is None else list(probe.ci_ms), verdict=verdict,
                        decided_by=by)


def context_public(search: CapacitySearch, context: Context, runs: Sequence[Run] = (),
                   prefill_tokens_per_s: float | None = None) -> CapacityContext:
    """One input length as the API shows it; with a prefill rate (given, or measured by the
    search), decode servers per prefill server at its boundary."""
    step = context.step
    decided = context.decided
    state = "decided" if decided else ("stopped" if context.ended is not None else "probing")
    per_user = context.per_user
    rate = _figure(per_user)
    prefill = prefill_public(search, runs, context.input_len)
    ratio = None
    if per_user is not None:
        found = None
        output_len = int(search.base["output_len"])
        if prefill_tokens_per_s is not None:
            found = servers_ratio(prefill_tokens_per_s, context.input_len, output_len, step.last_pass,
                                  per_user)
        elif prefill is not None and prefill.tokens_per_s_range is not None:
            low, high = prefill.tokens_per_s_range
            found = servers_ratio(low, context.input_len, output_len, step.last_pass, per_user, high)
        ratio = None if found is None else ratio_public(found)
    return CapacityContext(
        input_len=context.input_len, state=state, decided=decided,
        max_concurrency=step.last_pass, first_failing=step.first_fail,
        limited_by="sla" if step.first_fail is not None else step.bound.kind,
        limit_reason=(f"the probe at {step.first_fail} failed the SLA" if step.first_fail is not None
                      else step.bound.reason),
        confidence=float(search.plan["confidence"]), boundary_range=list(step.surely),
        decided_by_point_estimate=list(step.by_point_estimate),
        statement=_statement(search, context, decided),
        probes=[_probe_public(dict(p)) for p in context.probes],
        tokens_per_s_per_user=rate,
        tokens_per_s_per_server=_figure(per_user, step.last_pass) if step.last_pass else None,
        decode_servers_per_prefill_server=ratio, prefill=prefill,
        runs=context.runs, wall_s=context.wall_s, error=context.ended or step.error)


def capacity_public(engine: Engine, search_id: str,
                    prefill_tokens_per_s: float | None = None) -> CapacityPublic:
    """A search with its status, plan and, per input length, where it stands; decode servers
    per prefill server at the prefill rate given here, else the search's own (given, or
    measured), if any."""
    search, runs = capacity.get_search(engine, search_id)
    bound = ceiling_bound(search.max_concurrency, int(search.plan["ceiling"]))
    prefill = prefill_tokens_per_s or search.plan.get("prefill_tokens_per_s")
    contexts = assess(search.input_lens, float(search.sla["max_ms"]), bound, runs, search.looks,
                      search.ended, cancelled=search.status == "cancelled",
                      trial_cap=int(search.plan["trial_cap"]))
    return CapacityPublic(
        id=search.id, status=status_of(search, runs), created_at=search.created_at,
        finished_at=search.finished_at, base=search.base, input_lens=search.input_lens,
        sla=search.sla, max_concurrency=search.max_concurrency, max_runs=search.max_runs,
        plan=search.plan, runs=len(runs), wall_s=wall_s(runs, utcnow()), error=search.error,
        contexts=[context_public(search, c, runs, prefill) for c in contexts])


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
    "capped", "refused", "run_ids",
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
                user, user_lo, user_hi, server, server_lo, server_hi, p.capped, p.refused,
                " ".join(p.run_ids), c.max_concurrency, c.first_failing, c.decided, c.confidence),
                strict=True)))
    return list(TABLE_COLUMNS), rows
