"""Runs end to end through the service against the stub vLLM server (process control)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from tests.conftest import make_client, wait_finished, wait_for

SMALL = {"input_len": 64, "output_len": 8, "num_prompts": 12, "max_concurrency": 4}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_run_succeeds_with_one_sample_per_request(client: TestClient) -> None:
    run = client.post("/api/runs", json=SMALL).json()
    done = wait_finished(client, run["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["progress"] == {"completed": 12, "failed": 0, "total": 12}
    samples = client.get(f"/api/runs/{run['id']}/requests").json()
    assert sorted(s["index"] for s in samples) == list(range(12))
    assert all(s["output_tokens"] == 8 and s["prompt_len"] == 64 for s in samples)
    assert all(len(s["itl"]) == 7 and s["ttft"] > 0 for s in samples)
    summary = done["summary"]
    assert summary["completed"] == 12
    assert summary["total_output_tokens"] == 96
    assert summary["median_tpot_ms"] > 0


def test_second_run_with_same_engine_reuses_the_worker(client: TestClient) -> None:
    first = client.post("/api/runs", json=SMALL).json()
    second = client.post("/api/runs", json={**SMALL, "fill": {"mean": 0.5}}).json()
    a = wait_finished(client, first["id"])
    b = wait_finished(client, second["id"])
    assert a["status"] == b["status"] == "succeeded"
    assert a["worker_id"] == b["worker_id"]
    workers = client.get("/api/workers").json()
    assert len(workers) == 1
    assert workers[0]["runs_served"] == 2


def test_other_engine_settings_get_another_worker(client: TestClient) -> None:
    first = client.post("/api/runs", json=SMALL).json()
    a = wait_finished(client, first["id"])
    other = {**SMALL, "engine": {"extra_args": ["--max-num-seqs=4"]}}
    b = wait_finished(client, client.post("/api/runs", json=other).json()["id"])
    assert a["worker_id"] != b["worker_id"]
    statuses = {w["id"]: w["status"] for w in client.get("/api/workers").json()}
    assert statuses == {a["worker_id"]: "stopped", b["worker_id"]: "ready"}


def test_cancel_running_run_keeps_samples_so_far(tmp_path: Path) -> None:
    with make_client(tmp_path) as client:
        os.environ["STUB_TOKEN_INTERVAL_S"] = "0.05"
        try:
            run = client.post(
                "/api/runs", json={"input_len": 16, "output_len": 20, "num_prompts": 40,
                                   "max_concurrency": 2},
            ).json()
            wait_for(client, run["id"], lambda r: r["progress"]["completed"] >= 2)
        finally:
            del os.environ["STUB_TOKEN_INTERVAL_S"]
        response = client.post(f"/api/runs/{run['id']}/cancel")
        assert response.status_code == 200
        done = wait_finished(client, run["id"], timeout=10)
        assert done["status"] == "cancelled"
        samples = client.get(f"/api/runs/{run['id']}/requests").json()
        assert 2 <= len(samples) < 40
        assert sum(s["success"] for s in samples) >= 2
        # The in-flight streams were closed, so the server stops generating for them.
        worker = client.get("/api/workers").json()[0]
        deadline = time.monotonic() + 5
        while httpx.get(f"{worker['url']}/stub/requests").json()["open"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{worker['url']}/stub/requests").json()["open"] == 0


def test_worker_that_dies_at_start_fails_the_run_with_its_log(tmp_path: Path) -> None:
    os.environ["STUB_EXIT_AT_START"] = "3"
    try:
        with make_client(tmp_path) as client:
            run = client.post("/api/runs", json=SMALL).json()
            done = wait_finished(client, run["id"])
    finally:
        del os.environ["STUB_EXIT_AT_START"]
    assert done["status"] == "failed"
    assert "exited with code 3" in done["error"]
    assert "stub: exiting at start as told" in done["error"]


def test_service_shutdown_stops_its_workers(tmp_path: Path) -> None:
    with make_client(tmp_path) as client:
        run = client.post("/api/runs", json=SMALL).json()
        wait_finished(client, run["id"])
        pid = client.get("/api/workers").json()[0]["pid"]
        assert _pid_alive(pid)
    assert not _pid_alive(pid)


def test_pages_show_the_run_and_its_numbers(client: TestClient) -> None:
    run = client.post("/api/runs", json=SMALL).json()
    wait_finished(client, run["id"])
    index = client.get("/")
    assert index.status_code == 200
    assert run["id"] in index.text and "succeeded" in index.text
    page = client.get(f"/runs/{run['id']}")
    assert page.status_code == 200
    assert "median" in page.text and "TPOT" in page.text
    assert "export?format=vllm" in page.text


def test_export_csv_has_one_row_per_request(client: TestClient) -> None:
    run = client.post("/api/runs", json=SMALL).json()
    wait_finished(client, run["id"])
    response = client.get(f"/api/runs/{run['id']}/export?format=csv")
    assert response.status_code == 200
    lines = response.text.strip().splitlines()
    assert lines[0].startswith("index,prompt_len,output_tokens")
    assert len(lines) == 1 + 12
