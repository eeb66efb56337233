"""A sweep's page (its points, curves and fill against prefill) and a group's (the trials
of one point)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from service.analysis import comparison
from service.core.status import FINISHED
from service.storage import store
from service.web import charts, sweep_view
from service.web.deps import DB
from service.web.pages.render import PAGE, templates

router = APIRouter(dependencies=PAGE, include_in_schema=False)


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, sweep_id: str, engine: DB) -> HTMLResponse:
    """One sweep: its points with their intervals, curves, fill against prefill, runs."""
    sweep = sweep_view.sweep_public(engine, sweep_id)
    keys = list(sweep.grid)
    runs_by_id = {r.id: r for r in sweep.runs}
    rows = [({k: comparison.spec_value(r.spec, k) for k in keys}, r) for r in sweep.runs]
    points = sweep.points
    both_modes = len({p["point"].get("mode", "fill") for p in points}) > 1
    href = {p["arm"]: f"/groups/{p['arm']}" if p["arm"].startswith("g-") else f"/runs/{p['arm']}"
            for p in points}

    def curve(key: str, x: str, label: str) -> dict[str, list[charts.Point]]:
        series: dict[str, list[charts.Point]] = {}
        for p in points:
            fig = p["figures"].get(key)
            if not fig or fig["value"] is None:
                continue
            spec = runs_by_id[p["runs"][0]].spec
            other = spec[label]
            name = f"{label}={other if other is not None else 'inf'}"
            if both_modes:
                name += f" {spec['mode']}"
            ci = fig.get("ci") or [None, None]
            # A latency or a rate is never below 0: a t interval over two or three trials
            # can reach there; the band stops at 0, the hover text keeps the interval.
            drawn_lo = max(ci[0], 0.0) if ci[0] is not None else None
            what = ", ".join(f"{k}={v}" for k, v in p["point"].items())
            spread = f" [{ci[0]:.3g}, {ci[1]:.3g}]" if ci[0] is not None else ""
            trials = f"; {fig['n']} trials" if fig["n"] > 1 else ""
            series.setdefault(name, []).append(charts.Point(
                float(spec[x]), float(fig["value"]), drawn_lo, ci[1], href[p["arm"]],
                f"{what}: {fig['value']:.3g}{spread}{trials}"))
        return series

    x_key = "input_len" if "input_len" in keys or "max_concurrency" not in keys else "max_concurrency"
    line_key = "max_concurrency" if x_key == "input_len" else "input_len"
    log2 = x_key == "input_len"
    xlabel = "input length (tokens, log-2 scale)" if log2 else "max_concurrency"
    chart_list = [
        charts.lines(curve("median_tpot_ms", x_key, line_key), "Median TPOT (ms) with its 95% interval",
                     xlabel, "ms", log2_x=log2),
        charts.lines(curve("decode_median_tpot_ms", x_key, line_key),
                     "Decode-only median TPOT (steady window, ms)", xlabel, "ms", log2_x=log2),
        charts.lines(curve("p99_tpot_ms", x_key, line_key), "p99 TPOT (ms)", xlabel, "ms", log2_x=log2),
        charts.lines(curve("output_throughput", "max_concurrency", "input_len"),
                     "Output throughput against concurrency", "max_concurrency", "tokens/s"),
    ]
    measured = curve("decode_median_itl_ms", x_key, line_key)
    floors = roofline_curve(points, runs_by_id, x_key, line_key, both_modes, href)
    if floors:
        names = {f"{name} roofline": name for name in floors}
        chart_list.insert(2, charts.lines(
            {**measured, **{f"{name} roofline": pts for name, pts in floors.items()}},
            "Decode median ITL (solid) and its roofline min step time (dashed), ms",
            xlabel, "ms", log2_x=log2, dashed=names))
    baselines = {}
    for p in points:
        first = runs_by_id[p["runs"][0]]
        if p["succeeded"] and all(runs_by_id[i].status in FINISHED for i in p["runs"]):
            baselines[p["arm"]] = comparison.against_baseline(engine, store.get_run(engine, first.id))
    return templates.TemplateResponse(
        request, "sweep.html",
        {"sweep": sweep, "keys": keys, "rows": rows, "charts": chart_list, "points": points,
         "pairs": sweep.fill_vs_prefill, "href": href, "baselines": baselines,
         "base_shown": base_not_swept(sweep.base, keys)},
    )


def roofline_curve(points: Sequence[Mapping[str, Any]], runs_by_id: Mapping[str, Any], x: str,
                   label: str, both_modes: bool, href: Mapping[str, str]) -> dict[str, list[charts.Point]]:
    """Per line of the sweep's curves, the least step time the roofline allows at each point
    (the mean over its succeeded trials' ``summary["roofline"]["min_step_ms"]``); empty when
    no run's server reported its sizes."""
    series: dict[str, list[charts.Point]] = {}
    for p in points:
        runs = [runs_by_id[i] for i in p["runs"]]
        floors = [float(r.summary["roofline"]["min_step_ms"]) for r in runs
                  if r.status == "succeeded" and (r.summary or {}).get("roofline")]
        if not floors:
            continue
        spec = runs[0].spec
        other = spec[label]
        name = f"{label}={other if other is not None else 'inf'}"
        if both_modes:
            name += f" {spec['mode']}"
        value = sum(floors) / len(floors)
        what = ", ".join(f"{k}={v}" for k, v in p["point"].items())
        series.setdefault(name, []).append(charts.Point(
            float(spec[x]), value, href=href[p["arm"]], label=f"{what}: roofline {value:.3g} ms"))
    return series


def base_not_swept(base: Mapping[str, Any], grid_keys: Sequence[str]) -> dict[str, Any]:
    """The base spec without the fields the grid sets (dotted keys reach into nested specs):
    what every point really shares."""
    shown = {k: v for k, v in base.items() if k not in grid_keys}
    for key in grid_keys:
        head, _, tail = key.partition(".")
        if tail and isinstance(shown.get(head), dict):
            shown[head] = {k: v for k, v in shown[head].items() if k != tail}
    return shown


@router.get("/groups/{group_id}", response_class=HTMLResponse)
def group_page(request: Request, group_id: str, engine: DB) -> HTMLResponse:
    """The trials of one point and every figure over them."""
    view = comparison.group_view(engine, group_id)
    points = []
    for r in view["runs"]:
        value = (r.summary or {}).get("median_tpot_ms") if r.status == "succeeded" else None
        if value is None:
            continue
        lo, hi = (r.summary or {}).get("median_tpot_ms_ci") or [None, None]
        points.append(charts.Point(float(r.trial or 0) + 1, float(value), lo, hi, f"/runs/{r.id}",
                                   f"trial {(r.trial or 0) + 1} ({r.id}): {value:.3g} ms"))
    trial_chart = charts.lines({"median TPOT": points},
                               "Median TPOT per trial (ms) with its interval over requests", "trial", "ms")
    return templates.TemplateResponse(
        request, "group.html", {"group": view, "chart": trial_chart,
                                "shown": [k for k in comparison.POINT_FIGURES if k in view["figures"]]
                                + [k for k in view["figures"] if k not in comparison.POINT_FIGURES]})

