"""Make the SQLite fixtures of ``tests/test_migrations.py``: databases as earlier
releases of the service left them, with a few rows in every table.

Each fixture must be written by the code of its release, not by the code of today,
so run this script with that release's ``service`` package first on the path (the
script then imports it instead of the working tree's)::

    mkdir -p /tmp/release-2026-11 && git archive 03dfe7b service | tar -x -C /tmp/release-2026-11
    PYTHONPATH=/tmp/release-2026-11 .venv/bin/python tests/data/make_schema_fixture.py \\
        today tests/data/schema_2026_11.sqlite

    mkdir -p /tmp/release-early && git archive de4c5e5 service | tar -x -C /tmp/release-early
    PYTHONPATH=/tmp/release-early .venv/bin/python tests/data/make_schema_fixture.py \\
        early tests/data/schema_2026_11_early.sqlite

``today`` is the schema of 03dfe7b, the last release before Alembic (what
migration 0001 starts from). ``early`` is de4c5e5 (sweeps, before registered workers,
connector warnings, unique samples, server metrics and baselines): it lacks tables,
columns (one of them required) and indexes, and stores one sample twice, as releases
before the unique (run, index) sample index could.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlmodel import Session

from service.analysis.metrics import summarize
from service.core.ids import utcnow
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.core.status import RunStatus
from service.core.sweep import SweepCreate
from service.storage import measurements, store, sweeps, workers
from service.storage.db import make_engine
from service.storage.tables import Worker

SPEC = {"input_len": 64, "output_len": 8, "num_prompts": 6, "max_concurrency": 2}


def samples(count: int, first: int = 0) -> list[Sample]:
    """``count`` successful requests of 8 output tokens, 10 ms apart; the last one failed."""
    out = []
    for i in range(first, first + count):
        ok = i < first + count - 1
        out.append(Sample(index=i, prompt_len=64, output_tokens=8 if ok else 0,
                              ttft=0.020 + i / 1000, itl=[0.005] * 7 if ok else [],
                              latency=0.060 + i / 1000 if ok else 0.5, start_time=0.01 * i,
                              success=ok, error="" if ok else "stream ended early",
                              sent_time=0.01 * i, due_time=0.01 * i))
    return out


def finish(engine: Engine, run_id: str, worker_id: str, data: list[Sample]) -> None:
    """Take a queued run through starting and running to succeeded, with its samples."""
    store.transition(engine, run_id, RunStatus.starting, worker_id=worker_id, started_at=utcnow())
    store.transition(engine, run_id, RunStatus.running)
    measurements.save_samples(engine, run_id, data)
    ok = sum(s.success for s in data)
    store.update_fields(engine, run_id, completed=ok, failed=len(data) - ok,
                        summary=summarize(data, duration=1.0))
    store.transition(engine, run_id, RunStatus.succeeded)


def add_worker(engine: Engine, **fields: Any) -> str:
    """Insert a stopped local worker (the fields every release has) and return its id."""
    now = utcnow()
    worker = Worker(id="w-fixture0001", key=RunSpec().worker_key(), model=RunSpec().model,
                    engine=RunSpec().engine.model_dump(), url="http://127.0.0.1:41001", port=41001,
                    pid=4242, status="stopped", token_hash="0" * 64, log_path="logs/w-fixture0001.log",
                    runs_served=4, created_at=now - timedelta(minutes=5), ready_at=now,
                    stopped_at=now, **fields)
    with Session(engine) as session:
        session.add(worker)
        session.commit()
    return "w-fixture0001"  # not worker.id: the session expired it on commit


def common_rows(engine: Engine, worker_id: str) -> dict[str, str]:
    """Runs every release can store: succeeded, failed, cancelled, queued, and a sweep."""
    spec = RunSpec.model_validate_json(json.dumps(SPEC))
    runs = {}
    for name in ("succeeded", "failed", "cancelled", "queued"):
        run, _ = store.create_run(engine, spec, idempotency_key=f"fixture-{name}")
        runs[name] = run.id
    finish(engine, runs["succeeded"], worker_id, samples(6))
    store.transition(engine, runs["failed"], RunStatus.starting, worker_id=worker_id)
    store.transition(engine, runs["failed"], RunStatus.failed, error="worker exited with code 1")
    store.transition(engine, runs["cancelled"], RunStatus.cancelled)

    body = {"base": SPEC, "grid": {"input_len": [32, 64]}}
    sweep = sweeps.create_sweep(engine, SweepCreate.model_validate_json(json.dumps(body)))
    _, swept = sweeps.get_sweep(engine, sweep.id)
    finish(engine, swept[0].id, worker_id, samples(4))
    return runs


def make_today(engine: Engine) -> None:
    """Rows of every table of 03dfe7b, including a repeats group that is a baseline."""
    from service.analysis.comparison import mark_baseline

    worker_id = add_worker(engine, kv_tokens=65536, vocab_size=8192, external=False,
                           cpu_binding={"env": {"OMP_NUM_THREADS": "1"}, "omp_cores": [1]})
    external = Worker(id="w-fixture0002", key=RunSpec().worker_key(), model=RunSpec().model,
                      engine=RunSpec().engine.model_dump(), url="http://127.0.0.1:9", port=9,
                      status="ready", token_hash="1" * 64, log_path="", external=True,
                      vocab_size=32000, last_seen_at=utcnow())
    workers.add_worker(engine, external)
    runs = common_rows(engine, worker_id)
    measurements.save_server_points(engine, runs["succeeded"], [
        (0.0, {"vllm:num_requests_running": 0.0, "vllm:num_preemptions_total": 0.0}),
        (0.5, {"vllm:num_requests_running": 2.0, "vllm:num_preemptions_total": 1.0}),
    ])
    store.update_fields(engine, runs["succeeded"], stopped_by={"rule": "max_prompts", "requests": 6},
                        warnings=[{"code": "few_samples", "message": "only 6 requests", "figure": 6.0}])
    group, _ = store.create_run(engine, RunSpec.model_validate_json(json.dumps({**SPEC, "repeats": 2})))
    for trial in store.arm_runs(engine, group.group_id or ""):
        finish(engine, trial.id, worker_id, samples(5))
    mark_baseline(engine, group.group_id or "")


def make_early(engine: Engine) -> None:
    """Rows of every table of de4c5e5, and one sample stored twice."""
    worker_id = add_worker(engine)
    runs = common_rows(engine, worker_id)
    twice = samples(6)[2]
    twice.ttft = 99.0  # the later copy: the upgrade keeps the first one
    measurements.save_samples(engine, runs["succeeded"], [twice])


def main() -> None:
    """Write the fixture named by argv[1] (``today`` or ``early``) to argv[2]."""
    kind, out = sys.argv[1], Path(sys.argv[2])
    import service

    print(f"writing the {kind} fixture with the service at {Path(service.__file__).parent}")
    out.unlink(missing_ok=True)
    engine = make_engine(out)
    {"today": make_today, "early": make_early}[kind](engine)
    engine.dispose()
    # One small self-contained file: no WAL beside it, small pages, no free pages.
    with sqlite3.connect(out) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode=DELETE")
    conn = sqlite3.connect(out)
    conn.execute("PRAGMA page_size=1024")
    conn.execute("VACUUM")
    conn.close()


if __name__ == "__main__":
    main()
