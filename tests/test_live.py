"""``GET /api/runs/{id}/live``, what progress displays poll, against the stub vLLM server."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import event

from tests.conftest import wait_finished, wait_for

LONG = {"input_len": 8, "output_len": 16, "num_prompts": 5000, "max_concurrency": 2}


@contextmanager
def statements(client: TestClient) -> Iterator[list[str]]:
    """The SQL the service runs while in the block."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def test_live_shows_a_running_runs_decode_median_without_reading_its_samples(client: TestClient) -> None:
    run_id = client.post("/api/runs", json=LONG).json()["id"]
    wait_for(client, run_id, lambda r: r["status"] == "running" and r["progress"]["completed"] >= 40)
    with statements(client) as seen:
        live = client.get(f"/api/runs/{run_id}/live").json()
    assert live["status"] == "running" and 40 <= live["completed"] < 5000
    # The stub streams a token every 2 ms; each request of 16 tokens has 15 gaps, most of
    # them steady.
    assert 1.5 < live["decode_median_itl_ms"] < 20 and live["decode_gaps"] >= 15 * 20
    assert not [s for s in seen if "FROM sample" in s], seen
    client.post(f"/api/runs/{run_id}/cancel")
    ended = wait_finished(client, run_id)
    # Cancelled, with no summary: the figure comes from what it saved.
    last = client.get(f"/api/runs/{run_id}/live").json()
    assert ended["status"] == last["status"] == "cancelled"
    assert last["decode_gaps"] >= live["decode_gaps"] and 1.5 < last["decode_median_itl_ms"] < 20
