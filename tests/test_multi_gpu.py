"""Several servers of one model and engine: a sweep uses every GPU at once, one point per server,
and a server just started serves the run it was started for before any other.

The stub server stands in for vLLM and reports the CUDA_VISIBLE_DEVICES it was given.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from service.control.vllm_cli import kv_capacity
from tests.conftest import make_client, wait_finished

# Each point streams 2 rounds of 40 tokens 0.03 s apart: about 2.4 s on the stub, long
# enough for four points started side by side to overlap on a loaded machine.
BASE = {"input_len": 8, "output_len": 40, "num_prompts": 4, "max_concurrency": 2}


def test_a_sweep_of_one_engine_runs_its_points_side_by_side_on_every_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.03")
    with make_client(tmp_path, gpus="0,1,2,3") as client:
        body = {"base": BASE, "grid": {"input_len": [8, 16, 24, 32]}}
        sweep = client.post("/api/sweeps", json=body).json()
        runs = [wait_finished(client, r["id"], timeout=60) for r in sweep["runs"]]
        assert all(r["status"] == "succeeded" for r in runs), [r["error"] for r in runs]
        # All four were running at once: the last to start started before the first ended.
        assert max(r["started_at"] for r in runs) < min(r["finished_at"] for r in runs)
        # ... each on its own server, each server on its own GPU.
        assert len({r["worker_id"] for r in runs}) == 4
        workers = {w["id"]: w for w in client.get("/api/workers").json()}
        assert len(workers) == 4
        assert {w["model"] for w in workers.values()} == {runs[0]["spec"]["model"]}
        assert sorted(workers[r["worker_id"]]["gpus"] for r in runs) == ["0", "1", "2", "3"]
        for run in runs:
            worker = workers[run["worker_id"]]
            assert worker["status"] == "ready" and worker["runs_served"] == 1
            seen = httpx.get(f"{worker['url']}/stub/requests").json()
            assert seen["cuda_visible_devices"] == worker["gpus"]


def test_a_new_worker_is_not_given_to_another_run_before_the_one_it_was_started_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Widen the last step of a worker's start, after /health answered, to a second.
    async def slow_kv_capacity(client: httpx.AsyncClient, url: str) -> int | None:
        await asyncio.sleep(1.0)
        return await kv_capacity(client, url)

    monkeypatch.setattr("service.control.local.kv_capacity", slow_kv_capacity)
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.01")
    with make_client(tmp_path) as client:
        first, second = (client.post("/api/runs", json=BASE).json()["id"] for _ in range(2))
        a, b = wait_finished(client, first, timeout=60), wait_finished(client, second, timeout=60)
        assert a["status"] == b["status"] == "succeeded"
        assert a["worker_id"] == b["worker_id"]
        # One run at a time on it, the one it was started for first.
        assert a["finished_at"] <= b["started_at"]
