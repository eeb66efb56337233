"""REST API under /api, plus /healthz and /metrics."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from sqlalchemy import Engine, text
from sqlmodel import Session, col, select

from service.analysis import comparison, server_metrics
from service.analysis.metrics import export_vllm, is_bunched
from service.control import hub, provenance
from service.control.queue import Scheduler
from service.control.vllm_cli import serve_command
from service.core.protocol import ConnectorReport, FillAnswer, WorkerProvenance, connector_totals
from service.core.sample import Sample
from service.core.servers import WorkerRegister
from service.core.spec import RunSpec, describe, effective_load_format
from service.core.status import FINISHED, RunStatus
from service.core.sweep import SweepCreate
from service.storage import store
from service.storage.tables import Run, Worker
from service.web import prom
from service.web.auth import require_admin, require_reader, require_worker
from service.web.deps import DB, Sched
from service.web.errors import ERROR_RESPONSES, Conflict, ErrorBody, Invalid, NotFound, shown
from service.web.schemas import (
    GroupPublic,
    RunList,
    RunPublic,
    ServerMetricsPublic,
    ServerMetricsSummary,
    ServerPointPublic,
    SweepList,
    SweepPublic,
    SweepSummary,
    WorkerPublic,
    WorkerRegistered,
)

router = APIRouter(responses=ERROR_RESPONSES)
ADMIN = [Depends(require_admin)]
READ = [Depends(require_reader)]
# How long a cancel waits for the run's runner to end it (it stops its drivers and saves).
CANCEL_WAIT_S = 30.0


@router.post(
    "/api/runs", status_code=201, response_model=RunPublic, dependencies=ADMIN,
    responses={200: {"model": RunPublic, "description": "Same Idempotency-Key and body: that run"}},
)
def submit_run(
    spec: RunSpec,
    request: Request,
    engine: DB,
    scheduler: Sched,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> Any:
    """Queue a benchmark run."""
    _check_model(request, engine, spec.model)
    run, created = store.create_run(engine, spec, idempotency_key)
    if created:
        scheduler.notify()
        return RunPublic.of(run)
    return JSONResponse(RunPublic.of(run).model_dump(mode="json"), status_code=200)


@router.get("/api/runs", response_model=RunList, dependencies=READ)
def list_runs(
    engine: DB,
    status: RunStatus | None = None,
    model: Annotated[str | None, Query(max_length=512)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> RunList:
    """List runs, newest first."""
    runs, total = store.list_runs(engine, status.value if status else None, model, limit, offset)
    return RunList(runs=[RunPublic.of(r) for r in runs], total=total, limit=limit, offset=offset)


def _check_model(request: Request, engine: Engine, model: str) -> None:
    """A 422 now for a model no worker could load (``service.control.hub``), rather than a failed
    run once a worker was started for it; a model a registered server serves is its own."""
    if any(w.external and w.model == model for w in store.active_workers(engine)):
        return
    problem = hub.model_problem(model, request.app.state.settings.hub_check)
    if problem is not None:
        raise Invalid(problem)


@router.get("/api/runs/{run_id}", response_model=RunPublic, dependencies=READ)
def get_run(run_id: str, engine: DB) -> RunPublic:
    """One run: spec, status, progress, summary, error."""
    return RunPublic.of(store.get_run(engine, run_id))


@router.delete(
    "/api/runs/{run_id}", status_code=204, dependencies=ADMIN,
    responses={204: {"description": "Deleted, with its samples"},
               409: {"model": ErrorBody, "description": "The run has not finished: cancel it first"}},
)
def delete_run(run_id: str, engine: DB, scheduler: Sched) -> Response:
    """Delete a finished run with its samples, server metrics and baseline mark; 409 while
    it is queued, starting or running (cancel it first)."""
    run = store.get_run(engine, run_id)
    if run.status in FINISHED and scheduler.handling(run_id):
        raise Conflict(f"run {run_id} is {run.status} but still saving what it measured; "
                       "delete it in a moment")
    store.delete_run(engine, run_id)
    return Response(status_code=204)


@router.post("/api/runs/{run_id}/cancel", response_model=RunPublic, dependencies=ADMIN)
def cancel_run(run_id: str, engine: DB, scheduler: Sched) -> RunPublic:
    """Cancel a queued or running run; 409 if it already finished. A run being measured
    stops sending, keeps what it measured and ends ``cancelled`` before the answer."""
    run = store.get_run(engine, run_id)
    if run.status in FINISHED:
        raise Conflict(f"run {run_id} already finished ({run.status}); nothing to cancel")
    if not cancel_one(engine, scheduler, run_id, "cancelled by the user"):
        run = store.get_run(engine, run_id)
        raise Conflict(f"run {run_id} already finished ({run.status}); nothing to cancel")
    return RunPublic.of(store.get_run(engine, run.id))


def cancel_one(engine: Engine, scheduler: Scheduler, run_id: str, reason: str) -> bool:
    """Cancel one unfinished run: its runner's, once one has it (waited for, up to
    ``CANCEL_WAIT_S``); else the guarded move from ``queued``. False when it had finished."""
    for _ in range(3):
        try:
            if scheduler.cancel(run_id).result(timeout=CANCEL_WAIT_S):
                return True
        except TimeoutError:
            return True  # its runner is still winding down; it ends ``cancelled``
        if store.transition(engine, run_id, RunStatus.cancelled, error=reason):
            return True
        if store.get_run(engine, run_id).status in FINISHED:
            return False
        # Placed between the two looks: its runner has it now.
    return False


@router.get("/api/runs/{run_id}/requests", response_model=list[Sample], dependencies=READ)
def get_requests(run_id: str, engine: DB) -> list[Sample]:
    """Raw per-request samples of a run (seconds, client clock)."""
    store.get_run(engine, run_id)
    return store.get_samples(engine, run_id)


@router.get("/api/runs/{run_id}/server-metrics", response_model=ServerMetricsPublic, dependencies=READ)
def get_server_metrics(run_id: str, engine: DB) -> ServerMetricsPublic:
    """What the run's vLLM server reported on its /metrics during the run (t: seconds since
    the first scrape), with counter deltas and gauge max/mean."""
    store.get_run(engine, run_id)
    points = _server_points(engine, run_id)
    origin = points[0].t if points else 0.0
    return ServerMetricsPublic(
        run_id=run_id,
        points=[ServerPointPublic(t=p.t - origin, values=p.values) for p in points],
        summary=ServerMetricsSummary(**server_metrics.summarize(points)),
    )


def _server_points(engine: Engine, run_id: str) -> list[server_metrics.Point]:
    return [server_metrics.Point(**row) for row in store.server_points(engine, run_id)]


CSV_FIELDS = [
    "index", "prompt_len", "output_tokens", "success", "ttft", "tpot", "latency",
    "start_time", "due_time", "sent_time", "itl_count", "itl", "bunched", "error",
    # Last, so that columns read by position keep theirs: "fill" or "prefill".
    "mode",
]


def _csv_attachment(name: str, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> Response:
    """``rows`` as a CSV download named ``name.csv``."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    return Response(out.getvalue(), media_type="text/csv",
                    headers={"Content-Disposition": f'attachment; filename="{name}.csv"'})


@router.get(
    "/api/runs/{run_id}/export", response_model=None, dependencies=READ,
    responses={200: {"description": "vLLM result JSON, or CSV of the samples",
                     "content": {"application/json": {}, "text/csv": {}}}},
)
def export_run(
    run_id: str, engine: DB, format: Literal["vllm", "csv"] = "vllm"
) -> JSONResponse | Response:
    """The run as vLLM-bench-compatible JSON, or its samples as CSV."""
    run = store.get_run(engine, run_id)
    samples = store.get_samples(engine, run_id)
    name = f"decodebench-{run.id}"
    if format == "csv":
        mode = run.spec.get("mode", "fill")
        return _csv_attachment(name, CSV_FIELDS, ({
            "index": s.index, "mode": mode, "prompt_len": s.prompt_len,
            "output_tokens": s.output_tokens,
            "success": s.success, "ttft": s.ttft,
            "tpot": (s.latency - s.ttft) / (s.output_tokens - 1)
            if s.success and s.output_tokens > 1 else "",
            "latency": s.latency,
            "start_time": s.start_time, "due_time": s.due_time, "sent_time": s.sent_time,
            "itl_count": len(s.itl), "itl": " ".join(f"{x:.6f}" for x in s.itl),
            "bunched": is_bunched(s), "error": s.error,
        } for s in samples))
    if run.summary is None:
        raise Conflict(f"run {run_id} has no summary yet (status {run.status})")
    spec = run.spec
    info = {
        "model": spec["model"],
        # A run with a stop rule sent what its rule let it send.
        "num_prompts": (run.stopped_by or {}).get("requests", spec["num_prompts"]),
        "request_rate": spec["request_rate"],
        "burstiness": spec["burstiness"],
        "max_concurrency": spec["max_concurrency"],
        "date": (run.started_at or run.created_at).strftime("%Y%m%d-%H%M%S"),
        "label": run.id,
        # vLLM's result file keeps free keys (--metadata): the headline of the run's
        # provenance as strings, as --metadata writes them; the rest in one block.
        "metadata": {**_ramp_up_keys(spec.get("ramp_up")), **provenance.export_keys(run.provenance, spec),
                     "decodebench": {
            "mode": spec["mode"], "fill": spec["fill"], "warnings": run.warnings or [],
            "provenance": run.provenance,
            "load_format": effective_load_format(
                spec["model"], spec["engine"].get("load_format", "auto")),
            "cpu_binding": run.cpu_binding, "stopped_by": run.stopped_by,
            # 95% bootstrap intervals over requests, keyed like vLLM's statistics.
            "intervals": {k: v for k, v in run.summary.items() if k.endswith("_ci")},
            "group_id": run.group_id, "trial": run.trial, "seed": spec.get("seed"),
            "server_metrics": server_metrics.summarize(_server_points(engine, run_id)),
            "connector": {**connector_totals((run.connector or {}).get("ranks", {})),
                          "pulls": run.connector_pulls},
        }},
    }
    return JSONResponse(
        export_vllm(run.summary, samples, info),
        headers={"Content-Disposition": f'attachment; filename="{name}.json"'},
    )


def _ramp_up_keys(ramp_up: dict[str, Any] | None) -> dict[str, Any]:
    """The keys vLLM's result file has when its run ramped its request rate up."""
    if not ramp_up:
        return {}
    return {"ramp_up_strategy": ramp_up["strategy"], "ramp_up_start_rps": ramp_up["start_rps"],
            "ramp_up_end_rps": ramp_up["end_rps"]}


@router.post("/api/sweeps", status_code=201, response_model=SweepPublic, dependencies=ADMIN)
def submit_sweep(body: SweepCreate, request: Request, engine: DB, scheduler: Sched) -> SweepPublic:
    """Queue one run per point of a grid over a base spec."""
    _check_model(request, engine, body.base.model)
    sweep = store.create_sweep(engine, body)
    scheduler.notify()
    return comparison.sweep_public(engine, sweep.id)


@router.get("/api/sweeps", response_model=SweepList, dependencies=READ)
def list_sweeps(
    engine: DB,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> SweepList:
    """List sweeps, newest first: what each varies, its points and its runs by status."""
    page, total = store.sweep_page(engine, limit, offset)
    sweeps = []
    for sweep, counts in page:
        points = math.prod(len(values) for values in sweep.grid.values())
        sweeps.append(SweepSummary(
            id=sweep.id, created_at=sweep.created_at, model=str(sweep.base.get("model", "")),
            grid_keys=list(sweep.grid), points=points, runs=sum(counts.values()),
            repeats=int(sweep.base.get("repeats", 1)), status=counts,
        ))
    return SweepList(sweeps=sweeps, total=total, limit=limit, offset=offset)


@router.get("/api/sweeps/{sweep_id}", response_model=SweepPublic, dependencies=READ)
def get_sweep(sweep_id: str, engine: DB) -> SweepPublic:
    """A sweep: its grid, progress and runs; its points (trials grouped) with each figure's
    95% interval; with a grid over ``mode``, fill against real prefill per point."""
    return comparison.sweep_public(engine, sweep_id)


@router.get(
    "/api/sweeps/{sweep_id}/export", response_model=None, dependencies=READ,
    responses={200: {"description": "the sweep's points as CSV, or as JSON {sweep, columns, rows}",
                     "content": {"text/csv": {}, "application/json": {}}}},
)
def export_sweep(
    sweep_id: str, engine: DB, format: Literal["csv", "json"] = "csv"
) -> JSONResponse | Response:
    """The sweep's points as one table, one row per point with each figure's 95% interval: CSV or JSON."""
    columns, rows = comparison.sweep_table(comparison.sweep_public(engine, sweep_id))
    name = f"decodebench-{sweep_id}"
    if format == "json":
        return JSONResponse({"sweep": sweep_id, "columns": columns, "rows": rows},
                            headers={"Content-Disposition": f'inline; filename="{name}.json"'})
    return _csv_attachment(name, columns, (
        {k: "" if v is None else v for k, v in row.items()} for row in rows))


@router.post("/api/sweeps/{sweep_id}/baseline", dependencies=ADMIN)
def mark_sweep_baseline(sweep_id: str, engine: DB) -> list[dict[str, Any]]:
    """Make every point of a sweep with a succeeded run the baseline of its point."""
    _, runs = store.get_sweep(engine, sweep_id)
    arms = [a for a in comparison.arms_of(runs) if a.ok]
    if not arms:
        raise Conflict(f"sweep {sweep_id} has no succeeded run yet: nothing to mark")
    return [comparison.mark_baseline(engine, a.id) for a in arms]


@router.get("/api/groups/{group_id}", response_model=GroupPublic, dependencies=READ)
def get_group(group_id: str, engine: DB) -> GroupPublic:
    """The trials of a run with ``repeats`` and each figure over them: mean, Student-t
    95% interval and coefficient of variation."""
    view = comparison.group_view(engine, group_id)
    return GroupPublic(id=view["id"], spec=view["spec"], runs=[RunPublic.of(r) for r in view["runs"]],
                       succeeded=view["succeeded"], figures=view["figures"])


@router.post("/api/groups/{group_id}/cancel", response_model=GroupPublic, dependencies=ADMIN)
def cancel_group(group_id: str, engine: DB, scheduler: Sched) -> GroupPublic:
    """Cancel every trial of a point that has not finished; 409 when all have."""
    if not group_id.startswith("g-"):
        raise NotFound(f"group {shown(group_id)} not found")
    runs = store.arm_runs(engine, group_id)
    cancelled = 0
    for run in runs:
        if run.status not in FINISHED and cancel_one(engine, scheduler, run.id,
                                                      "cancelled by the user (its group)"):
            cancelled += 1
    if not cancelled:
        raise Conflict(f"every trial of {group_id} already finished; nothing to cancel")
    return get_group(group_id, engine)


@router.get("/api/compare", dependencies=READ)
def compare(
    engine: DB, ids: Annotated[list[str], Query(max_length=comparison.MAX_COMPARED)],
) -> dict[str, Any]:
    """Runs or groups against the first: per metric each one's value with its 95% interval,
    the ratio to the first with its interval, and a verdict (different / not
    distinguishable at 95%; better / worse)."""
    chosen = comparison.split_ids(ids)
    if len(chosen) < 2 or len(chosen) > comparison.MAX_COMPARED:
        raise Invalid(f"give 2 to {comparison.MAX_COMPARED} run or group ids in ids (comma-separated or "
                      f"repeated); got {len(chosen)}")
    return comparison.compare(engine, chosen)


@router.post("/api/runs/{run_id}/baseline", dependencies=ADMIN)
def mark_baseline(run_id: str, engine: DB) -> dict[str, Any]:
    """Make a run (a trial: its whole group) the baseline of its point (model, engine and
    load); 409 until it has succeeded."""
    return comparison.mark_baseline(engine, run_id)


@router.delete("/api/runs/{run_id}/baseline", status_code=204, dependencies=ADMIN)
def unmark_baseline(run_id: str, engine: DB) -> Response:
    """Stop a run (or its group) being its point's baseline; 409 when it is none."""
    comparison.unmark_baseline(engine, run_id)
    return Response(status_code=204)


@router.get("/api/runs/{run_id}/baseline", dependencies=READ)
def against_baseline(run_id: str, engine: DB) -> dict[str, Any]:
    """A run's point against its baseline: per regression metric the ratio with its 95%
    interval and verdict; ``baseline`` null when its point has none."""
    found = comparison.against_baseline(engine, store.get_run(engine, run_id))
    return found or {"baseline": None, "is_baseline": False, "changes": []}


@router.get("/api/baselines", dependencies=READ)
def list_baselines(engine: DB) -> list[dict[str, Any]]:
    """Every baseline: its point key, arm and model, newest first."""
    return [{"point": b.point, "arm": b.arm, "model": b.model, "created_at": b.created_at.isoformat()}
            for b in comparison.list_baselines(engine)]


@router.get("/api/regressions", dependencies=READ)
def regressions(engine: DB) -> list[dict[str, Any]]:
    """Points whose newest run (or group) is significantly worse than the point's baseline
    on median or p99 TPOT, decode median ITL or median TTFT."""
    return comparison.regressions(engine)


@router.get("/api/workers", response_model=list[WorkerPublic], dependencies=READ)
def list_workers(engine: DB) -> list[WorkerPublic]:
    """vLLM servers the service started or was told about, newest first."""
    with Session(engine) as session:
        rows = session.exec(select(Worker).order_by(col(Worker.created_at).desc())).all()
        return [WorkerPublic.model_validate(w, from_attributes=True) for w in rows]


@router.post("/api/workers", status_code=201, response_model=WorkerRegistered, dependencies=ADMIN)
async def register_worker(body: WorkerRegister, request: Request, scheduler: Sched) -> WorkerRegistered:
    """Register a vLLM server started elsewhere; the answer holds its worker token and the
    exact ``vllm serve`` line to start it with (shown once)."""
    settings = request.app.state.settings
    worker, token = await scheduler.fleet.register(body)
    control_url = body.control_url or settings.control_base_url()
    command, config = serve_command(body, control_url, token)
    scheduler.probe_now()
    public = WorkerPublic.model_validate(worker, from_attributes=True)
    return WorkerRegistered(**public.model_dump(), token=token, kv_transfer_config=config,
                            vllm_serve=command)


@router.get("/api/workers/{worker_id}", response_model=WorkerPublic, dependencies=READ)
def get_worker(worker_id: str, engine: DB) -> WorkerPublic:
    """One vLLM server: where it is, its status and why."""
    worker = store.get_worker(engine, worker_id)
    if worker is None:
        raise NotFound(f"worker {shown(worker_id)} not found")
    return WorkerPublic.model_validate(worker, from_attributes=True)


@router.delete("/api/workers/{worker_id}", status_code=204, dependencies=ADMIN)
async def remove_worker(worker_id: str, scheduler: Sched) -> Response:
    """Remove a registered server: no more runs go to it and its token stops working;
    409 while it serves a run."""
    await scheduler.fleet.deregister(worker_id)
    return Response(status_code=204)


@router.get("/api/connector/fill", response_model=FillAnswer)
def connector_fill(
    engine: DB,
    run_id: Annotated[str, Query(min_length=1, max_length=64)],
    worker: Annotated[Worker, Depends(require_worker)],
) -> FillAnswer:
    """Fill parameters of one run, for the connector inside the run's worker."""
    try:
        run: Run | None = store.get_run(engine, run_id)
    except NotFound:
        run = None
    # The same answer whether the run does not exist or is another worker's.
    if run is None or run.worker_id != worker.id:
        raise NotFound(f"run {shown(run_id)} is not assigned to this worker")
    try:
        spec = RunSpec.stored(run.spec)
    except ValidationError as exc:
        raise Conflict(f"run {run_id!r} has a stored spec that no longer validates: {describe(exc)}") from exc
    store.record_pull(engine, run_id)
    return FillAnswer(run_id=run_id, mode=spec.mode, mean=spec.fill.mean, std=spec.fill.std)


@router.post("/api/connector/report", status_code=204)
def connector_report(
    report: ConnectorReport,
    engine: DB,
    scheduler: Sched,
    worker: Annotated[Worker, Depends(require_worker)],
) -> Response:
    """Cumulative fill counters from a worker's connector, per run it served."""
    store.record_report(engine, worker.id, f"{report.role}:{report.rank}", report.counters())
    for run_id in report.runs:
        scheduler.reported(run_id)
    return Response(status_code=204)


@router.post("/api/connector/provenance", status_code=204)
def connector_provenance(
    report: WorkerProvenance,
    engine: DB,
    worker: Annotated[Worker, Depends(require_worker)],
) -> Response:
    """What a worker's connector found about its server at start: versions, resolved engine
    settings, KV cache, hardware, command line; every run on it records this."""
    store.record_worker_provenance(engine, worker.id, report.model_dump())
    return Response(status_code=204)


@router.get("/healthz")
def healthz(engine: DB, scheduler: Sched) -> JSONResponse:
    """Liveness and readiness: the database answers and the scheduler loop runs."""
    checks: dict[str, str] = {}
    try:
        with Session(engine) as session:
            session.connection().execute(text("SELECT 1"))
        checks["db"] = "ok"
    except Exception as exc:
        checks["db"] = f"error: {exc}"
    checks["scheduler"] = "ok" if scheduler.alive() else "stopped"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ok" if ok else "unavailable", **checks}, status_code=200 if ok else 503)


@router.get("/metrics", response_class=PlainTextResponse, dependencies=READ)
def prometheus_metrics(request: Request, engine: DB, scheduler: Sched) -> Response:
    """Prometheus metrics of the service."""
    registry = prom.app_registry(request.app.state, engine, scheduler)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
