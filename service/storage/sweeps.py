"""Reads and writes of sweeps: a grid of runs over one base spec."""

from __future__ import annotations

from sqlalchemy import Engine, delete, func
from sqlmodel import Session, col, select

from service.core.errors import Conflict, Invalid, NotFound, shown
from service.core.ids import new_id
from service.core.status import FINISHED
from service.core.sweep import SweepCreate
from service.storage.db import write_session
from service.storage.store import queue_in_order, trial_runs
from service.storage.tables import Baseline, Run, SampleRow, ServerMetricPoint, Sweep


def create_sweep(engine: Engine, body: SweepCreate) -> Sweep:
    """Insert a sweep and one queued run per grid point, all or nothing."""
    try:
        points = body.points()
    except ValueError as exc:
        raise Invalid(str(exc)) from exc
    sweep = Sweep(id=new_id("s"), base=body.base.model_dump(), grid=body.grid.axes())
    per_point = [trial_runs(spec, sweep.id) for _, spec in points]
    # Trial by trial across the points (A B C A B C): drift over time spreads over every
    # point instead of landing on one.
    runs = [trials[k] for k in range(body.base.repeats) for trials in per_point]
    queue_in_order(runs)
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


def delete_sweep(engine: Engine, sweep_id: str) -> list[str]:
    """Delete a sweep whose runs have all finished, with its runs and everything stored for
    them (samples, server metric points, the baselines its runs and groups are), all or
    nothing; the ids of the deleted runs. NotFound for an unknown sweep, Conflict while a
    run of it has not finished."""
    with write_session(engine) as session:
        if session.get(Sweep, sweep_id) is None:
            raise NotFound(f"sweep {shown(sweep_id)} not found")
        runs = list(session.exec(select(Run).where(Run.sweep_id == sweep_id)).all())
        active = [r for r in runs if r.status not in FINISHED]
        if active:
            raise Conflict(f"sweep {sweep_id} has {len(active)} runs not finished "
                           f"(e.g. {active[0].id}, {active[0].status}): cancel it first "
                           f"(POST /api/sweeps/{sweep_id}/cancel), then delete it")
        ids = [r.id for r in runs]
        arms = ids + sorted({r.group_id for r in runs if r.group_id})
        session.exec(delete(SampleRow).where(col(SampleRow.run_id).in_(ids)))
        session.exec(delete(ServerMetricPoint).where(col(ServerMetricPoint.run_id).in_(ids)))
        session.exec(delete(Baseline).where(col(Baseline.arm).in_(arms)))
        session.exec(delete(Run).where(col(Run.id).in_(ids)))
        session.exec(delete(Sweep).where(col(Sweep.id) == sweep_id))
        return ids
