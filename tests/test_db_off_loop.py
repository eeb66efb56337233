"""Where database work runs: never on the event loop. Sync routes do it in the
threadpool; the scheduler, runner, launcher and async routes hand it to a thread. A
statement run on the loop stalls every stream the service is timing and every API
call, for as long as SQLite's busy timeout (30 s) when another writer holds the lock."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import event

from tests.conftest import wait_finished
from tests.ports import free_port

SMALL = {"input_len": 16, "output_len": 8, "num_prompts": 6, "max_concurrency": 2}


def test_no_statement_runs_on_the_event_loop(client: TestClient) -> None:
    on_loop: list[str] = []
    statements = 0
    lock = threading.Lock()

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        nonlocal statements
        with lock:
            statements += 1
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # a worker thread: where database work belongs
        on_loop.append(statement.split("\n")[0][:120])

    engine = client.app.state.engine  # type: ignore[attr-defined]
    event.listen(engine, "before_cursor_execute", record)
    try:
        # A run from queue to end, a cancel, the pages and reads, a registered server
        # (nothing listens at its URL) probed and removed.
        done = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
        assert done["status"] == "succeeded", done["error"]
        queued = client.post("/api/runs", json={**SMALL, "num_prompts": 200, "seed": 1}).json()
        assert client.post(f"/api/runs/{queued['id']}/cancel").status_code == 200
        for path in ("/", f"/runs/{done['id']}", "/api/runs", f"/api/runs/{done['id']}/requests",
                     "/metrics", "/healthz"):
            assert client.get(path).status_code == 200, path
        registered = client.post("/api/workers", json={
            "url": f"http://127.0.0.1:{free_port()}", "model": "decodebench-tiny"})
        assert registered.status_code == 201, registered.text
        worker_id = registered.json()["id"]
        assert client.delete(f"/api/workers/{worker_id}").status_code == 204
        wait_finished(client, queued["id"])
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert statements > 50  # the listener saw the work
    assert on_loop == []
