"""A run's engine steps as its server's connector timed them (``service.core.steps``).

The first ``MAX_STEP_ROWS`` steps of a run are kept one row each (``step_timing``); later
ones are summed into bins of one kind, batch and KV tokens within 1% (``step_bin``), so a
run of any length holds a bounded number of rows. A server numbers its steps upward, and
its connector sends them in order, again after a failed send: a step at or below the
newest one stored for its run was stored already, and is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from sqlalchemy import Engine, func
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session, col, select

from service.core.steps import MAX_STEP_ROWS, StepRow
from service.storage.db import write_session
from service.storage.tables import Run, StepBin, StepTiming

# Bins are 1% wide in KV tokens: a step's time moves with its KV tokens far less than that.
BIN_RATIO = 1.01
SAVE_SLICE = 500


def kv_bin(kv_tokens: float) -> int:
    """The bin of a KV token count: bins grow by ``BIN_RATIO``."""
    return int(math.log1p(max(0.0, kv_tokens)) / math.log(BIN_RATIO))


def record_steps(engine: Engine, worker_id: str, steps: Mapping[str, Sequence[StepRow]],
                 cap: int = MAX_STEP_ROWS) -> int:
    """Store the steps a worker's connector reported for the runs this worker served (a
    run of another worker is ignored, never trusted); return how many were new."""
    new = 0
    with write_session(engine) as session:
        for run_id, rows in steps.items():
            run = session.get(Run, run_id)
            if run is None or run.worker_id != worker_id or not rows:
                continue
            stored, newest = session.exec(
                select(func.count(), func.max(StepTiming.step)).where(col(StepTiming.run_id) == run_id)
            ).one()
            binned_to = session.exec(
                select(func.max(StepBin.last_step)).where(col(StepBin.run_id) == run_id)).one()
            after = max(-1 if newest is None else newest, -1 if binned_to is None else binned_to)
            fresh = sorted((r for r in rows if r.step > after), key=lambda r: r.step)
            room = max(0, cap - stored)
            _insert(session, run_id, fresh[:room])
            for row in fresh[room:]:
                _add_to_bin(session, run_id, row)
            new += len(fresh)
    return new


def _insert(session: Session, run_id: str, rows: Sequence[StepRow]) -> None:
    values = [{"run_id": run_id, "step": r.step, "decode_requests": r.decode_requests,
               "prefill_tokens": int(r.prefill_tokens), "kv_tokens": int(r.kv_tokens),
               "first": int(r.first), "forward_ms": r.forward_ms} for r in rows]
    for i in range(0, len(values), SAVE_SLICE):
        session.exec(sqlite_insert(StepTiming).values(values[i:i + SAVE_SLICE]).on_conflict_do_nothing())


def _add_to_bin(session: Session, run_id: str, row: StepRow) -> None:
    sums = {"count": 1, "prefill_tokens_sum": row.prefill_tokens, "kv_tokens_sum": row.kv_tokens,
            "first_sum": row.first, "forward_ms_sum": row.forward_ms,
            "forward_ms_sq_sum": row.forward_ms ** 2}
    statement = sqlite_insert(StepBin).values(
        run_id=run_id, kind=row.kind, decode_requests=row.decode_requests,
        kv_bin=kv_bin(row.kv_tokens), last_step=row.step, **sums)
    table = StepBin.__table__.c  # type: ignore[attr-defined]
    session.exec(statement.on_conflict_do_update(
        index_elements=["run_id", "kind", "decode_requests", "kv_bin"],
        set_={**{name: table[name] + statement.excluded[name] for name in sums},
              "last_step": func.max(table.last_step, statement.excluded.last_step)},
    ))


def run_steps(engine: Engine, run_id: str) -> list[StepRow]:
    """A run's steps, oldest first: its rows, then its bins (``count`` > 1: means)."""
    with Session(engine) as session:
        rows = session.exec(select(StepTiming).where(col(StepTiming.run_id) == run_id)
                            .order_by(col(StepTiming.step))).all()
        bins = session.exec(select(StepBin).where(col(StepBin.run_id) == run_id)
                            .order_by(col(StepBin.last_step))).all()
    out = [StepRow(step=r.step, decode_requests=r.decode_requests, prefill_tokens=r.prefill_tokens,
                   kv_tokens=r.kv_tokens, first=r.first, forward_ms=r.forward_ms) for r in rows]
    for b in bins:
        mean = b.forward_ms_sum / b.count
        var = max(0.0, b.forward_ms_sq_sum / b.count - mean ** 2) * b.count / max(1, b.count - 1)
        out.append(StepRow(step=b.last_step, decode_requests=b.decode_requests,
                           prefill_tokens=b.prefill_tokens_sum / b.count,
                           kv_tokens=b.kv_tokens_sum / b.count, first=b.first_sum / b.count,
                           forward_ms=mean, count=b.count, forward_ms_var=var if b.count > 1 else 0.0))
    return out


def count_steps(engine: Engine, run_id: str) -> int:
    """How many steps a run has stored, binned ones included."""
    with Session(engine) as session:
        rows = session.exec(select(func.count()).where(col(StepTiming.run_id) == run_id)).one()
        binned = session.exec(select(func.coalesce(func.sum(StepBin.count), 0))
                              .where(col(StepBin.run_id) == run_id)).one()
    return int(rows) + int(binned)
