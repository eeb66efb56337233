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

from sqlalchemy import Engine, event
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
    return engine


@contextmanager
def write_session(engine: Engine) -> Iterator[Session]:
    """A session whose transaction starts with ``BEGIN IMMEDIATE``; commits on success."""
    with Session(engine.execution_options(sqlite_begin="IMMEDIATE"), expire_on_commit=False) as session:
        yield session
        session.commit()
