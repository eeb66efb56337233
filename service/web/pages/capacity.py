"""A capacity search's page: per input length, the SLA figure against concurrency with the
limit, the frontier of decode tokens/s per server against per user, and every probe; each
probe's dot in its verdict's colour."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from markupsafe import Markup

from service.web import capacity_view, charts
from service.web.deps import DB
from service.web.pages.render import PAGE, templates
from service.web.schemas import CapacityContext, CapacityProbe, CapacityPublic

router = APIRouter(dependencies=PAGE, include_in_schema=False)

# The verdicts an SLA figure stands behind (a capped or refused probe has none to draw).
JUDGED = ("pass", "fail", "undecided")
# How each verdict reads in a chart's legend, and its colour there.
VERDICT_MARKS = {"pass": "pass: within the SLA", "fail": "fail: over the SLA", "undecided": "undecided"}
MARK_COLORS = {VERDICT_MARKS["pass"]: "#2f9e50", VERDICT_MARKS["fail"]: "#d0353f",
               VERDICT_MARKS["undecided"]: "#c98a12"}
# What the decode rates are, as the frontier's axes name them, and as the tables' headers
# explain them on hover.
PER_USER = "decode tokens/s per user (1 / median TPOT)"
PER_SERVER = "decode tokens/s per server"
WHAT = {
    "per_user_title": ("the rate one user's tokens arrive while it decodes: 1 / the median TPOT over the "
                       "gaps while all C requests decoded; what to size by"),
    "per_server_title": ("the decode rate per user times the concurrency: the server's tokens/s while "
                         "all decode"),
    "output_per_user_title": ("output tokens/s over the whole run divided by the concurrency, as vLLM's "
                              "plot_pareto computes tokens/s/user from the vllm-sweep export: lower than "
                              "the decode rate by the time to first token and the gaps between requests"),
}


def probe_href(probe: CapacityProbe) -> str:
    """Where a probe's dot leads: its run, or its trials side by side."""
    if len(probe.run_ids) == 1 or probe.group_id is None:
        return f"/runs/{probe.run_ids[0]}"
    return f"/groups/{probe.group_id}"


def sla_chart(search: CapacityPublic, context: CapacityContext) -> Markup:
    """The SLA figure of each probe against its concurrency with its interval (at the
    search's per-look confidence) on one line, each dot in its verdict's colour, and the
    limit as a dashed line."""
    metric, limit = search.sla["metric"], float(search.sla["max_ms"])
    measured: list[charts.Point] = []
    for p in context.probes:
        if p.figure_ms is None or p.ci_ms is None or p.verdict not in JUDGED:
            continue
        measured.append(charts.Point(
            float(p.concurrency), p.figure_ms, p.ci_ms[0], p.ci_ms[1], probe_href(p),
            f"concurrency {p.concurrency}: {p.verdict}, {p.figure_ms:.3g} ms "
            f"[{p.ci_ms[0]:.3g}, {p.ci_ms[1]:.3g}] over {p.trials} trials", mark=VERDICT_MARKS[p.verdict]))
    # All probes on one line, in order of concurrency: the curve the boundary sits on.
    series = {f"{metric} (ms)": measured}
    xs = [pt.x for pt in measured] or [1.0]
    line = f"limit {limit:g} ms"
    series[line] = [charts.Point(min(xs), limit, label=line), charts.Point(max(xs), limit, label=line)]
    return charts.lines(series, f"input_len {context.input_len}: {metric} against concurrency "
                        "(intervals at the per-look confidence)", "concurrency (requests in flight)", "ms",
                        dashed={line: line}, marks=MARK_COLORS)


def frontier_chart(context: CapacityContext) -> Markup:
    """Decode output tokens/s per server against per user, a dot per probe in its verdict's
    colour, error bars both ways (95%): the throughput one server gives for the speed each
    user gets while decoding."""
    probes: list[charts.Point] = []
    for p in context.probes:
        user, server = p.tokens_per_s_per_user, p.tokens_per_s_per_server
        if user is None or server is None or p.verdict not in JUDGED:
            continue
        probes.append(charts.Point(
            user.value, server.value, server.ci[0], server.ci[1], probe_href(p),
            f"concurrency {p.concurrency} ({p.verdict}): {server.value:.3g} decode tok/s per server "
            f"[{server.ci[0]:.3g}, {server.ci[1]:.3g}], {user.value:.3g} decode tok/s per user "
            f"[{user.ci[0]:.3g}, {user.ci[1]:.3g}]", xlo=user.ci[0], xhi=user.ci[1],
            mark=VERDICT_MARKS[p.verdict]))
    return charts.lines({"probes": probes}, f"input_len {context.input_len}: decode tokens/s per server "
                        "against per user", PER_USER, PER_SERVER, marks=MARK_COLORS)


@router.get("/capacity/{search_id}", response_class=HTMLResponse)
def capacity_page(request: Request, search_id: str, engine: DB,
                  prefill_tokens_per_s: Annotated[float | None, Query(gt=0, le=1e12)] = None) -> HTMLResponse:
    """One capacity search: per input length its answer, charts and probes."""
    search = capacity_view.capacity_public(engine, search_id, prefill_tokens_per_s)
    contexts = [(c, sla_chart(search, c), frontier_chart(c)) for c in search.contexts]
    return templates.TemplateResponse(request, "capacity.html",
                                      {"search": search, "contexts": contexts,
                                       "prefill": prefill_tokens_per_s
                                       or search.plan.get("prefill_tokens_per_s"), **WHAT})
