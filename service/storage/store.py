"""Reads and guarded writes of runs and samples.

Every status change is one ``UPDATE ... WHERE id = ? AND status IN (...)``: it
either moves the run along an edge of the status machine or changes nothing,
so two writers (the API cancelling, the scheduler finishing) can never both win.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Protocol

from sqlalchemy import Engine, delete, func, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from service.control import provenance
from service.core.ids import new_id, utcnow
from service.core.sample import Sample
from service.core.spec import RunSpec, point_key
from service.core.status import FINISHED, RunStatus, sources_of
from service.core.sweep import SweepCreate
from service.storage.db import write_session
from service.storage.tables import Baseline, Run, SampleRow, ServerMetricPoint, Sweep, Worker
from service.web.errors import Conflict, Invalid, NotFound, shown
from service.web.schemas import RunPublic, SweepPublic

SAVE_SLICE = 500


def transition(engine: Engine, run_id: str, target: RunStatus, **fields: Any) -> bool:
    """Move a run to ``target`` if the status machine allows it from its current state."""
    values: dict[str, Any] = {"status": target.value, **fields}
    if target in FINISHED and "finished_at" not in values:
        values["finished_at"] = utcnow()
    sources = [s.value for s in sources_of(target)]
    with Session(engine) as session:
        result = session.exec(
            update(Run).where(col(Run.id) == run_id, col(Run.status).in_(sources)).values(**values)
        )
        session.commit()
        return bool(result.rowcount == 1)


def update_fields(engine: Engine, run_id: str, **fields: Any) -> None:
    """Set fields of a run that are not its status (progress, worker, summary)."""
    with Session(engine) as session:
        session.exec(update(Run).where(col(Run.id) == run_id).values(**fields))
        session.commit()


def _request_hash(spec: RunSpec) -> str:
    # Fields left at their defaults are left out, so a field added later with a default
    # does not make a retry of an older request look like another request.
    body = spec.model_dump(exclude_defaults=True)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _trial_runs(spec: RunSpec, sweep_id: str | None = None) -> list[Run]:
    """One queued run per trial of ``spec`` (one run when it has no repeats)."""
    group = new_id("g") if spec.repeats > 1 else None
    runs = []
    for k, trial in enumerate(spec.trials()):
        data = trial.model_dump()
        runs.append(Run(id=new_id("r"), spec=data, model=trial.model, total=trial.prompt_budget(),
                        sweep_id=sweep_id, group_id=group, trial=k if group else None,
                        point=point_key(data)))
    return runs


def _queue_in_order(runs: Sequence[Run]) -> None:
    # The scheduler takes queued runs by creation time: distinct, increasing times keep
    # the order they were made in (interleaved trials stay interleaved).
    now = utcnow()
    for i, run in enumerate(runs):
        run.created_at = now + timedelta(microseconds=i)


def create_run(engine: Engine, spec: RunSpec, idempotency_key: str | None = None) -> tuple[Run, bool]:
    """Insert a queued run (with ``repeats``, one per trial, in one group); with a key,
    return the existing (first) run for a repeated request.

    Returns the (first) run and whether it was created now.
    """
    digest = _request_hash(spec)
    for _ in range(2):
        try:
            with write_session(engine) as session:
                if idempotency_key is not None:
                    existing = session.exec(
                        select(Run).where(Run.idempotency_key == idempotency_key)
                    ).first()
                    if existing is not None:
                        if existing.request_hash != digest:
                            raise Invalid(
                                "Idempotency-Key was already used with a different request body"
                            )
                        return existing, False
                runs = _trial_runs(spec)
                _queue_in_order(runs)
                run = runs[0]
                run.idempotency_key = idempotency_key
                run.request_hash = digest
                session.add_all(runs)
                return run, True
        except IntegrityError:
            continue  # another request with this key won the race; read theirs
    raise Conflict("could not create the run; retry")


def get_run(engine: Engine, run_id: str) -> Run:
    """One run, or NotFound."""
    with Session(engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            raise NotFound(f"run {shown(run_id)} not found")
        return run


def arm_runs(engine: Engine, arm: str) -> list[Run]:
    """The trials of a group (``g-...``, in trial order), or the one run an id names;
    NotFound otherwise."""
    with Session(engine) as session:
        if arm.startswith("g-"):
            runs = list(session.exec(
                select(Run).where(Run.group_id == arm).order_by(col(Run.trial))).all())
            if not runs:
                raise NotFound(f"group {shown(arm)} not found")
            return runs
        run = session.get(Run, arm)
        if run is None:
            raise NotFound(f"run {shown(arm)} not found")
        return [run]


def runs_of_point(engine: Engine, point: str) -> list[Run]:
    """Every run of one point (``Run.point``), oldest first."""
    with Session(engine) as session:
        return list(session.exec(
            select(Run).where(Run.point == point).order_by(col(Run.created_at), col(Run.id))).all())


def list_runs(
    engine: Engine, status: str | None, model: str | None, limit: int, offset: int
) -> tuple[list[Run], int]:
    """A page of runs, newest first, and the total matching."""
    with Session(engine) as session:
        query = select(Run)
        count = select(func.count()).select_from(Run)
        if status is not None:
            query = query.where(Run.status == status)
            count = count.where(Run.status == status)
        if model is not None:
            query = query.where(Run.model == model)
            count = count.where(Run.model == model)
        query = query.order_by(col(Run.created_at).desc(), col(Run.id).desc())
        runs = list(session.exec(query.offset(offset).limit(limit)).all())
        total = session.exec(count).one()
        return runs, int(total)


def save_samples(engine: Engine, run_id: str, samples: Sequence[Sample]) -> None:
    """Store raw samples of a run. A sample is kept once: one already stored under its
    (run, index) is left as it is."""
    if not samples:
        return
    rows = [{"run_id": run_id, **asdict(s)} for s in samples]
    with Session(engine) as session:
        # In slices: SQLite caps the variables of one statement.
        for i in range(0, len(rows), SAVE_SLICE):
            session.exec(sqlite_insert(SampleRow).values(rows[i:i + SAVE_SLICE]).on_conflict_do_nothing())
        session.commit()


def count_worker_run(engine: Engine, worker_id: str) -> None:
    """Count one more run served by a worker."""
    with Session(engine) as session:
        session.exec(
            update(Worker).where(col(Worker.id) == worker_id).values(runs_served=col(Worker.runs_served) + 1)
        )
        session.commit()


def get_samples(engine: Engine, run_id: str) -> list[Sample]:
    """The stored samples of a run, by request index."""
    with Session(engine) as session:
        rows = session.exec(
            select(SampleRow).where(SampleRow.run_id == run_id).order_by(col(SampleRow.index))
        ).all()
        return [Sample(**row.model_dump(exclude={"id", "run_id"})) for row in rows]


def fail_interrupted(engine: Engine) -> int:
    """After a restart: runs left starting/running fail (never silently re-run)."""
    failed = 0
    for status in (RunStatus.starting, RunStatus.running):
        with Session(engine) as session:
            result = session.exec(
                update(Run)
                .where(col(Run.status) == status.value)
                .values(
                    status=RunStatus.failed.value,
                    finished_at=utcnow(),
                    error=f"the service stopped while this run was {status.value}; "
                    "it was not re-run",
                )
            )
            session.commit()
            failed += int(result.rowcount)
    return failed


def queued(engine: Engine, limit: int) -> list[Run]:
    """The oldest queued runs, oldest first."""
    with Session(engine) as session:
        return list(
            session.exec(
                select(Run)
                .where(Run.status == RunStatus.queued.value)
                .order_by(col(Run.created_at), col(Run.id))
                .limit(limit)
            ).all()
        )


def record_pull(engine: Engine, run_id: str) -> None:
    """Count one connector pull of a run's fill parameters."""
    with Session(engine) as session:
        session.exec(
            update(Run)
            .where(col(Run.id) == run_id)
            .values(connector_pulls=col(Run.connector_pulls) + 1)
        )
        session.commit()


def record_report(
    engine: Engine, worker_id: str, source: str, runs: dict[str, dict[str, float | str]]
) -> int:
    """Store a connector's cumulative counters for the runs this worker served; return how many."""
    stored = 0
    with write_session(engine) as session:
        for run_id, counters in runs.items():
            run = session.get(Run, run_id)
            if run is None or run.worker_id != worker_id:
                continue  # not this worker's run: ignored, never trusted
            report = dict(run.connector or {})
            ranks = dict(report.get("ranks", {}))
            ranks[source] = counters
            report["ranks"] = ranks
            # When each side last reported: the runner waits for reports newer than a run's end.
            report["reported_at"] = {**report.get("reported_at", {}), source: time.time()}
            run.connector = report
            session.add(run)
            stored += 1
    return stored


def create_sweep(engine: Engine, body: SweepCreate) -> Sweep:
    """Insert a sweep and one queued run per grid point, all or nothing."""
    try:
        points = body.points()
    except ValueError as exc:
        raise Invalid(str(exc)) from exc
    sweep = Sweep(id=new_id("s"), base=body.base.model_dump(), grid=body.grid.axes())
    per_point = [_trial_runs(spec, sweep.id) for _, spec in points]
    # Trial by trial across the points (A B C A B C): drift over time spreads over every
    # point instead of landing on one.
    runs = [trials[k] for k in range(body.base.repeats) for trials in per_point]
    _queue_in_order(runs)
    with write_session(engine) as session:
        session.add(sweep)
        session.add_all(runs)
    return sweep


def get_sweep(engine: Engine, sweep_id: str) -> tuple[Sweep, list[Run]]:
    """A sweep and its runs, in grid order; or NotFound."""
    with Session(engine) as session:
        sweep = session.get(Sweep, sweep_id)
        if sweep is None:
            raise NotFound(f"sweep {shown(sweep_id)} not found")
        runs = session.exec(
            select(Run).where(Run.sweep_id == sweep_id).order_by(col(Run.created_at), col(Run.id))
        ).all()
        return sweep, list(runs)


def hash_token(token: str) -> str:
    """The stored form of a worker token."""
    return hashlib.sha256(token.encode()).hexdigest()


# A worker's status moves only along these edges: a stopped, failed or removed worker
# never comes back (a late write from a probe or a run cannot revive it).
WORKER_SOURCES: dict[str, tuple[str, ...]] = {
    "ready": ("starting", "unavailable", "ready"),
    "unavailable": ("unavailable", "ready"),
    "stopped": ("starting", "ready"),
    "failed": ("starting", "ready", "unavailable"),
    "removed": ("unavailable", "ready"),
}


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


def local_workers_alive(engine: Engine) -> list[Worker]:
    """Workers this service started that its records say are starting or ready."""
    with Session(engine) as session:
        return list(session.exec(
            select(Worker).where(
                col(Worker.status).in_(("starting", "ready")), col(Worker.external).is_(False)
            )
        ).all())


def get_worker(engine: Engine, worker_id: str) -> Worker | None:
    """One worker row, if it exists."""
    with Session(engine) as session:
        return session.get(Worker, worker_id)


def active_workers(engine: Engine) -> list[Worker]:
    """Workers that can take runs now or soon: started, starting, or registered and not removed."""
    with Session(engine) as session:
        return list(session.exec(
            select(Worker)
            .where(col(Worker.status).in_(("starting", "ready", "unavailable")))
            .order_by(col(Worker.created_at))
        ).all())


def list_sweeps(engine: Engine, limit: int) -> list[tuple[Sweep, dict[str, int]]]:
    """The newest sweeps with counts of their runs by status."""
    with Session(engine) as session:
        sweeps = session.exec(
            select(Sweep).order_by(col(Sweep.created_at).desc()).limit(limit)
        ).all()
        out = []
        for sweep in sweeps:
            rows = session.exec(
                select(Run.status, func.count()).where(Run.sweep_id == sweep.id).group_by(Run.status)
            ).all()
            counts = {status: int(n) for status, n in rows}
            counts["total"] = sum(counts.values())
            out.append((sweep, counts))
        return out


def sweep_page(engine: Engine, limit: int, offset: int) -> tuple[list[tuple[Sweep, dict[str, int]]], int]:
    """A page of sweeps, newest first, each with the counts of its runs by status; and how
    many sweeps there are."""
    with Session(engine) as session:
        sweeps = list(session.exec(
            select(Sweep).order_by(col(Sweep.created_at).desc(), col(Sweep.id).desc())
            .offset(offset).limit(limit)
        ).all())
        counts: dict[str, dict[str, int]] = {sweep.id: {} for sweep in sweeps}
        if sweeps:
            rows = session.exec(
                select(Run.sweep_id, Run.status, func.count())
                .where(col(Run.sweep_id).in_(list(counts))).group_by(Run.sweep_id, Run.status)
            ).all()
            for sweep_id, status, n in rows:
                counts[str(sweep_id)][status] = int(n)
        total = session.exec(select(func.count()).select_from(Sweep)).one()
        return [(sweep, counts[sweep.id]) for sweep in sweeps], int(total)


def delete_run(engine: Engine, run_id: str) -> None:
    """Delete a finished run with everything stored for it: its samples, server metric
    points and the baseline it is (a group's baseline goes with the group's last run).
    NotFound for an unknown run, Conflict while it is not finished."""
    with write_session(engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            raise NotFound(f"run {shown(run_id)} not found")
        if run.status not in FINISHED:
            raise Conflict(f"run {run_id} is {run.status}: cancel it first "
                           f"(POST /api/runs/{run_id}/cancel), then delete it")
        arms = [run_id]
        if run.group_id is not None:
            others = session.exec(
                select(func.count()).select_from(Run).where(Run.group_id == run.group_id, Run.id != run_id)
            ).one()
            if not others:
                arms.append(run.group_id)
        session.exec(delete(SampleRow).where(col(SampleRow.run_id) == run_id))
        session.exec(delete(ServerMetricPoint).where(col(ServerMetricPoint.run_id) == run_id))
        session.exec(delete(Baseline).where(col(Baseline.arm).in_(arms)))
        session.exec(delete(Run).where(col(Run.id) == run_id))


def _worker_facts(worker: Worker | None) -> dict[str, Any] | None:
    if worker is None:
        return None
    return {"id": worker.id, "external": worker.external, "gpus": worker.gpus,
            "cpu_binding": worker.cpu_binding, "provenance": worker.provenance}


def snapshot_provenance(engine: Engine, run_id: str, worker_id: str, load_format: str,
                        kv_tokens: int | None, facts: Mapping[str, Any]) -> dict[str, Any] | None:
    """Record on a run the provenance of its worker as it stands, with the service's facts
    and the run's own (``service.control.provenance.snapshot``); returns it."""
    with write_session(engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            return None
        worker = _worker_facts(session.get(Worker, worker_id))
        run.provenance = provenance.snapshot(worker, run.spec, load_format, kv_tokens, facts)
        session.add(run)
        return run.provenance


def record_worker_provenance(engine: Engine, worker_id: str, reported: dict[str, Any]) -> None:
    """Keep what a worker's connector reported of its server. Runs of this worker still in
    progress whose snapshot was taken before the report arrived get it now."""
    with write_session(engine) as session:
        worker = session.get(Worker, worker_id)
        if worker is None:
            return
        worker.provenance = {**(worker.provenance or {}), "reported": reported,
                             "reported_at": utcnow().isoformat()}
        session.add(worker)
        facts = _worker_facts(worker)
        runs = session.exec(select(Run).where(
            Run.worker_id == worker_id, col(Run.status).in_(("starting", "running")))).all()
        for run in runs:
            old = run.provenance
            if old is None or old.get("reported"):
                continue
            run.provenance = provenance.snapshot(facts, run.spec, old.get("load_format", "auto"),
                                                 old.get("kv_cache_tokens"), old.get("decodebench") or {})
            session.add(run)


def worker_by_token(engine: Engine, token: str) -> Worker | None:
    """The worker a token was given to (looked up by its hash, compared in constant time)."""
    digest = hash_token(token)
    with Session(engine) as session:
        worker = session.exec(select(Worker).where(Worker.token_hash == digest)).first()
    if worker is None or not hmac.compare_digest(worker.token_hash, digest):
        return None
    return worker


def sweep_public(engine: Engine, sweep_id: str,
                 loaded: tuple[Sweep, list[Run]] | None = None) -> SweepPublic:
    """A sweep with its runs and how far they got (``loaded``: what ``get_sweep`` gave)."""
    sweep, runs = loaded or get_sweep(engine, sweep_id)
    progress = {status.value: 0 for status in RunStatus}
    for run in runs:
        progress[run.status] += 1
    progress["total"] = len(runs)
    progress["finished"] = sum(progress[s.value] for s in FINISHED)
    progress["infeasible"] = sum(bool(r.error and r.error.startswith("infeasible")) for r in runs)
    return SweepPublic(id=sweep.id, base=sweep.base, grid=sweep.grid, created_at=sweep.created_at,
                       progress=progress, runs=[RunPublic.of(r) for r in runs],
                       repeats=int(sweep.base.get("repeats", 1)))


# --- server metrics: scrapes of a run's vLLM /metrics ---------------------------------------


class _ScrapedPoint(Protocol):
    @property
    def t(self) -> float: ...

    @property
    def values(self) -> Mapping[str, float]: ...


ScrapedPoint = _ScrapedPoint | tuple[float, Mapping[str, float]]


def save_server_points(engine: Engine, run_id: str, points: Sequence[ScrapedPoint]) -> None:
    """Store scrapes of a run's server, as ``(t, values)`` pairs or objects with ``t`` and
    ``values``. A point already stored at its (run, t) is kept once."""
    rows = []
    for point in points:
        t, values = point if isinstance(point, tuple) else (point.t, point.values)
        rows.append({"run_id": run_id, "t": float(t), "values": dict(values)})
    if not rows:
        return
    with Session(engine) as session:
        for i in range(0, len(rows), SAVE_SLICE):
            session.exec(
                sqlite_insert(ServerMetricPoint).values(rows[i:i + SAVE_SLICE]).on_conflict_do_nothing()
            )
        session.commit()


def server_points(engine: Engine, run_id: str) -> list[dict[str, Any]]:
    """A run's stored scrapes, oldest first: ``{"t", "values"}`` each."""
    with Session(engine) as session:
        rows = session.exec(
            select(ServerMetricPoint)
            .where(ServerMetricPoint.run_id == run_id)
            .order_by(col(ServerMetricPoint.t))
        ).all()
        return [{"t": r.t, "values": r.values} for r in rows]
