"""The fill/prefill pairs of sweeps over mode, as the fidelity ledger reads them."""

from __future__ import annotations

from sqlalchemy import Engine
from sqlmodel import Session, col, select

from service.core.status import MEASURED
from service.storage.tables import Run


def measured_paired_runs(engine: Engine) -> list[Run]:
    """Every run of a pair (``pair_id`` set) with numbers (succeeded or imported), oldest
    first; a pair whose partner failed shows one run."""
    statuses = [s.value for s in MEASURED]
    with Session(engine) as session:
        return list(session.exec(
            select(Run).where(col(Run.pair_id).is_not(None), col(Run.status).in_(statuses))
            .order_by(col(Run.created_at), col(Run.id))).all())
