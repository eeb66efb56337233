"""Reads and writes of baselines: per point, the run or group later runs are compared against."""

from __future__ import annotations

from sqlalchemy import Engine
from sqlmodel import Session, col, select

from service.core.ids import utcnow
from service.storage.db import write_session
from service.storage.tables import Baseline


def list_baselines(engine: Engine) -> list[Baseline]:
    """Every baseline, newest first."""
    with Session(engine) as session:
        return list(session.exec(select(Baseline).order_by(col(Baseline.created_at).desc())).all())


def baseline_of(engine: Engine, point: str) -> Baseline | None:
    """The baseline of a point, if one is marked."""
    with Session(engine) as session:
        return session.get(Baseline, point)


def set_baseline(engine: Engine, point: str, arm: str, model: str) -> None:
    """Make ``arm`` (a group or run id) the baseline of ``point``, in place of any other."""
    with write_session(engine) as session:
        row = session.get(Baseline, point)
        if row is None:
            row = Baseline(point=point, arm=arm, model=model)
        row.arm, row.created_at = arm, utcnow()
        session.add(row)


def drop_baseline(engine: Engine, point: str, arm: str) -> bool:
    """Stop ``arm`` being the baseline of ``point``; False when it is not."""
    with write_session(engine) as session:
        row = session.get(Baseline, point)
        if row is None or row.arm != arm:
            return False
        session.delete(row)
        return True
