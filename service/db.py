"""SQLite engine: WAL, busy timeout, and ``BEGIN IMMEDIATE`` for read-then-write work.

pysqlite's own transaction handling is switched off so that the SQLAlchemy
``begin`` event decides how each transaction starts: deferred by default,
immediate for sessions made by :func:`write_session`, which take the write lock
up front instead of failing on upgrade when another writer got there first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event, inspect
from sqlmodel import Session, SQLModel, create_engine

BUSY_TIMEOUT_MS = 30_000


def make_engine(path: Path) -> Engine:
    """Create the engine for the SQLite file at ``path`` and create missing tables."""
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        f"sqlite:///{path}",
        connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")

    # Import for the side effect of registering the tables.
    from service import models  # noqa: F401

    SQLModel.metadata.create_all(engine)
    add_missing_columns(engine)
    add_sample_unique_index(engine)
    add_point_keys(engine)
    return engine


def add_point_keys(engine: Engine) -> int:
    """Give runs stored before runs were keyed by point (``Run.point``) their key, so
    baselines find them; returns how many were keyed."""
    from sqlmodel import col, select, update

    from service.models import Run, point_key

    with Session(engine) as session:
        rows = session.exec(select(Run.id, Run.spec).where(col(Run.point).is_(None))).all()
        for run_id, spec in rows:
            session.exec(update(Run).where(col(Run.id) == run_id).values(point=point_key(dict(spec))))
        session.commit()
    return len(rows)


def add_sample_unique_index(engine: Engine) -> None:
    """Give a database made before samples were unique per (run, index) that index,
    keeping the first copy of any sample stored twice."""
    from service.models import SAMPLE_UNIQUE_INDEX

    with engine.begin() as conn:
        have = {i["name"] for i in inspect(conn).get_indexes("sample")}
        if SAMPLE_UNIQUE_INDEX in have:
            return
        conn.exec_driver_sql(
            'DELETE FROM sample WHERE id NOT IN (SELECT MIN(id) FROM sample GROUP BY run_id, "index")'
        )
        conn.exec_driver_sql(
            f'CREATE UNIQUE INDEX IF NOT EXISTS {SAMPLE_UNIQUE_INDEX} ON sample (run_id, "index")'
        )


def add_missing_columns(engine: Engine) -> list[str]:
    """Add columns that newer code declares to tables an older version created.

    ``create_all`` makes missing tables, never missing columns; without this, an
    upgraded service (a new image on the same volume) could not read its own data.
    Returns the columns added, as ``table.column``.
    """
    added = []
    existing = inspect(engine)
    with engine.begin() as conn:
        for table in SQLModel.metadata.sorted_tables:
            have = {c["name"] for c in existing.get_columns(table.name)}
            for column in table.columns:
                if column.name in have:
                    continue
                kind = column.type.compile(engine.dialect)
                ddl = f'ALTER TABLE "{table.name}" ADD COLUMN "{column.name}" {kind}'
                default = getattr(column.default, "arg", None)
                if isinstance(default, bool | int | float | str):
                    ddl += f" DEFAULT {_literal(default)}"
                if not column.nullable:
                    if default is None:
                        raise RuntimeError(f"cannot add required column {table.name}.{column.name}")
                    ddl += " NOT NULL"
                conn.exec_driver_sql(ddl)
                added.append(f"{table.name}.{column.name}")
    return added


def _literal(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


@contextmanager
def write_session(engine: Engine) -> Iterator[Session]:
    """A session whose transaction starts with ``BEGIN IMMEDIATE``; commits on success."""
    with Session(engine.execution_options(sqlite_begin="IMMEDIATE"), expire_on_commit=False) as session:
        yield session
        session.commit()
