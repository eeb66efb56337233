"""Deleting runs with everything stored for them, in the caller's transaction: the one
cascade that deleting a run, a sweep and a capacity search share."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import delete
from sqlmodel import Session, col

from service.storage.tables import Baseline, Run, SampleRow, ServerMetricPoint, StepBin, StepTiming


def delete_runs(session: Session, ids: Collection[str], arms: Collection[str]) -> None:
    """Delete runs ``ids`` with their samples, server scrapes and engine steps, and the
    baselines of ``arms`` (the runs themselves and the groups that go with them)."""
    ids, arms = list(ids), list(arms)
    for table in (SampleRow, ServerMetricPoint, StepTiming, StepBin):
        session.exec(delete(table).where(col(table.run_id).in_(ids)))
    session.exec(delete(Baseline).where(col(Baseline.arm).in_(arms)))
    session.exec(delete(Run).where(col(Run.id).in_(ids)))
