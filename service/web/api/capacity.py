"""Capacity searches: per input length, the largest concurrency whose decode latency
stays under a limit, found by probing (``service.analysis.capacity``)."""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from service.analysis.capacity import plan_for
from service.analysis.prefill_rate import rate_plan
from service.core.capacity import (
    CapacityCreate,
    probe_spec,
)
from service.core.errors import Conflict
from service.core.status import FINISHED, MEASURED
from service.storage import capacity, logs
from service.web import capacity_view, dynamo_export, vllm_sweep
from service.web.admission import check_backend, check_fits, check_model, check_search_size
from service.web.cancelling import cancel_one
from service.web.deps import ADMIN, DB, READ, Sched
from service.web.downloads import DynamoMode, csv_attachment, dynamo_response
from service.web.errors import ERROR_RESPONSES, ErrorBody
from service.web.schemas import CapacityList, CapacityPublic, CapacitySummary

log = logging.getLogger(__name__)
router = APIRouter(responses=ERROR_RESPONSES)


@router.post("/api/capacity", status_code=201, response_model=CapacityPublic, dependencies=ADMIN)
def submit_capacity(body: CapacityCreate, request: Request, engine: DB, scheduler: Sched) -> CapacityPublic:
    """Start a capacity search: per input length, the largest concurrency at which the SLA
    figure holds, probing from one request up; the first probes are queued now."""
    check_model(request, engine, body.base.model)
    specs = [probe_spec(body.base, length, 1, 0) for length in body.input_lens]
    for spec in specs:
        check_backend(request, spec)
    check_fits(request, engine, specs)
    check_search_size(request, body)
    plan = plan_for(body.ceiling()).as_dict()
    if body.prefill is not None:
        asked = body.prefill
        plan["prefill"] = rate_plan(asked.start_rate, asked.max_rate, asked.precision)
    search = capacity.create_search(engine, body, plan)
    scheduler.notify()
    log.info("capacity search %s: input_lens %s, %s <= %g ms", search.id, body.input_lens,
             body.sla.metric, body.sla.max_ms)
    return capacity_view.capacity_public(engine, search.id)


@router.get("/api/capacity", response_model=CapacityList, dependencies=READ)
def list_capacity(
    engine: DB,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> CapacityList:
    """List capacity searches, newest first, with their runs counted by status."""
    page, total = capacity.search_page(engine, limit, offset)
    found = []
    for search, counts in page:
        status = search.status
        if status == capacity.ACTIVE:
            status = "running" if set(counts) - {"queued"} else "queued"
        found.append(CapacitySummary(id=search.id, status=status, created_at=search.created_at,
                                     model=str(search.base.get("model", "")),
                                     input_lens=search.input_lens, sla=search.sla, runs=counts))
    return CapacityList(searches=found, total=total, limit=limit, offset=offset)


PrefillRate = Annotated[float | None, Query(gt=0, le=1e12, description=(
    "A prefill server's prefill tokens/s: decode servers per prefill server at each boundary "
    "(default: the search's own, if it was given one)"))]


@router.get("/api/capacity/{search_id}", response_model=CapacityPublic, dependencies=READ)
def get_capacity(search_id: str, engine: DB, prefill_tokens_per_s: PrefillRate = None) -> CapacityPublic:
    """A capacity search: its status and, per input length, the boundary so far (last
    passing and first failing concurrency), the range that holds it at the stated
    confidence, every probe with its figure, interval and verdict, the decode rates at the
    boundary, the runs spent and the wall time; with a prefill rate, decode servers per
    prefill server."""
    return capacity_view.capacity_public(engine, search_id, prefill_tokens_per_s)


@router.get(
    "/api/capacity/{search_id}/export", response_model=None, dependencies=READ,
    responses={200: {"description": "the search's probes as CSV, or as JSON {search, columns, rows}; "
                                    "or (vllm-sweep) a zip of the directory vllm bench sweep serve writes; "
                                    "or (dynamo) a zip of NVIDIA Dynamo's decode profile",
                     "content": {"text/csv": {}, "application/json": {}, "application/zip": {}}}},
)
def export_capacity(search_id: str, engine: DB,
                    format: Literal["csv", "json", "vllm-sweep", "dynamo"] = "csv",
                    prefill_tokens_per_s: PrefillRate = None, detailed: bool = False,
                    mode: DynamoMode = None) -> Response:
    """A capacity search as one table, a row per probe (its verdict, SLA figure and decode
    rates with intervals, runs) beside its input length's answer: CSV, or JSON with the
    search as ``GET /api/capacity/{id}`` answers it (and P / D at the prefill rate given).
    ``vllm-sweep``: a zip of the directory ``vllm bench sweep serve`` writes, a folder per
    probe (input length, concurrency), for ``vllm bench sweep plot`` and ``plot_pareto``;
    a capped probe's runs are failures there. ``dynamo``: a zip of the decode profile NVIDIA
    Dynamo's SLA planner loads, a point per probe (a capped probe's runs left out). 409
    until a probe run has numbers."""
    search = capacity_view.capacity_public(engine, search_id, prefill_tokens_per_s)
    name = f"decodebench-{search_id}"
    held_out = {run_id: f"the probe at {p.concurrency} was capped: {p.capped}"
                for c in search.contexts for p in c.probes if p.capped for run_id in p.run_ids}
    if format == "dynamo":
        _, runs = capacity.get_search(engine, search_id)
        return dynamo_response(name, dynamo_export.archive(
            engine, f"capacity search {search_id}", runs, mode=mode, held_out=held_out))
    if format == "vllm-sweep":
        stored, runs = capacity.get_search(engine, search_id)
        if not any(r.status in MEASURED and r.summary is not None for r in runs):
            raise Conflict(f"no probe run of capacity search {search_id} has finished with numbers "
                           "yet: nothing to export")
        return StreamingResponse(
            vllm_sweep.archive(engine, capacity_view.sweep_keys(stored.base), runs, detailed, held_out),
            media_type="application/zip",
            headers={"Content-Disposition": f'attachment; filename="{name}-vllm-sweep.zip"'})
    columns, rows = capacity_view.capacity_table(search)
    if format == "json":
        return JSONResponse({"search": search.model_dump(mode="json"), "columns": columns, "rows": rows},
                            headers={"Content-Disposition": f'inline; filename="{name}.json"'})
    return csv_attachment(name, columns, ({k: "" if v is None else v for k, v in row.items()}
                                          for row in rows))


@router.post("/api/capacity/{search_id}/cancel", response_model=CapacityPublic, dependencies=ADMIN)
def cancel_capacity(search_id: str, engine: DB, scheduler: Sched) -> CapacityPublic:
    """Cancel a capacity search: it queues no more probes, and its unfinished runs are
    cancelled (a run being measured keeps what it measured); 409 once it has ended."""
    if not capacity.stop(engine, search_id, "cancelled by the user"):
        _, runs = capacity.get_search(engine, search_id)
        if all(r.status in FINISHED for r in runs):
            raise Conflict(f"capacity search {search_id} has already ended; nothing to cancel")
    # Once stopped it queues nothing more (``capacity.advance`` checks in its transaction),
    # so this read holds every run it will have.
    _, runs = capacity.get_search(engine, search_id)
    for run in runs:
        if run.status not in FINISHED:
            cancel_one(engine, scheduler, run.id, "cancelled by the user (its capacity search)")
    return capacity_view.capacity_public(engine, search_id)


@router.delete(
    "/api/capacity/{search_id}", status_code=204, dependencies=ADMIN,
    responses={204: {"description": "Deleted, with its runs, their samples and driver logs"},
               409: {"model": ErrorBody, "description": "It has not ended: cancel it first"}},
)
def delete_capacity(search_id: str, request: Request, engine: DB, scheduler: Sched) -> Response:
    """Delete an ended capacity search with its runs, their samples, server metrics,
    baseline marks and driver logs; 409 while it searches or a run of it has not finished
    (cancel it first)."""
    _, runs = capacity.get_search(engine, search_id)
    saving = [r.id for r in runs if r.status in FINISHED and scheduler.handling(r.id)]
    if saving:
        raise Conflict(f"run {saving[0]} of capacity search {search_id} has finished but is "
                       "still saving what it measured; delete the search in a moment")
    deleted = capacity.delete_search(engine, search_id)
    files = sum(len(logs.delete_run_files(request.app.state.settings.logs_dir, run_id))
                for run_id in deleted)
    log.info("capacity search %s deleted with %d runs and %d log files", search_id, len(deleted), files)
    return Response(status_code=204)
