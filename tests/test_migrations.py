"""Schema migrations: a database of an earlier release keeps its rows and ends with the
schema a new one has; the revisions make what the models declare.

The fixtures in ``tests/data`` were written by the releases themselves
(``tests/data/make_schema_fixture.py``): ``schema_2026_11`` by 03dfe7b, the last
release before Alembic, and ``schema_2026_11_early`` by de4c5e5, which lacks tables,
columns and indexes and stores one sample twice.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.exc import IntegrityError
from sqlmodel import SQLModel

from service.core.sample import Sample
from service.core.spec import point_key
from service.storage import db, measurements
from service.storage.db import current_revision, head_revision, make_engine, upgrade
from tests.conftest import make_client

DATA = Path(__file__).resolve().parent / "data"
TODAY = "schema_2026_11.sqlite"
EARLY = "schema_2026_11_early.sqlite"
FIXTURES = [TODAY, EARLY]
# The later copy of the sample the early fixture stores twice (run "fixture-succeeded",
# index 2): the upgrade drops it when it makes samples unique per (run, index).
SECOND_COPY_TTFT = 99.0


def copy_fixture(name: str, tmp_path: Path) -> Path:
    """A copy of a fixture database to upgrade, where the service would keep it."""
    path = tmp_path / "var" / "decodebench.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DATA / name, path)
    return path


def upgraded(path: Path) -> Path:
    """Open ``path`` the way the service does (which upgrades it) and close it again."""
    make_engine(path).dispose()
    return path


def schema(path: Path) -> dict[str, dict[str, Any]]:
    """Every table but Alembic's own as SQLAlchemy reads it: columns (type, nullable),
    primary key, indexes, foreign keys and unique constraints.

    Column order and defaults are left out: a column added to an existing table comes
    last, and one that is required carries the value older rows got.
    """
    engine = create_engine(f"sqlite:///{path}")
    try:
        found = inspect(engine)
        return {
            table: {
                "columns": {c["name"]: (str(c["type"]), c["nullable"])
                            for c in found.get_columns(table)},
                "primary_key": found.get_pk_constraint(table)["constrained_columns"],
                "indexes": {i["name"]: (i["column_names"], bool(i["unique"]))
                            for i in found.get_indexes(table)},
                "foreign_keys": sorted((fk["constrained_columns"], fk["referred_table"],
                                        fk["referred_columns"]) for fk in found.get_foreign_keys(table)),
                "unique": sorted(u["column_names"] for u in found.get_unique_constraints(table)),
            }
            for table in found.get_table_names()
            if table != "alembic_version"
        }
    finally:
        engine.dispose()


def rows(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Every row of every table but Alembic's own, in storage order."""
    with closing(sqlite3.connect(path)) as conn:
        conn.row_factory = sqlite3.Row
        tables = [name for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name != 'alembic_version'")]
        return {t: [dict(r) for r in conn.execute(f'SELECT * FROM "{t}" ORDER BY rowid')] for t in tables}


def pragma(path: Path, name: str) -> Any:
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute(f"PRAGMA {name}").fetchone()[0]


def fixture_run(path: Path, key: str) -> str:
    """The id of the fixture's run made with the Idempotency-Key ``fixture-<key>``."""
    with closing(sqlite3.connect(path)) as conn:
        query = "SELECT id FROM run WHERE idempotency_key = ?"
        (run_id,) = conn.execute(query, (f"fixture-{key}",)).fetchone()
        return str(run_id)


# --- models and revisions ------------------------------------------------------------


def test_new_database_has_what_the_models_declare(tmp_path: Path) -> None:
    by_models = tmp_path / "create_all.sqlite3"
    engine = create_engine(f"sqlite:///{by_models}")
    SQLModel.metadata.create_all(engine)
    engine.dispose()

    by_revisions = upgraded(tmp_path / "new.sqlite3")

    assert schema(by_revisions) == schema(by_models)
    assert "uq_sample_run_index" in schema(by_revisions)["sample"]["indexes"]
    assert schema(by_revisions)["run"]["indexes"]["ix_run_point"] == (["point"], False)


def test_autogenerate_finds_nothing_the_revisions_lack(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "new.sqlite3")
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True})
            assert compare_metadata(context, SQLModel.metadata) == []
    finally:
        engine.dispose()


# --- databases of earlier releases --------------------------------------------------


@pytest.mark.parametrize("fixture", FIXTURES)
def test_upgrade_keeps_every_row(fixture: str, tmp_path: Path) -> None:
    path = copy_fixture(fixture, tmp_path)
    before = rows(path)
    assert all(before.values()), "every table of the fixture holds rows"

    after = rows(upgraded(path))

    if fixture == EARLY:
        before["sample"] = [s for s in before["sample"] if s["ttft"] != SECOND_COPY_TTFT]
    for table, old in before.items():
        # Columns the upgrade added are left out; every old value is where it was.
        assert [{k: row[k] for k in old[0]} for row in after[table]] == old, table


@pytest.mark.parametrize("fixture", FIXTURES)
def test_upgrade_ends_with_the_schema_of_a_new_database(fixture: str, tmp_path: Path) -> None:
    new = upgraded(tmp_path / "new.sqlite3")
    path = upgraded(copy_fixture(fixture, tmp_path))

    assert schema(path) == schema(new)
    engine = make_engine(path)
    try:
        with engine.connect() as conn:
            assert current_revision(conn) == head_revision()
    finally:
        engine.dispose()


def test_sample_stored_twice_keeps_its_first_copy(tmp_path: Path) -> None:
    path = copy_fixture(EARLY, tmp_path)
    run_id = fixture_run(path, "succeeded")
    engine = make_engine(path)
    try:
        samples = measurements.get_samples(engine, run_id)
        assert [s.index for s in samples] == [0, 1, 2, 3, 4, 5]
        assert samples[2].ttft == pytest.approx(0.022)
        # Now unique: the same request stored again is kept once.
        measurements.save_samples(engine, run_id, [Sample(
            index=2, prompt_len=64, output_tokens=8, ttft=1.0, itl=[], latency=1.0,
            start_time=0.0, success=True)])
        assert [s.ttft for s in measurements.get_samples(engine, run_id)][2] == pytest.approx(0.022)
    finally:
        engine.dispose()


def test_columns_added_to_old_rows_get_their_values(tmp_path: Path) -> None:
    path = upgraded(copy_fixture(EARLY, tmp_path))
    after = rows(path)

    assert after["run"] and all(r["point"] == point_key(json.loads(r["spec"])) for r in after["run"])
    assert [(w["external"], w["vocab_size"], w["cpu_binding"]) for w in after["worker"]] == [(0, None, None)]
    assert {r["group_id"] for r in after["run"]} == {None}


def test_upgrade_of_a_database_at_head_changes_nothing(tmp_path: Path) -> None:
    path = upgraded(copy_fixture(TODAY, tmp_path))
    before = pragma(path, "schema_version"), rows(path)

    engine = make_engine(path)
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute",
                 lambda _conn, _cursor, statement, *_: statements.append(statement))
    try:
        upgrade(engine)
    finally:
        engine.dispose()

    # SQLite counts every schema change in schema_version.
    assert (pragma(path, "schema_version"), rows(path)) == before
    # One read: nothing locks the database for writing, nothing runs Alembic's scripts.
    assert statements and all(s.lstrip().upper().startswith(("BEGIN DEFERRED", "SELECT", "PRAGMA"))
                              for s in statements), statements


def test_a_migration_may_copy_a_table_others_refer_to(tmp_path: Path) -> None:
    """SQLite changes a table by copying it into a new one (batch mode): samples refer to
    runs, and outlive their table being copied; foreign keys hold again afterwards."""
    path = upgraded(copy_fixture(TODAY, tmp_path))
    before = rows(path)
    engine = make_engine(path)
    try:
        with db._schema_change(engine) as conn:
            operations = Operations(MigrationContext.configure(conn))
            with operations.batch_alter_table("run", recreate="always"):
                pass
        assert rows(path) == before
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(text("UPDATE sample SET run_id = 'r-nowhere' WHERE id = 1"))
    finally:
        engine.dispose()


@pytest.mark.parametrize("fixture", FIXTURES)
def test_service_serves_runs_of_an_upgraded_database(fixture: str, tmp_path: Path) -> None:
    path = copy_fixture(fixture, tmp_path)
    run_id = fixture_run(path, "succeeded")
    with closing(sqlite3.connect(path)) as conn:
        (sweep_id,) = conn.execute("SELECT id FROM sweep").fetchone()

    with make_client(tmp_path) as client:
        run = client.get(f"/api/runs/{run_id}").json()
        requests = client.get(f"/api/runs/{run_id}/requests").json()
        sweep = client.get(f"/api/sweeps/{sweep_id}").json()
        baselines = client.get("/api/baselines").json()

    assert run["status"] == "succeeded"
    assert run["progress"] == {"completed": 5, "failed": 1, "total": 6}
    assert run["summary"]["completed"] == 5
    assert [(r["index"], r["success"]) for r in requests] == [(i, i < 5) for i in range(6)]
    assert sweep["grid"] == {"input_len": [32, 64]}
    # The scheduler may have taken the sweep's queued run meanwhile.
    assert len(sweep["runs"]) == 2 and "succeeded" in {r["status"] for r in sweep["runs"]}
    assert [b["arm"][:2] for b in baselines] == (["g-"] if fixture == TODAY else [])
