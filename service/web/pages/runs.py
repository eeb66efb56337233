"""The runs: the index page (runs, sweeps, capacity searches and servers) and one run's page."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import anyio.from_thread
import numpy as np
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from markupsafe import Markup
from sqlalchemy import Engine

from service.analysis import comparison, server_metrics
from service.analysis.metrics import measured
from service.analysis.step_model import StepModel, fit, predict
from service.core.capacity import SLA_METRICS
from service.core.protocol import connector_totals
from service.core.shapes import catalogue
from service.core.spec import EXTRA_ARGS, effective_load_format
from service.core.status import FINISHED, RunStatus
from service.storage import capacity, measurements, steps, store, sweeps, workers
from service.storage.tables import Run
from service.web import charts
from service.web.api.steps import MAX_FIRST_POINTS, MAX_POINTS, points, why_none
from service.web.deps import DB, Sched
from service.web.pages.render import PAGE, between, failure_cause, spec_facts, templates
from service.web.starting import starting_view

router = APIRouter(dependencies=PAGE, include_in_schema=False)

PAGE_SIZE = 50

# Summary keys shown on a run's page, in groups, with their units.
METRIC_GROUPS: list[tuple[str, list[str]]] = [
    ("Throughput", ["request_throughput", "request_goodput", "output_throughput",
                    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"]),
    ("Counts", ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens"]),
    # Gaps while no request waited for its first token: decode without other prefills (ms).
    ("Decode only (steady window)", ["decode_median_tpot_ms", "decode_p99_tpot_ms",
                                     "decode_median_itl_ms", "decode_p99_itl_ms", "decode_gaps"]),
]
LATENCIES = ["ttft", "tpot", "itl", "e2el"]
STATS = ["mean", "median", "std", "p50", "p90", "p95", "p99"]


# The ended servers the index page lists (their logs are kept: ``Settings.worker_logs_kept``).
RECENT_ENDED_WORKERS = 10


@router.get("/", response_class=HTMLResponse)
def index(
    request: Request,
    engine: DB,
    scheduler: Sched,
    status: RunStatus | None = None,
    model: Annotated[str | None, Query(max_length=512)] = None,
    page: Annotated[int, Query(ge=1, le=100_000)] = 1,
) -> HTMLResponse:
    """The runs, newest first."""
    runs, total = store.list_runs(
        engine, status.value if status else None, model or None, PAGE_SIZE, (page - 1) * PAGE_SIZE
    )
    settings = request.app.state.settings
    # On a cluster, where things run; read on the event loop, where the fleet lives.
    cluster = (anyio.from_thread.run_sync(scheduler.fleet.cluster)
               if settings.ray_address and page == 1 else None)
    return templates.TemplateResponse(
        request,
        "index.html",
        {
            "runs": runs,
            "total": total,
            "page": page,
            "pages": max(1, -(-total // PAGE_SIZE)),
            "status": status.value if status else "",
            "model": model or "",
            "statuses": [s.value for s in RunStatus],
            "sweeps": sweeps.list_sweeps(engine, 10) if page == 1 else [],
            "capacity_searches": capacity.search_page(engine, 10, 0)[0] if page == 1 else [],
            "sla_metrics": SLA_METRICS,
            "workers": workers.active_workers(engine) if page == 1 else [],
            "ended_workers": workers.ended_workers(engine, RECENT_ENDED_WORKERS) if page == 1 else [],
            "cluster": cluster,
            "extra_args": sorted(EXTRA_ARGS),
            "shapes": catalogue(),
        },
    )


@dataclass
class Drawn:
    """What a run's page draws from its samples, read a slice at a time without their texts."""

    starts: list[float] = field(default_factory=list)  # every request's, for the server view
    latencies: list[float] = field(default_factory=list)
    ok_starts: list[float] = field(default_factory=list)  # successful requests'
    ok_latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    gaps: np.ndarray = field(default_factory=lambda: np.empty(0))  # every gap of a successful one


def drawn(engine: Engine, run_id: str) -> Drawn:
    """The values a run's charts are drawn from (seconds)."""
    out = Drawn()
    chunks = []
    for found in measurements.sample_slices(engine, run_id):
        slice_gaps = []
        for s in found:
            out.starts.append(s.start_time)
            out.latencies.append(s.latency)
            if not s.success:
                continue
            out.ok_starts.append(s.start_time)
            out.ok_latencies.append(s.latency)
            out.ttfts.append(s.ttft)
            if (t := s.tpot()) is not None:
                out.tpots.append(t)
            slice_gaps.append(np.asarray(s.itl, dtype=np.float64))
        if slice_gaps:
            chunks.append(np.concatenate(slice_gaps))
    if chunks:
        out.gaps = np.concatenate(chunks)
    return out


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str, engine: DB) -> HTMLResponse:
    """One run: its spec, status, and every summary number."""
    run = store.get_run(engine, run_id)
    values = drawn(engine, run_id)
    origin = min(values.ok_starts, default=0.0)
    chart_list = [
        charts.histogram(np.asarray(values.tpots) * 1000, "TPOT per request", "TPOT (ms)", "requests"),
        charts.histogram(values.gaps * 1000, "Inter-token latency", "ITL (ms)", "gaps"),
        charts.scatter([(t - origin, ttft * 1000)
                        for t, ttft in zip(values.ok_starts, values.ttfts, strict=True)],
                       "TTFT over the run", "request start (s)", "TTFT (ms)"),
    ]
    # The most successful requests open at one instant (``metrics.peak_in_flight``).
    _, in_flight = server_metrics.in_flight(values.ok_starts, values.ok_latencies)
    worker = workers.get_worker(engine, run.worker_id) if run.worker_id else None
    group = store.arm_runs(engine, run.group_id) if run.group_id else []
    baseline = comparison.against_baseline(engine, run) if run.status in FINISHED else None
    # From the stored spec as it is: runs from before load_format existed loaded "auto".
    load_format = effective_load_format(run.model, run.spec.get("engine", {}).get("load_format", "auto"))
    cause, log_lines = failure_cause(run.error, run.model) if run.status == "failed" else ("", "")
    ended = run.finished_at if run.finished_at else (datetime.now(UTC) if run.started_at else None)
    return templates.TemplateResponse(
        request,
        "run.html",
        {
            "facts": spec_facts(run.spec, (run.provenance or {}).get("imported")
                                if run.status == "imported" else None),
            "took_s": between(run.started_at, ended),
            "cause": cause,
            "log_lines": log_lines,
            "starting": starting_view(engine, run, request.app.state.scheduler.fleet.server_of(run.id)),
            "peak_in_flight": (int(in_flight.max()) if in_flight.size else 0) if values.starts else None,
            "load_format": load_format,
            "group": group,
            "baseline": baseline,
            "charts": chart_list,
            "steps": steps_view(engine, run),
            "server_view": server_view(measurements.server_points(engine, run_id), values.starts,
                                       values.latencies),
            "worker": worker,
            # The engine as the server ran it: a bundled model loads dummy weights whatever was asked.
            "worker_engine": {**worker.engine, "load_format": effective_load_format(
                worker.model, worker.engine.get("load_format") or "auto")} if worker else None,
            "worker_log_kept": bool(worker and worker.log_path and Path(worker.log_path).exists()),
            "logs_kept": request.app.state.settings.worker_logs_kept,
            "run": run,
            "summary": measured(run.summary) or {},
            "connector": connector_totals((run.connector or {}).get("ranks", {})),
            "groups": METRIC_GROUPS,
            "latencies": LATENCIES,
            "stats": STATS,
        },
    )


def server_view(points: Sequence[Mapping[str, Any]], start_times: Sequence[float],
                latencies: Sequence[float]) -> Markup | None:
    """The server's running/waiting requests and KV cache use next to the requests the client
    had in flight, on one time line (seconds since the first request); None with no points.

    ``points`` are stored scrapes, ``t`` on the samples' clock; ``start_times`` and
    ``latencies`` of every request."""
    if not points:
        return None
    starts = np.asarray(start_times, dtype=np.float64)
    origin = float(starts.min()) if starts.size else float(points[0]["t"])

    def gauge(name: str, scale: float = 1.0) -> list[tuple[float, float]]:
        return [(p["t"] - origin, p["values"][name] * scale) for p in points if name in p["values"]]

    times, counts = server_metrics.in_flight(starts, latencies)
    return charts.timeline(
        [
            ("requests", {
                "running (server)": gauge(server_metrics.RUNNING),
                "waiting (server)": gauge(server_metrics.WAITING),
                "in flight (client)": list(zip((times - origin).tolist(), counts.tolist(), strict=True)),
            }),
            ("KV cache used (%)", {"KV cache used (server)": gauge(server_metrics.KV_USAGE, 100.0)}),
        ],
        "Server view", "seconds since the run's first request",
        sampled={"running (server)", "waiting (server)", "KV cache used (server)"},
    )



# Batches a run's steps chart colours apart (the most common ones); the rest share a colour.
STEP_BATCHES = 6


def steps_view(engine: Engine, run: Run) -> dict[str, Any]:
    """A run's step model for its page: the chart of forward time against KV tokens (decode
    steps by batch, with the fitted lines; first steps marked apart), the figures with their
    intervals, the notes; or only why there is none."""
    rows = steps.run_steps(engine, run.id)
    if not rows:
        return {"none": why_none(run)}
    model = fit(rows)
    decode = points([r for r in rows if r.kind == "decode"], MAX_POINTS)
    first = points([r for r in rows if r.kind == "first"], MAX_FIRST_POINTS)
    by_batch: dict[int, list[tuple[float, float]]] = {}
    for p in decode:
        by_batch.setdefault(p.decode_requests, []).append((p.kv_tokens, p.forward_ms))
    shown = sorted(sorted(by_batch, key=lambda b: -len(by_batch[b]))[:STEP_BATCHES])
    groups = {f"batch {b}": by_batch[b] for b in shown}
    rest = [xy for b, pts in by_batch.items() if b not in shown for xy in pts]
    if rest:
        groups["other batches"] = rest
    fits = {f"batch {b}": line for b in shown if (line := _fit_line(model, b, by_batch[b]))}
    chart = charts.fitted_scatter(
        groups, fits, {"first steps": [(p.kv_tokens, p.forward_ms) for p in first]} if first else {},
        "Forward time per engine step", "KV tokens read by the step", "forward time (ms)")
    return {"chart": chart, "model": model, "figures": _figures(model)}


def _fit_line(model: StepModel, batch: int, pts: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The model's line at ``batch`` over the KV tokens its steps read; empty where it cannot say."""
    ends = [min(x for x, _ in pts), max(x for x, _ in pts)]
    line = [(kv, at.value) for kv in ends if (at := predict(model, batch, kv)) is not None]
    return line if len(line) == 2 else []


def _figures(model: StepModel) -> list[tuple[str, Any, str]]:
    """(name, interval or None, unit) for the page's table."""
    return [("fixed", model.fixed_ms, "ms" if model.batch is None else f"ms at batch {model.batch}"),
            ("per KV token", model.ns_per_kv_token, "ns"),
            ("per request", model.ms_per_request, "ms"),
            ("first step / predicted", model.first_step_ratio, "ratio")]

