"""What a run measured, stored raw: its per-request samples and the scrapes of its server.

A run can hold thousands of samples, each with hundreds of gaps and its generated text, so
readers take them in slices (``sample_slices``, ``sample_columns``) or a page at a time
(``sample_page``), and only the columns they use: no read holds a whole run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import Engine, func
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session, col, select

from service.core.sample import FIELD_NAMES, Sample
from service.storage.tables import SampleRow, ServerMetricPoint

# Rows per INSERT: SQLite caps the variables of one statement.
SAVE_SLICE = 500
# Rows per read of samples: what one slice holds in memory.
READ_SLICE = 500


def save_samples(engine: Engine, run_id: str, samples: Sequence[Sample]) -> None:
    """Store raw samples of a run. A sample is kept once: one already stored under its
    (run, index) is left as it is."""
    if not samples:
        return
    rows = [{"run_id": run_id, **s.as_dict()} for s in samples]
    with Session(engine) as session:
        for i in range(0, len(rows), SAVE_SLICE):
            session.exec(sqlite_insert(SampleRow).values(rows[i:i + SAVE_SLICE]).on_conflict_do_nothing())
        session.commit()


def count_samples(engine: Engine, run_id: str) -> int:
    """How many samples a run has stored."""
    with Session(engine) as session:
        return int(session.exec(
            select(func.count()).select_from(SampleRow).where(SampleRow.run_id == run_id)).one())


def sample_columns(engine: Engine, run_id: str, names: Sequence[str],
                   rows: int = READ_SLICE) -> Iterator[list[tuple[Any, ...]]]:
    """The columns ``names`` (fields of ``Sample``) of a run's samples, by request index, a
    slice of ``rows`` at a time; each slice read in its own short transaction."""
    unknown = set(names) - set(FIELD_NAMES)
    if unknown:
        raise ValueError(f"not fields of a sample: {sorted(unknown)}")
    columns = [getattr(SampleRow, n) for n in ("index", *names)]
    last = -1
    while True:
        with Session(engine) as session:
            found = session.exec(
                select(*columns)
                .where(SampleRow.run_id == run_id, col(SampleRow.index) > last)
                .order_by(col(SampleRow.index)).limit(rows)
            ).all()
        if not found:
            return
        last = found[-1][0]
        yield [tuple(row[1:]) for row in found]
        if len(found) < rows:
            return


def sample_slices(engine: Engine, run_id: str, *, text: bool = False,
                  rows: int = READ_SLICE) -> Iterator[list[Sample]]:
    """A run's samples by request index, a slice of ``rows`` at a time; without ``text``
    their ``generated_text`` is left empty (it is not read)."""
    names = [n for n in FIELD_NAMES if text or n != "generated_text"]
    for found in sample_columns(engine, run_id, names, rows):
        yield [Sample(**dict(zip(names, row, strict=True))) for row in found]


def sample_page(engine: Engine, run_id: str, limit: int, offset: int) -> list[Sample]:
    """``limit`` samples of a run from position ``offset`` in request index order, with
    their texts."""
    with Session(engine) as session:
        found = session.exec(
            select(*[getattr(SampleRow, n) for n in FIELD_NAMES])
            .where(SampleRow.run_id == run_id)
            .order_by(col(SampleRow.index)).offset(offset).limit(limit)
        ).all()
    return [Sample(**dict(zip(FIELD_NAMES, row, strict=True))) for row in found]


def get_samples(engine: Engine, run_id: str) -> list[Sample]:
    """Every stored sample of a run at once, by request index, with its text: for runs
    known to be small (the routes read slices)."""
    return [s for found in sample_slices(engine, run_id, text=True) for s in found]


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
