"""SQLite engine: WAL, busy timeout, ``BEGIN IMMEDIATE`` for read-then-write work, and
the schema kept at the newest Alembic revision (``service/storage/migrations``).

pysqlite's own transaction handling is switched off so that the SQLAlchemy
``begin`` event decides how each transaction starts: deferred by default,
immediate for sessions made by :func:`write_session`, which take the write lock
up front instead of failing on upgrade when another writer got there first.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    Column,
    Connection,
    Engine,
    MetaData,
    Table,
    bindparam,
    event,
    inspect,
    select,
    text,
    update,
)
from sqlmodel import Session, create_engine

from service.core.spec import point_key

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 30_000
# One connection for every thread that may hold one at once, so that no thread waits for
# a connection while holding none: FastAPI's threadpool (sync routes and dependencies)
# and the event loop's executor (``asyncio.to_thread``: the scheduler, runner, fleet
# and async routes). ``service.app`` sizes both to these.
THREADPOOL_THREADS = 40
LOOP_EXECUTOR_THREADS = 8
POOL_SIZE = THREADPOOL_THREADS + LOOP_EXECUTOR_THREADS
MIGRATIONS = Path(__file__).with_name("migrations")
# The first revision: the schema of the last release before Alembic.
BASELINE = "0001"


def make_engine(path: Path) -> Engine:
    """Create the engine for the SQLite file at ``path``, upgrading its schema to the newest
    revision (making it when new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        f"sqlite:///{path}",
        connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000},
        pool_size=POOL_SIZE,
        max_overflow=0,
        pool_timeout=BUSY_TIMEOUT_MS / 1000,
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

    upgrade(engine)
    return engine


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's configuration for ``service/storage/migrations`` (no ``alembic.ini``); commands
    given it run on ``connection``."""
    config = Config()
    # Options are interpolated: a "%" in the path must be doubled.
    config.set_main_option("script_location", str(MIGRATIONS).replace("%", "%%"))
    config.attributes["connection"] = connection
    return config


@functools.cache
def head_revision() -> str:
    """The newest revision in ``service/storage/migrations``."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no revisions in {MIGRATIONS}")
    return head


def current_revision(conn: Connection) -> str | None:
    """The revision a database is at; None for a new one or one made before Alembic."""
    return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> None:
    """Bring the database to the newest revision; one already there costs one query.

    A new database is made by the revisions. One made by a release before Alembic (our
    tables, no ``alembic_version``) is first brought to revision 0001 by
    :func:`_legacy_to_baseline` and stamped with it. Everything happens in one
    ``BEGIN IMMEDIATE`` transaction: a failed upgrade leaves the database as it was.
    """
    with engine.connect() as conn:
        if current_revision(conn) == head_revision():
            return
    with _schema_change(engine) as conn:
        config = alembic_config(conn)
        # Read again under the write lock: another engine may have upgraded meanwhile.
        if current_revision(conn) is None and inspect(conn).has_table("run"):
            _legacy_to_baseline(conn)
            command.stamp(config, BASELINE)
        command.upgrade(config, "head")


@contextmanager
def _schema_change(engine: Engine) -> Iterator[Connection]:
    """A connection in one ``BEGIN IMMEDIATE`` transaction with foreign keys unenforced.

    A batch migration copies a table into a new one and drops the old; with
    enforcement on, SQLite refuses to drop a table other rows refer to (``run``). So
    the check is made once, at the end, as SQLite's own procedure for schema changes
    does (https://www.sqlite.org/lang_altertable.html#otheralter).
    """
    with engine.connect() as conn:
        # Outside any transaction: inside one, SQLite ignores this pragma.
        dbapi_conn = conn.connection.dbapi_connection
        assert dbapi_conn is not None
        dbapi_conn.execute("PRAGMA foreign_keys=OFF")
        try:
            with conn.execution_options(sqlite_begin="IMMEDIATE").begin():
                yield conn
                broken = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
                if broken:
                    raise RuntimeError(f"the schema change breaks foreign keys: {broken[:5]}")
        finally:
            dbapi_conn.execute("PRAGMA foreign_keys=ON")


# Required columns that releases before Alembic added to tables that older ones had
# made, with the value rows stored before them get (the model's default then).
_LEGACY_DEFAULTS = {("worker", "external"): "0"}


def _legacy_to_baseline(conn: Connection) -> None:
    """Bring a database made by a release before Alembic to revision 0001.

    Any earlier release may have made it, each with the tables, columns and indexes of
    its time: what 0001 makes (read from an in-memory database it made) and this one
    lacks is added, keeping every row but the second copy of a sample stored twice
    (before samples were unique per run and index); runs get their ``point``.
    """
    baseline = _baseline_schema()
    found = inspect(conn)
    have_tables = set(found.get_table_names())
    added = []
    for table in baseline.sorted_tables:
        if table.name not in have_tables:
            table.create(conn)
            added.append(table.name)
            continue
        have_columns = {c["name"] for c in found.get_columns(table.name)}
        for column in table.columns:
            if column.name not in have_columns:
                conn.exec_driver_sql(_add_column_ddl(conn, table.name, column))
                added.append(f"{table.name}.{column.name}")
        have_indexes = {i["name"] for i in found.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in have_indexes:
                if index.unique:
                    _drop_duplicates(conn, table.name, [c.name for c in index.columns])
                index.create(conn)
                added.append(str(index.name))
    keyed = _add_point_keys(conn, baseline.tables["run"])
    log.info("database made before migrations brought to revision %s: added %s; %d runs keyed "
             "by point", BASELINE, ", ".join(added) or "nothing", keyed)


def _baseline_schema() -> MetaData:
    """The tables revision 0001 makes, as SQLite reports them."""
    memory = create_engine("sqlite://")
    try:
        with memory.begin() as conn:
            command.upgrade(alembic_config(conn), BASELINE)
            schema = MetaData()
            schema.reflect(conn)
    finally:
        memory.dispose()
    schema.remove(schema.tables["alembic_version"])
    return schema


def _add_column_ddl(conn: Connection, table: str, column: Column[Any]) -> str:
    quote = conn.dialect.identifier_preparer.quote
    ddl = f"ALTER TABLE {quote(table)} ADD COLUMN {quote(column.name)} {column.type.compile(conn.dialect)}"
    if not column.nullable:
        default = _LEGACY_DEFAULTS.get((table, column.name))
        if default is None:
            raise RuntimeError(f"no value for the rows before the required column {table}.{column.name}")
        ddl += f" NOT NULL DEFAULT {default}"
    return ddl


def _drop_duplicates(conn: Connection, table: str, columns: list[str]) -> None:
    """Keep the first row (lowest rowid) of each value of ``columns``."""
    quote = conn.dialect.identifier_preparer.quote
    names = ", ".join(quote(c) for c in columns)
    dropped = conn.exec_driver_sql(
        f"DELETE FROM {quote(table)} WHERE rowid NOT IN "
        f"(SELECT MIN(rowid) FROM {quote(table)} GROUP BY {names})"
    ).rowcount
    if dropped:
        log.warning("dropped %d rows of %s stored twice under one (%s)", dropped, table, names)


def _add_point_keys(conn: Connection, run: Table) -> int:
    """Give runs stored before runs were keyed by point (``Run.point``) their key, so
    baselines find them; returns how many were keyed."""
    rows = conn.execute(select(run.c.id, run.c.spec).where(run.c.point.is_(None))).all()
    if rows:
        conn.execute(
            update(run).where(run.c.id == bindparam("run_id")).values(point=bindparam("key")),
            [{"run_id": run_id, "key": point_key(dict(spec))} for run_id, spec in rows],
        )
    return len(rows)


@contextmanager
def write_session(engine: Engine) -> Iterator[Session]:
    """A session whose transaction starts with ``BEGIN IMMEDIATE``; commits on success."""
    with Session(engine.execution_options(sqlite_begin="IMMEDIATE"), expire_on_commit=False) as session:
        yield session
        session.commit()


def ping(engine: Engine) -> None:
    """Ask the database one trivial question; raises what the driver raises when it cannot answer."""
    with Session(engine) as session:
        session.connection().execute(text("SELECT 1"))
