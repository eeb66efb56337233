"""Log files do not pile up: a run's driver logs go with the run, and only the logs of the
last workers to end are kept."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from fastapi.testclient import TestClient

from service.core.ids import utcnow
from service.storage import logs, workers
from service.storage.db import make_engine
from service.storage.tables import Worker
from tests.conftest import make_client, make_settings, wait_finished

SMALL = {"input_len": 32, "output_len": 4, "num_prompts": 2, "max_concurrency": 2}


def _driver_logs(logs_dir: Path, run_id: str) -> list[Path]:
    return sorted(logs_dir.glob(f"{run_id}.driver*.log"))


def test_deleting_a_run_deletes_its_driver_logs(client: TestClient) -> None:
    logs_dir = client.app.state.settings.logs_dir  # type: ignore[attr-defined]
    gone = client.post("/api/runs", json=SMALL).json()["id"]
    keep = client.post("/api/runs", json=SMALL).json()["id"]
    assert wait_finished(client, gone)["status"] == "succeeded"
    assert wait_finished(client, keep)["status"] == "succeeded"
    assert _driver_logs(logs_dir, gone) and _driver_logs(logs_dir, keep)
    assert client.delete(f"/api/runs/{gone}").status_code == 204
    assert _driver_logs(logs_dir, gone) == []
    assert _driver_logs(logs_dir, keep) != []


def _worker(logs_dir: Path, n: int, status: str, ended_minutes_ago: int | None) -> Worker:
    log = logs_dir / f"w-{n:04d}.log"
    log.write_text(f"worker {n}\n")
    (logs_dir / f"w-{n:04d}.log.1").write_text("rotated\n")
    stopped = utcnow() - timedelta(minutes=ended_minutes_ago) if ended_minutes_ago is not None else None
    return Worker(id=f"w-{n:04d}", key="k", model="m", engine={}, url="http://127.0.0.1:9", port=9,
                  status=status, token_hash=f"h{n}", log_path=str(log), stopped_at=stopped)


def test_the_service_keeps_the_logs_of_the_last_workers_to_end(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, worker_logs_kept=10)
    settings.logs_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    # 30 servers that ended, the lower the number the longer ago, one of them failed.
    for n in range(30):
        workers.add_worker(engine, _worker(settings.logs_dir, n, "failed" if n == 25 else "stopped",
                                           ended_minutes_ago=100 - n))
    engine.dispose()
    with make_client(tmp_path, worker_logs_kept=10) as client:
        assert client.get("/healthz").status_code == 200
    kept = sorted(p.name for p in settings.logs_dir.glob("w-*"))
    assert kept == sorted(f"w-{n:04d}.log{end}" for n in range(20, 30) for end in ("", ".1"))


def test_pruning_never_touches_a_live_worker_or_a_file_outside_the_logs(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    settings.logs_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    live = _worker(settings.logs_dir, 1, "ready", ended_minutes_ago=None)
    elsewhere = tmp_path / "elsewhere.log"
    elsewhere.write_text("not ours\n")
    old = _worker(settings.logs_dir, 2, "stopped", ended_minutes_ago=60)
    outside = _worker(settings.logs_dir, 3, "stopped", ended_minutes_ago=50)
    outside.log_path = str(elsewhere)
    newest = _worker(settings.logs_dir, 4, "stopped", ended_minutes_ago=1)
    for w in (live, old, outside, newest):
        workers.add_worker(engine, w)
    try:
        removed = logs.prune_worker_logs(engine, settings.logs_dir, keep=1)
    finally:
        engine.dispose()
    assert sorted(p.name for p in removed) == ["w-0002.log", "w-0002.log.1"]
    assert Path(live.log_path).exists() and elsewhere.exists() and Path(newest.log_path).exists()
