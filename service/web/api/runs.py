"""Runs: submit, list, read, cancel and delete them; their samples a page at a time and the
scrapes of their server."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy import Engine

from service.analysis import server_metrics
from service.analysis.metrics import decode_stats
from service.core.errors import Conflict
from service.core.ids import utcnow
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.core.status import FINISHED, RunStatus
from service.storage import logs, measurements, store
from service.web.admission import check_backend, check_fits, check_model, check_size
from service.web.cancelling import cancel_one
from service.web.deps import ADMIN, DB, READ, Sched
from service.web.errors import ERROR_RESPONSES, ErrorBody
from service.web.schemas import (
    RunList,
    RunLive,
    RunPublic,
    ServerMetricsPublic,
    ServerMetricsSummary,
    ServerPointPublic,
)
from service.web.starting import starting_view
from service.web.vllm_export import server_points

log = logging.getLogger(__name__)

router = APIRouter(responses=ERROR_RESPONSES)

# Samples per page of ``GET /api/runs/{id}/requests``: each holds its gaps and its text.
REQUESTS_PAGE = 100
REQUESTS_PAGE_MAX = 1000


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
    check_model(request, engine, spec.model)
    check_fits(request, engine, [spec])
    check_backend(request, spec)
    check_size(request, spec)
    run, created = store.create_run(engine, spec, idempotency_key)
    if created:
        log.info("run %s queued: %s, ISL %d, OSL %d, %d prompts, concurrency %s, mode %s%s", run.id,
                 spec.model, spec.input_len, spec.output_len, spec.num_prompts, spec.max_concurrency,
                 spec.mode, f" ({spec.repeats} trials, group {run.group_id})" if run.group_id else "")
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


@router.get("/api/runs/{run_id}", response_model=RunPublic, dependencies=READ)
def get_run(run_id: str, engine: DB) -> RunPublic:
    """One run: spec, status, progress, summary, error."""
    return RunPublic.of(store.get_run(engine, run_id))


@router.delete(
    "/api/runs/{run_id}", status_code=204, dependencies=ADMIN,
    responses={204: {"description": "Deleted, with its samples and driver logs"},
               409: {"model": ErrorBody, "description": "The run has not finished (cancel it first), "
                                                        "or its capacity search is still searching"}},
)
def delete_run(run_id: str, request: Request, engine: DB, scheduler: Sched) -> Response:
    """Delete a finished run with its samples, server metrics, baseline mark and driver
    logs; 409 while it is queued, starting or running (cancel it first), or while the
    capacity search it is a probe of is still searching (cancel the search first)."""
    run = store.get_run(engine, run_id)
    store.refuse_probe_of_active_search(engine, run)
    if run.status in FINISHED and scheduler.handling(run_id):
        raise Conflict(f"run {run_id} is {run.status} but still saving what it measured; "
                       "delete it in a moment")
    store.delete_run(engine, run_id)
    removed = logs.delete_run_files(request.app.state.settings.logs_dir, run_id)
    log.info("run %s deleted with %d log files", run_id, len(removed))
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
        if run.status in FINISHED:
            raise Conflict(f"run {run_id} already finished ({run.status}); nothing to cancel")
        raise Conflict(f"run {run_id} could not be cancelled: it is {run.status} and its runner is "
                       "still writing its end; try again in a few seconds")
    return RunPublic.of(store.get_run(engine, run.id))


# The decode figures of finished runs without a summary (cancelled, failed), by (run,
# requests done): computed once from the stored samples. A few runs at a time.
_ENDED: OrderedDict[str, tuple[int, Any, Any]] = OrderedDict()
_ENDED_LOCK = threading.Lock()
ENDED_KEPT = 64


def _ended_decode(engine: Engine, run_id: str, done: int) -> tuple[Any, Any]:
    """(decode median ITL ms, steady gaps) of a finished run's stored samples, computed
    once per run."""
    with _ENDED_LOCK:
        cached = _ENDED.get(run_id)
    if cached is not None and cached[0] == done:
        return cached[1], cached[2]
    samples = [s for found in measurements.sample_slices(engine, run_id) for s in found]
    decode = decode_stats(samples) if any(s.success for s in samples) else {}
    value = (done, decode.get("decode_median_itl_ms"), decode.get("decode_gaps"))
    with _ENDED_LOCK:
        _ENDED[run_id] = value
        _ENDED.move_to_end(run_id)
        while len(_ENDED) > ENDED_KEPT:
            _ENDED.popitem(last=False)
    return value[1], value[2]


@router.get("/api/runs/{run_id}/live", response_model=RunLive, dependencies=READ)
def get_live(run_id: str, engine: DB, scheduler: Sched) -> RunLive:
    """How a run is going, for a progress display: requests done of total, seconds since it
    started, an estimate of the seconds left, and the decode median ITL of the requests
    saved so far (the steady decode window over them, as the summary takes it; while the
    run is measured, its runner's running figure, within 0.1%)."""
    run = store.get_run(engine, run_id)
    done = run.completed + run.failed
    elapsed = None
    if run.started_at is not None:
        elapsed = ((run.finished_at or utcnow()) - run.started_at).total_seconds()
    eta = None
    if elapsed is not None and run.status not in FINISHED and 0 < done < run.total:
        eta = elapsed / done * (run.total - done)
    itl: Any = None
    gaps: Any = 0
    if run.summary is not None:
        itl, gaps = run.summary.get("decode_median_itl_ms"), run.summary.get("decode_gaps")
    elif run.status in FINISHED:
        itl, gaps = _ended_decode(engine, run_id, done)
    elif (running := scheduler.decode_so_far(run_id)) is not None:
        # Polled every half second during a run: never a read of all its samples.
        itl, gaps = running
    return RunLive(id=run.id, status=run.status, completed=run.completed, failed=run.failed,
                   total=run.total, elapsed_s=elapsed, eta_s=eta,
                   decode_median_itl_ms=itl if gaps else None, decode_gaps=int(gaps or 0),
                   error=run.error, waiting=(starting_view(engine, run, scheduler.fleet.server_of(run_id))
                                             or {}).get("waiting"))


@router.get(
    "/api/runs/{run_id}/requests", response_model=list[Sample], dependencies=READ,
    responses={200: {"description": "One page of samples, by request index", "headers": {
        "X-Total-Count": {"description": "How many samples the run has", "schema": {"type": "integer"}},
        "Link": {"description": 'The next page, as `<url>; rel="next"`, while there is one',
                 "schema": {"type": "string"}},
    }}},
)
def get_requests(
    run_id: str,
    request: Request,
    response: Response,
    engine: DB,
    limit: Annotated[int, Query(ge=1, le=REQUESTS_PAGE_MAX)] = REQUESTS_PAGE,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> list[Sample]:
    """Raw per-request samples of a run (seconds, client clock), a page at a time by request
    index: ``limit`` (100, at most 1000) from ``offset``. ``X-Total-Count`` says how many
    there are; ``Link`` names the next page while there is one."""
    store.get_run(engine, run_id)
    total = measurements.count_samples(engine, run_id)
    page = measurements.sample_page(engine, run_id, limit, offset)
    response.headers["X-Total-Count"] = str(total)
    if offset + len(page) < total:
        after = request.url.include_query_params(limit=limit, offset=offset + len(page))
        response.headers["Link"] = f'<{after.path}?{after.query}>; rel="next"'
    return page


@router.get("/api/runs/{run_id}/server-metrics", response_model=ServerMetricsPublic, dependencies=READ)
def get_server_metrics(run_id: str, engine: DB) -> ServerMetricsPublic:
    """What the run's vLLM server reported on its /metrics during the run (t: seconds since
    the first scrape), with counter deltas and gauge max/mean."""
    store.get_run(engine, run_id)
    points = server_points(engine, run_id)
    origin = points[0].t if points else 0.0
    return ServerMetricsPublic(
        run_id=run_id,
        points=[ServerPointPublic(t=p.t - origin, values=p.values) for p in points],
        summary=ServerMetricsSummary(**server_metrics.summarize(points)),
    )
