"""The runner's promises about storage: each sample once, and no run left ``running``
when the write that ends it fails."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError

from service.control.fleet import Placement
from service.control.runner import Runner
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.core.status import RunStatus
from service.storage import measurements, store
from service.storage.db import make_engine
from tests.conftest import make_client, make_settings, wait_finished


def _sample(i: int) -> Sample:
    return Sample(index=i, prompt_len=8, output_tokens=2, ttft=0.1, itl=[0.01], latency=0.11,
                  start_time=float(i), success=True)


def test_a_sample_saved_twice_is_stored_once(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "db.sqlite3")
    run, _ = store.create_run(engine, RunSpec(num_prompts=3))
    measurements.save_samples(engine, run.id, [_sample(0), _sample(1)])
    measurements.save_samples(engine, run.id, [_sample(1), _sample(2)])
    assert [s.index for s in measurements.get_samples(engine, run.id)] == [0, 1, 2]


def test_an_older_database_with_duplicate_samples_gets_the_unique_index(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    engine = make_engine(path)
    run, _ = store.create_run(engine, RunSpec(num_prompts=2))
    measurements.save_samples(engine, run.id, [_sample(0), _sample(1)])
    engine.dispose()
    # What a service before the index could leave: the index gone, a sample stored twice
    # (and, before schema migrations, no Alembic revision).
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE alembic_version")
        conn.execute("DROP INDEX uq_sample_run_index")
        conn.execute("INSERT INTO sample (run_id, \"index\", prompt_len, output_tokens, ttft, itl, latency,"
                     " start_time, success, error, generated_text) SELECT run_id, \"index\", prompt_len,"
                     " output_tokens, ttft, itl, latency, start_time, success, error, generated_text"
                     " FROM sample WHERE \"index\" = 1")
    engine = make_engine(path)
    assert [s.index for s in measurements.get_samples(engine, run.id)] == [0, 1]
    with sqlite3.connect(path) as conn:
        names = [r[1] for r in conn.execute("PRAGMA index_list('sample')")]
    assert "uq_sample_run_index" in names


def test_a_run_whose_end_cannot_be_written_is_failed_not_left_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = store.transition

    def flaky(engine: Any, run_id: str, target: RunStatus, **fields: Any) -> bool:
        if target == RunStatus.succeeded:
            raise OperationalError("UPDATE run", {}, Exception("disk I/O error"))
        return real(engine, run_id, target, **fields)

    monkeypatch.setattr(store, "transition", flaky)
    client: TestClient
    with make_client(tmp_path) as client:
        run = client.post("/api/runs", json={"input_len": 8, "output_len": 2, "num_prompts": 3}).json()
        done = wait_finished(client, run["id"], timeout=60)
        assert done["status"] == "failed"
        assert "could not be recorded" in done["error"]
        # What was measured is kept.
        assert len(client.get(f"/api/runs/{run['id']}/requests").json()) == 3


class _NotWalked(list[Sample]):
    """A run's samples that fail the test if anything goes over all of them."""

    def __iter__(self) -> Any:
        raise AssertionError("every sample of the run was gone over")


def test_progress_is_saved_from_running_counts_not_a_walk_over_every_sample(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    engine = make_engine(settings.db_path)
    run, _ = store.create_run(engine, RunSpec(num_prompts=3000))
    runner = Runner(settings, engine, None, run.id, RunSpec(num_prompts=3000),  # type: ignore[arg-type]
                    Placement(key="k"))
    runner.samples = _NotWalked()

    async def measure() -> None:
        for i in range(3000):
            sample = _sample(i)
            sample.success = i % 10 != 0
            runner.took(sample)
            if i % 1000 == 999:
                await runner.persist()

    asyncio.run(measure())
    assert (store.get_run(engine, run.id).completed, store.get_run(engine, run.id).failed) == (2700, 300)
    assert measurements.count_samples(engine, run.id) == 3000
