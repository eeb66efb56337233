"""Sweeps: a grid of runs over one base spec; their points and the table of them."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from service.analysis import comparison
from service.core.errors import Conflict
from service.core.status import FINISHED, MEASURED
from service.core.sweep import SweepCreate, TrialsCreate
from service.storage import logs, sweeps
from service.web import dynamo_export, sweep_view, vllm_sweep
from service.web.admission import check_backend, check_fits, check_model, check_size
from service.web.cancelling import cancel_one
from service.web.deps import ADMIN, DB, READ, Sched
from service.web.downloads import DynamoMode, csv_attachment, dynamo_response
from service.web.errors import ERROR_RESPONSES, ErrorBody
from service.web.schemas import SweepList, SweepPublic, SweepSummary

# A sweep's cancel looks again for runs a look of its until_decided rule queued meanwhile.
CANCEL_PASSES = 3

log = logging.getLogger(__name__)
router = APIRouter(responses=ERROR_RESPONSES)


@router.post("/api/sweeps", status_code=201, response_model=SweepPublic, dependencies=ADMIN)
def submit_sweep(body: SweepCreate, request: Request, engine: DB, scheduler: Sched) -> SweepPublic:
    """Queue one run per point of a grid over a base spec."""
    check_model(request, engine, body.base.model)
    with contextlib.suppress(ValueError):  # a point that is no valid spec: create_sweep says so
        specs = [spec for _, spec in body.points()]
        for spec in specs:
            check_backend(request, spec)
            check_size(request, spec)
        check_fits(request, engine, specs)
    sweep = sweeps.create_sweep(engine, body)
    scheduler.notify()
    public = sweep_view.sweep_public(engine, sweep.id)
    log.info("sweep %s queued: %s, %d runs over %s", sweep.id, body.base.model, len(public.runs),
             ", ".join(f"{k}={v}" for k, v in (sweep.grid or {}).items()))
    return public


@router.get("/api/sweeps", response_model=SweepList, dependencies=READ)
def list_sweeps(
    engine: DB,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> SweepList:
    """List sweeps, newest first: what each varies, its points and its runs by status."""
    page, total = sweeps.sweep_page(engine, limit, offset)
    found = []
    for sweep, counts in page:
        points = math.prod(len(values) for values in sweep.grid.values())
        found.append(SweepSummary(
            id=sweep.id, created_at=sweep.created_at, model=str(sweep.base.get("model", "")),
            grid_keys=list(sweep.grid), points=points, runs=sum(counts.values()),
            repeats=int(sweep.base.get("repeats", 1)), status=counts,
        ))
    return SweepList(sweeps=found, total=total, limit=limit, offset=offset)


@router.get("/api/sweeps/{sweep_id}", response_model=SweepPublic, dependencies=READ)
def get_sweep(sweep_id: str, engine: DB) -> SweepPublic:
    """A sweep: its grid, progress and runs; its points (trials grouped) with each figure's
    95% interval; with a grid over ``mode``, fill against real prefill per point."""
    return sweep_view.sweep_public(engine, sweep_id)


@router.post("/api/sweeps/{sweep_id}/trials", status_code=201, response_model=SweepPublic,
             dependencies=ADMIN)
def add_trials(sweep_id: str, body: TrialsCreate, engine: DB, scheduler: Sched) -> SweepPublic:
    """Queue more trials of a sweep's points (fill/prefill pairs in a sweep over mode): of
    every point, or of those whose grid values ``point`` names; they join the pairs."""
    sweeps.add_trials(engine, sweep_id, body)
    scheduler.notify()
    return sweep_view.sweep_public(engine, sweep_id)


@router.get(
    "/api/sweeps/{sweep_id}/export", response_model=None, dependencies=READ,
    responses={200: {"description": "the sweep's points as CSV, or as JSON {sweep, columns, rows}; "
                                    "or (vllm-sweep) a zip of the directory vllm bench sweep serve writes; "
                                    "or (dynamo) a zip of NVIDIA Dynamo's decode profile",
                     "content": {"text/csv": {}, "application/json": {}, "application/zip": {}}}},
)
def export_sweep(
    sweep_id: str, engine: DB, format: Literal["csv", "json", "vllm-sweep", "dynamo"] = "csv",
    detailed: bool = False, mode: DynamoMode = None,
) -> Response:
    """The sweep's points as one table, one row per point with each figure's 95% interval: CSV
    or JSON. ``vllm-sweep``: a zip of the directory ``vllm bench sweep serve`` writes (a
    folder per point, ``run=N.json`` per trial, ``summary.json``, ``summary.csv``), for
    ``vllm bench sweep plot``; ``detailed`` keeps every per-request list in the run files,
    as ``--save-detailed`` does. ``dynamo``: a zip of the decode profile NVIDIA Dynamo's SLA
    planner loads (``selected_decode_interpolation/raw_data.npz``, ``manifest.json``).
    Runs not finished yet are left out; 409 until one has numbers."""
    if format == "dynamo":
        _, runs = sweeps.get_sweep(engine, sweep_id)
        return dynamo_response(f"decodebench-{sweep_id}", dynamo_export.archive(
            engine, f"sweep {sweep_id}", runs, mode=mode))
    if format == "vllm-sweep":
        sweep, runs = sweeps.get_sweep(engine, sweep_id)
        if not any(r.status in MEASURED and r.summary is not None for r in runs):
            raise Conflict(f"no run of sweep {sweep_id} has finished with numbers yet: nothing to export")
        return StreamingResponse(
            vllm_sweep.archive(engine, list(sweep.grid), runs, detailed), media_type="application/zip",
            headers={"Content-Disposition": f'attachment; filename="decodebench-{sweep_id}-vllm-sweep.zip"'})
    columns, rows = sweep_view.sweep_table(sweep_view.sweep_public(engine, sweep_id))
    name = f"decodebench-{sweep_id}"
    if format == "json":
        return JSONResponse({"sweep": sweep_id, "columns": columns, "rows": rows},
                            headers={"Content-Disposition": f'inline; filename="{name}.json"'})
    return csv_attachment(name, columns, (
        {k: "" if v is None else v for k, v in row.items()} for row in rows))


@router.post("/api/sweeps/{sweep_id}/baseline", dependencies=ADMIN)
def mark_sweep_baseline(sweep_id: str, engine: DB) -> list[dict[str, Any]]:
    """Make every point of a sweep with a succeeded run the baseline of its point."""
    _, runs = sweeps.get_sweep(engine, sweep_id)
    arms = [a for a in comparison.arms_of(runs) if a.ok]
    if not arms:
        raise Conflict(f"sweep {sweep_id} has no succeeded run yet: nothing to mark")
    return [comparison.mark_baseline(engine, a.id) for a in arms]


@router.post("/api/sweeps/{sweep_id}/cancel", response_model=SweepPublic, dependencies=ADMIN)
def cancel_sweep(sweep_id: str, engine: DB, scheduler: Sched) -> SweepPublic:
    """Cancel every run of a sweep that has not finished, as a run's cancel does (a run
    being measured keeps what it measured), and stop its until_decided rule; 409 when all
    have finished."""
    _, runs = sweeps.get_sweep(engine, sweep_id)
    if all(run.status in FINISHED for run in runs):
        raise Conflict(f"every run of sweep {sweep_id} already finished; nothing to cancel")
    # The until_decided rule first, so that it queues no pairs behind the cancel: a look
    # under way checks the stop again in its write, so it queued its pairs before the stop
    # (the passes below cancel them) or queues none.
    sweeps.stop_rule(engine, sweep_id, "the sweep was cancelled")
    cancelled = 0
    for _ in range(CANCEL_PASSES):
        _, runs = sweeps.get_sweep(engine, sweep_id)
        found = sum(cancel_one(engine, scheduler, run.id, "cancelled by the user (its sweep)")
                    for run in runs if run.status not in FINISHED)
        if not found:
            break
        cancelled += found
    if not cancelled:
        raise Conflict(f"every run of sweep {sweep_id} already finished; nothing to cancel")
    return sweep_view.sweep_public(engine, sweep_id)


@router.delete(
    "/api/sweeps/{sweep_id}", status_code=204, dependencies=ADMIN,
    responses={204: {"description": "Deleted, with its runs, their samples and driver logs"},
               409: {"model": ErrorBody, "description": "A run of it has not finished: cancel it first"}},
)
def delete_sweep(sweep_id: str, request: Request, engine: DB, scheduler: Sched) -> Response:
    """Delete a sweep with its runs, their samples, server metrics, baseline marks and
    driver logs; 409 while a run of it is queued, starting or running (cancel it first)."""
    _, runs = sweeps.get_sweep(engine, sweep_id)
    saving = [r.id for r in runs if r.status in FINISHED and scheduler.handling(r.id)]
    if saving:
        raise Conflict(f"run {saving[0]} of sweep {sweep_id} has finished but is still saving "
                       "what it measured; delete the sweep in a moment")
    deleted = sweeps.delete_sweep(engine, sweep_id)
    files = sum(len(logs.delete_run_files(request.app.state.settings.logs_dir, run_id))
                for run_id in deleted)
    log.info("sweep %s deleted with %d runs and %d log files", sweep_id, len(deleted), files)
    return Response(status_code=204)
