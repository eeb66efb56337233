"""A run waiting for its vLLM server to start, as the run page, ``/live`` and the command
line say it: which server, for how long, and what its log says it is doing."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Engine

from service.control.startup_errors import clock, startup_phase
from service.core.spec import EngineSpec, worker_key
from service.core.status import RunStatus
from service.storage import workers
from service.storage.logs import log_tail
from service.storage.tables import Run


def aware(value: datetime) -> datetime:
    # SQLite hands datetimes back without their zone; every stored one is UTC.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (aware(end) - aware(start)).total_seconds()


# The lines of a starting server's log read for its phase (its last ones: cheap).
PHASE_LINES = 400
LOG_LINE_CHARS = 400


def starting_view(engine: Engine, run: Run, server_id: str | None = None) -> dict[str, Any] | None:
    """While a run is ``starting``: the server being started for it (``server_id``, the one
    the fleet started for this run; else the first of its model and engine starting), how
    long that has taken against the last start of the same model (and engine, where one is
    known), and the last line of its log."""
    if run.status != RunStatus.starting.value:
        return None
    try:
        key: str | None = worker_key(run.model, EngineSpec.model_validate(run.spec.get("engine", {})))
    except ValidationError:
        key = None
    found = workers.workers_of_model(engine, run.model, 100)
    # Two runs of one model can each start a server of it: the run's own one, where known.
    current = next((w for w in found if w.status == "starting" and w.id == server_id), None) or next(
        (w for w in found if w.status == "starting" and (key is None or w.key == key)),
        next((w for w in found if w.status == "starting"), None))
    if current is None:
        return {"worker": None, "waiting": "waiting for a vLLM server (another run holds the one it needs, "
                                           "or it is being stopped to make room)"}
    earlier = [w for w in found if w.ready_at is not None and not w.external
               and aware(w.created_at) < aware(current.created_at)]
    last = next((w for w in earlier if w.key == current.key), earlier[0] if earlier else None)
    tail = log_tail(Path(current.log_path), PHASE_LINES) if current.backend == "local" else ""
    line = tail.rsplit("\n", 1)[-1]
    elapsed = between(current.created_at, datetime.now(UTC))
    phase = startup_phase(tail.splitlines())
    return {
        "worker": current,
        "elapsed_s": elapsed,
        "phase": phase,
        "waiting": f"starting vLLM server {current.id}: {clock(elapsed or 0.0)}"
                   + (f", {phase}" if phase else ""),
        "last_start_s": between(last.created_at, last.ready_at) if last else None,
        "last_same_engine": last is not None and last.key == current.key,
        "last_line": line if len(line) <= LOG_LINE_CHARS else line[:LOG_LINE_CHARS - 1] + "…",
    }
