"""What the connector inside a worker asks of the service and tells it (worker token only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response
from pydantic import ValidationError

from service.core.errors import Conflict, NotFound, shown
from service.core.protocol import ConnectorReport, FillAnswer, WorkerProvenance
from service.core.spec import RunSpec, describe
from service.storage import steps, store, workers
from service.storage.tables import Run, Worker
from service.web.auth import require_worker
from service.web.deps import DB, Sched
from service.web.errors import ERROR_RESPONSES

router = APIRouter(responses=ERROR_RESPONSES)


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
    """Cumulative fill counters from a worker's connector, per run it served, and the engine
    steps it timed since its last report; each run's runner hears of it."""
    store.record_report(engine, worker.id, f"{report.role}:{report.rank}", report.counters())
    if report.steps:
        steps.record_steps(engine, worker.id, report.step_rows())
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
    settings, KV cache, hardware, command line, the decode roofline's facts; every run on it
    records this. A report with some fields (one connector side's part) adds to the others."""
    workers.record_worker_provenance(engine, worker.id, report.model_dump(exclude_unset=True))
    return Response(status_code=204)
