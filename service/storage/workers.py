"""Reads and guarded writes of workers: the vLLM servers the service started or was told about."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from sqlalchemy import Engine, func, update
from sqlmodel import Session, col, select

from service.core import provenance
from service.core.ids import utcnow
from service.storage.db import write_session
from service.storage.tables import Run, Worker

# A worker's status moves only along these edges: a stopped, failed or removed worker
# never comes back (a late write from a probe or a run cannot revive it).
WORKER_SOURCES: dict[str, tuple[str, ...]] = {
    "ready": ("starting", "unavailable", "ready"),
    "unavailable": ("unavailable", "ready"),
    "stopped": ("starting", "ready"),
    "failed": ("starting", "ready", "unavailable"),
    "removed": ("unavailable", "ready"),
}
# Statuses of a worker that has ended: it serves nothing and never comes back.
ENDED = ("stopped", "failed", "removed")


def hash_token(token: str) -> str:
    """The stored form of a worker token."""
    return hashlib.sha256(token.encode()).hexdigest()


def add_worker(engine: Engine, worker: Worker) -> None:
    """Insert a worker row (a server being started, or one registered)."""
    with Session(engine, expire_on_commit=False) as session:
        session.add(worker)
        session.commit()


def update_worker(engine: Engine, worker_id: str, **fields: Any) -> bool:
    """Set fields of a worker in one UPDATE (no read first, so no lock upgrade to lose
    against another writer); a status change only along ``WORKER_SOURCES``. Returns
    whether the row changed."""
    query = update(Worker).where(col(Worker.id) == worker_id)
    if "status" in fields:
        query = query.where(col(Worker.status).in_(WORKER_SOURCES[fields["status"]]))
    with Session(engine) as session:
        result = session.exec(query.values(**fields))
        session.commit()
        return bool(result.rowcount == 1)


def take_back_registered(engine: Engine) -> list[Worker]:
    """On start: every registered server not removed, now ``unavailable`` until a probe passes."""
    with write_session(engine) as session:
        rows = list(session.exec(
            select(Worker).where(col(Worker.external).is_(True), Worker.status != "removed")
        ).all())
        for worker in rows:
            worker.status = "unavailable"
            worker.error = "service restarted; waiting for the server to answer /health"
            session.add(worker)
    return rows


def local_workers_alive(engine: Engine, backend: str = "local") -> list[Worker]:
    """Workers this service started on ``backend`` that its records say are starting or ready."""
    with Session(engine) as session:
        return list(session.exec(
            select(Worker).where(
                col(Worker.status).in_(("starting", "ready")), col(Worker.backend) == backend
            )
        ).all())


def get_worker(engine: Engine, worker_id: str) -> Worker | None:
    """One worker row, if it exists."""
    with Session(engine) as session:
        return session.get(Worker, worker_id)


def list_workers(engine: Engine) -> list[Worker]:
    """Every worker, newest first."""
    with Session(engine) as session:
        return list(session.exec(select(Worker).order_by(col(Worker.created_at).desc())).all())


def active_workers(engine: Engine) -> list[Worker]:
    """Workers that can take runs now or soon: started, starting, or registered and not removed."""
    with Session(engine) as session:
        return list(session.exec(
            select(Worker)
            .where(col(Worker.status).in_(("starting", "ready", "unavailable")))
            .order_by(col(Worker.created_at))
        ).all())


def workers_of_model(engine: Engine, model: str, limit: int) -> list[Worker]:
    """The newest workers of one model, newest first."""
    with Session(engine) as session:
        return list(session.exec(select(Worker).where(Worker.model == model)
                                 .order_by(col(Worker.created_at).desc()).limit(limit)).all())


def ended_workers(engine: Engine, limit: int, offset: int = 0) -> list[Worker]:
    """Servers this service started that ended (failed or stopped), the last to end first."""
    with Session(engine) as session:
        return list(session.exec(
            select(Worker).where(col(Worker.status).in_(("failed", "stopped")))
            .order_by(col(Worker.stopped_at).desc(), col(Worker.created_at).desc())
            .offset(offset).limit(limit)
        ).all())


def worker_counts(engine: Engine) -> dict[str, int]:
    """How many workers there are of each status."""
    with Session(engine) as session:
        rows = session.exec(select(Worker.status, func.count()).group_by(Worker.status)).all()
        return {status: int(n) for status, n in rows}


def worker_by_token(engine: Engine, token: str) -> Worker | None:
    """The worker a token was given to (looked up by its hash, compared in constant time)."""
    digest = hash_token(token)
    with Session(engine) as session:
        worker = session.exec(select(Worker).where(Worker.token_hash == digest)).first()
    if worker is None or not hmac.compare_digest(worker.token_hash, digest):
        return None
    return worker


def worker_facts(worker: Worker | None) -> dict[str, Any] | None:
    """What a run's provenance records of its worker."""
    if worker is None:
        return None
    return {"id": worker.id, "external": worker.external, "gpus": worker.gpus,
            "cpu_binding": worker.cpu_binding, "provenance": worker.provenance,
            "backend": worker.backend, "node": worker.node}


def record_worker_provenance(engine: Engine, worker_id: str, reported: dict[str, Any]) -> None:
    """Keep what a worker's connector reported of its server, added to what it reported
    before (its scheduler side and its worker side each send their part). Runs of this
    worker still in progress whose snapshot was taken before the report arrived get it now."""
    with write_session(engine) as session:
        worker = session.get(Worker, worker_id)
        if worker is None:
            return
        before = (worker.provenance or {}).get("reported") or {}
        worker.provenance = {**(worker.provenance or {}), "reported": {**before, **reported},
                             "reported_at": utcnow().isoformat()}
        session.add(worker)
        facts = worker_facts(worker)
        runs = session.exec(select(Run).where(
            Run.worker_id == worker_id, col(Run.status).in_(("starting", "running")))).all()
        for run in runs:
            old = run.provenance
            if old is None:
                continue
            fresh = provenance.snapshot(facts, run.spec, old.get("load_format", "auto"),
                                        old.get("kv_cache_tokens"), old.get("decodebench") or {})
            if {**old, **fresh} != old:  # keeps what was added since (``drivers``)
                run.provenance = {**old, **fresh}
                session.add(run)


def ended_log_paths(engine: Engine, skip: int) -> list[str]:
    """The log files of the servers this service started that ended (failed or stopped),
    but for the ``skip`` that ended last; the oldest last."""
    with Session(engine) as session:
        return [str(p) for p in session.exec(
            select(Worker.log_path)
            .where(col(Worker.status).in_(("failed", "stopped")), Worker.log_path != "")
            .order_by(col(Worker.stopped_at).desc(), col(Worker.created_at).desc())
            .offset(skip).limit(-1)
        ).all()]


def live_log_paths(engine: Engine) -> set[str]:
    """The log files of every worker that has not ended."""
    with Session(engine) as session:
        return {str(p) for p in session.exec(
            select(Worker.log_path).where(col(Worker.status).not_in(ENDED))).all()}
