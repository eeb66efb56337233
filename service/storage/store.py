"""Reads and guarded writes of runs (samples: ``measurements``; workers, sweeps and
baselines have their own modules).

Every status change is one ``UPDATE ... WHERE id = ? AND status IN (...)``: it
either moves the run along an edge of the status machine or changes nothing,
so two writers (the API cancelling, the scheduler finishing) can never both win.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, and_, func, or_, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from service.core import provenance
from service.core.errors import Conflict, Invalid, NotFound, shown
from service.core.ids import new_id, utcnow
from service.core.sample import Sample
from service.core.spec import RunSpec, point_key
from service.core.status import FINISHED, RunStatus, sources_of
from service.storage.cascade import delete_runs
from service.storage.db import write_session
from service.storage.measurements import SAVE_SLICE
from service.storage.tables import CapacitySearch, Run, SampleRow, Worker
from service.storage.workers import worker_facts

# A capacity search still searching (``service.storage.capacity.ACTIVE``, which imports this module).
SEARCH_ACTIVE = "active"


def transition(engine: Engine, run_id: str, target: RunStatus, **fields: Any) -> bool:
    """Move a run to ``target`` if the status machine allows it from its current state."""
    return _move(engine, run_id, target, sources_of(target), fields)


def cancel_queued(engine: Engine, run_id: str, error: str) -> bool:
    """Cancel a run nobody has placed: the guarded move from ``queued`` only. A run placed
    meanwhile is its runner's to end (moved on behind it, the runner could still start a
    server for a cancelled run)."""
    return _move(engine, run_id, RunStatus.cancelled, {RunStatus.queued}, {"error": error})


def cancel_orphaned(engine: Engine, run_id: str, error: str) -> bool:
    """Cancel a run left ``starting`` or ``running`` by a runner that has ended (its end
    write failed every try, and so did the write that fails it after): the guarded move from
    those two. Only for a run no runner handles (``Scheduler.handling``)."""
    return _move(engine, run_id, RunStatus.cancelled, {RunStatus.starting, RunStatus.running},
                 {"error": error})


def fail_queued(engine: Engine, run_id: str, error: str) -> bool:
    """Fail a queued run the scheduler cannot place (its stored spec no longer validates, no
    server of this service could take it): the guarded move from ``queued`` only, in one
    write. No runner ever had it, so it never passes through ``starting``; a run cancelled or
    placed meanwhile is left as it is (False)."""
    return _move(engine, run_id, RunStatus.failed, {RunStatus.queued}, {"error": error})


def _move(engine: Engine, run_id: str, target: RunStatus, allowed: Collection[RunStatus],
          fields: dict[str, Any]) -> bool:
    values: dict[str, Any] = {"status": target.value, **fields}
    if target in FINISHED and "finished_at" not in values:
        values["finished_at"] = utcnow()
    sources = [s.value for s in allowed]
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


def trial_runs(spec: RunSpec, sweep_id: str | None = None) -> list[Run]:
    """Queued runs, not yet stored: one per trial of ``spec`` (one run when it has no repeats)."""
    group = new_id("g") if spec.repeats > 1 else None
    runs = []
    for k, trial in enumerate(spec.trials()):
        data = trial.model_dump()
        runs.append(Run(id=new_id("r"), spec=data, model=trial.model, total=trial.prompt_budget(),
                        sweep_id=sweep_id, group_id=group, trial=k if group else None,
                        point=point_key(data)))
    return runs


def status_counts(session: Session, owner: Any, ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """Runs per status of each owner in ``ids`` (``owner``: the run column naming it, such as
    ``Run.sweep_id``), in one query; every id present, an owner with no runs empty."""
    counts: dict[str, dict[str, int]] = {i: {} for i in ids}
    if ids:
        rows = session.exec(
            select(owner, Run.status, func.count())
            .where(col(owner).in_(list(ids))).group_by(owner, Run.status)
        ).all()
        for owner_id, status, n in rows:
            counts[str(owner_id)][status] = int(n)
    return counts


def queue_in_order(runs: Sequence[Run]) -> None:
    """Give runs about to be stored creation times that keep their order in the queue."""
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
                runs = trial_runs(spec)
                queue_in_order(runs)
                run = runs[0]
                run.idempotency_key = idempotency_key
                run.request_hash = digest
                session.add_all(runs)
                return run, True
        except IntegrityError:
            continue  # another request with this key won the race; read theirs
    raise Conflict("could not create the run; retry")


def create_imported(engine: Engine, spec: dict[str, Any], summary: dict[str, Any],
                    samples: Sequence[Sample], **fields: Any) -> Run:
    """Insert a run measured elsewhere (status ``imported``, never queued) with its samples,
    all or nothing; ``fields``: its times, provenance and counts."""
    run = Run(id=new_id("r"), spec=spec, model=spec["model"], status=RunStatus.imported.value,
              summary=summary, point=point_key(spec), total=len(samples) or int(spec["num_prompts"]),
              **fields)
    with write_session(engine) as session:
        session.add(run)
        session.flush()
        rows = [{"run_id": run.id, **s.as_dict()} for s in samples]
        for i in range(0, len(rows), SAVE_SLICE):
            session.exec(sqlite_insert(SampleRow).values(rows[i:i + SAVE_SLICE]))
    return run


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


def queued(engine: Engine, limit: int, after: Run | None = None) -> list[Run]:
    """The oldest queued runs, oldest first; with ``after``, those queued after that run."""
    query = select(Run).where(Run.status == RunStatus.queued.value)
    if after is not None:
        query = query.where(or_(col(Run.created_at) > after.created_at,
                                and_(col(Run.created_at) == after.created_at, col(Run.id) > after.id)))
    with Session(engine) as session:
        return list(session.exec(query.order_by(col(Run.created_at), col(Run.id)).limit(limit)).all())


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
    engine: Engine, worker_id: str, source: str, runs: dict[str, dict[str, Any]]
) -> int:
    """Store a connector's cumulative counters for the runs this worker served; return how
    many changed (counters a side sent before, unchanged, are not written again)."""
    stored = 0
    with write_session(engine) as session:
        for run_id, counters in runs.items():
            run = session.get(Run, run_id)
            if run is None or run.worker_id != worker_id:
                continue  # not this worker's run: ignored, never trusted
            report = dict(run.connector or {})
            ranks = dict(report.get("ranks", {}))
            if ranks.get(source) == counters:
                continue
            ranks[source] = counters
            report["ranks"] = ranks
            # When each side last reported: the runner waits for reports newer than a run's end.
            report["reported_at"] = {**report.get("reported_at", {}), source: time.time()}
            run.connector = report
            session.add(run)
            stored += 1
    return stored


def _refuse_probe_of_active_search(session: Session, run: Run) -> None:
    search = session.get(CapacitySearch, run.capacity_id) if run.capacity_id is not None else None
    if search is not None and search.status == SEARCH_ACTIVE:
        raise Conflict(f"run {run.id} is a probe of capacity search {search.id}, which is still "
                       f"searching: its looks read every run it has. Cancel the search first "
                       f"(POST /api/capacity/{search.id}/cancel), or delete the whole search once "
                       "it has ended")


def refuse_probe_of_active_search(engine: Engine, run: Run) -> None:
    """Conflict when ``run`` is a probe of a capacity search still searching: the lasting
    reason a delete is refused, told before a passing one (a save still in progress)."""
    with Session(engine) as session:
        _refuse_probe_of_active_search(session, run)


def delete_run(engine: Engine, run_id: str) -> None:
    """Delete a finished run with everything stored for it: its samples, server metric
    points and the baseline it is (a group's baseline goes with the group's last run).
    NotFound for an unknown run, Conflict while it is not finished or while the capacity
    search it is a probe of is still searching (its looks read every run it has)."""
    with write_session(engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            raise NotFound(f"run {shown(run_id)} not found")
        if run.status not in FINISHED:
            raise Conflict(f"run {run_id} is {run.status}: cancel it first "
                           f"(POST /api/runs/{run_id}/cancel), then delete it")
        _refuse_probe_of_active_search(session, run)
        arms = [run_id]
        if run.group_id is not None:
            others = session.exec(
                select(func.count()).select_from(Run).where(Run.group_id == run.group_id, Run.id != run_id)
            ).one()
            if not others:
                arms.append(run.group_id)
        delete_runs(session, [run_id], arms)


def snapshot_provenance(engine: Engine, run_id: str, worker_id: str, load_format: str,
                        kv_tokens: int | None, facts: Mapping[str, Any]) -> dict[str, Any] | None:
    """Record on a run the provenance of its worker as it stands, with the service's facts
    and the run's own (``service.core.provenance.snapshot``); returns it."""
    with write_session(engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            return None
        worker = worker_facts(session.get(Worker, worker_id))
        run.provenance = provenance.snapshot(worker, run.spec, load_format, kv_tokens, facts)
        session.add(run)
        return run.provenance


def begin_measuring(engine: Engine, run_id: str, worker_id: str, cpu_binding: dict[str, Any] | None,
                    load_format: str, kv_tokens: int | None, facts: Mapping[str, Any], *,
                    go: bool) -> bool:
    """A placed run is about to send its first request, in one transaction: the run records
    the server (``worker_id``: the connector's pull is only answered for a run assigned to
    the asking worker) and its provenance (see ``snapshot_provenance``); with ``go``, it
    moves to ``running`` (guarded) now, and its server counts one more run served. True if
    it did."""
    with write_session(engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            return False
        run.worker_id = worker_id
        run.cpu_binding = cpu_binding
        worker = worker_facts(session.get(Worker, worker_id))
        run.provenance = provenance.snapshot(worker, run.spec, load_format, kv_tokens, facts)
        session.add(run)
        session.flush()
        if not go:
            return False
        sources = [s.value for s in sources_of(RunStatus.running)]
        result = session.exec(
            update(Run).where(col(Run.id) == run_id, col(Run.status).in_(sources))
            .values(status=RunStatus.running.value, started_at=utcnow())
        )
        if result.rowcount != 1:
            return False  # cancelled meanwhile: it never ran
        session.exec(update(Worker).where(col(Worker.id) == worker_id)
                     .values(runs_served=col(Worker.runs_served) + 1))
        return True


def record_drivers(engine: Engine, run_id: str, placement: list[dict[str, Any]]) -> None:
    """Record on a run's provenance where its driver shards ran (``drivers``: shard, node,
    and on a cluster each host's clock offset to the service with its uncertainty)."""
    with write_session(engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            return
        run.provenance = {**(run.provenance or {}), "drivers": placement}
        session.add(run)


def run_counts(engine: Engine) -> dict[str, int]:
    """How many runs there are of each status."""
    with Session(engine) as session:
        rows = session.exec(select(Run.status, func.count()).group_by(Run.status)).all()
        return {status: int(n) for status, n in rows}


def connector_pulls(engine: Engine) -> int:
    """Fill parameter pulls served to connectors, over every stored run."""
    with Session(engine) as session:
        return int(session.exec(select(func.coalesce(func.sum(Run.connector_pulls), 0))).one())
