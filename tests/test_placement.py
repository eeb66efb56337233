"""GPU placement: workers side by side on disjoint GPUs, runs queued until their GPUs are free.

The stub server stands in for vLLM and reports the CUDA_VISIBLE_DEVICES it was given.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.conftest import make_client, wait_finished, wait_for


def _spec(seqs: int, tp: int = 1) -> dict[str, Any]:
    return {"input_len": 8, "output_len": 40, "num_prompts": 4, "max_concurrency": 2,
            "engine": {"tensor_parallel_size": tp, "extra_args": [f"--max-num-seqs={seqs}"]}}


@pytest.fixture
def four_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.02")
    with make_client(tmp_path, gpus="0,1,2,3") as client:
        yield client


def test_runs_of_different_engines_run_side_by_side_on_disjoint_gpus(four_gpus: TestClient) -> None:
    client = four_gpus
    ids = [client.post("/api/runs", json=_spec(seqs, tp)).json()["id"]
           for seqs, tp in ((1, 1), (2, 2), (3, 1))]
    # All three are running at the same time: 1 + 2 + 1 GPUs fit in 4.
    for run_id in ids:
        wait_for(client, run_id, lambda r: r["status"] in ("running", "succeeded"))
    runs = [wait_finished(client, run_id) for run_id in ids]
    assert all(r["status"] == "succeeded" for r in runs)
    assert max(r["started_at"] for r in runs) < min(r["finished_at"] for r in runs)
    workers = {w["id"]: w for w in client.get("/api/workers").json()}
    gpu_sets = [set(workers[r["worker_id"]]["gpus"].split(",")) for r in runs]
    assert [len(g) for g in gpu_sets] == [1, 2, 1]
    assert len(set.union(*gpu_sets)) == 4  # disjoint
    for run in runs:
        seen = httpx.get(f"{workers[run['worker_id']]['url']}/stub/requests").json()
        assert seen["cuda_visible_devices"] == workers[run["worker_id"]]["gpus"]


def test_run_that_does_not_fit_waits_for_gpus(four_gpus: TestClient) -> None:
    client = four_gpus
    big = [client.post("/api/runs", json=_spec(seqs, 2)).json()["id"] for seqs in (1, 2)]
    waiting = client.post("/api/runs", json=_spec(3, 1)).json()["id"]
    wait_for(client, big[0], lambda r: r["status"] == "running")
    # While the first TP-2 run holds its two GPUs and the second is placed on the other
    # two, the TP-1 run has no GPU: it waits (checked by its start below, not by polling
    # its status, which races with the first run's end on a loaded machine).
    done = wait_finished(client, waiting)
    assert done["status"] == "succeeded"
    firsts = [wait_finished(client, run_id) for run_id in big]
    assert done["started_at"] >= min(r["finished_at"] for r in firsts)


def test_runs_of_one_engine_take_a_server_per_gpu_group_one_run_each_at_a_time(
        four_gpus: TestClient) -> None:
    client = four_gpus
    ids = [client.post("/api/runs", json=_spec(1, 2)).json()["id"] for _ in range(3)]
    runs = [wait_finished(client, run_id) for run_id in ids]
    assert all(r["status"] == "succeeded" for r in runs)
    # Two TP-2 servers fill the four GPUs; the third run waits for one of them.
    assert len({r["worker_id"] for r in runs}) == 2
    assert runs[0]["worker_id"] != runs[1]["worker_id"]
    assert max(r["started_at"] for r in runs[:2]) < min(r["finished_at"] for r in runs[:2])
    workers = {w["id"]: w for w in client.get("/api/workers").json()}
    assert sorted(w["gpus"] for w in workers.values()) == ["0,1", "2,3"]
    for worker_id in workers:
        spans = sorted((r["started_at"], r["finished_at"]) for r in runs if r["worker_id"] == worker_id)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_tensor_parallel_larger_than_the_gpus_fails_with_a_reason(four_gpus: TestClient) -> None:
    run = four_gpus.post("/api/runs", json=_spec(1, 8)).json()
    done = wait_finished(four_gpus, run["id"])
    assert done["status"] == "failed"
    assert "tensor_parallel_size 8" in done["error"] and "(4: 0,1,2,3)" in done["error"]


def test_the_least_recently_used_idle_worker_is_the_one_evicted(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.005")
    with make_client(tmp_path, gpus="0,1") as client:
        a1 = wait_finished(client, client.post("/api/runs", json=_spec(1)).json()["id"])
        b = wait_finished(client, client.post("/api/runs", json=_spec(2)).json()["id"])
        # Reusing A's worker makes it the most recently used, though it was started first.
        a2 = wait_finished(client, client.post("/api/runs", json=_spec(1)).json()["id"])
        assert a2["worker_id"] == a1["worker_id"]
        c = wait_finished(client, client.post("/api/runs", json=_spec(3)).json()["id"])
        assert all(r["status"] == "succeeded" for r in (a1, b, a2, c))
        workers = {w["id"]: w for w in client.get("/api/workers").json()}
        assert workers[b["worker_id"]]["status"] == "stopped"
        assert workers[a1["worker_id"]]["status"] == "ready"
        assert workers[c["worker_id"]]["gpus"] == workers[b["worker_id"]]["gpus"]


def test_the_runs_of_a_pair_run_back_to_back_on_one_server(four_gpus: TestClient) -> None:
    # With servers to spare, pairs run side by side, but the two runs of one pair never at
    # once: the second takes the server the first ran on, right after it.
    client = four_gpus
    body = {"base": {**_spec(1), "num_prompts": 2}, "grid": {"mode": ["fill", "prefill"]},
            "repeats": 3}
    sweep = client.post("/api/sweeps", json=body).json()
    runs = [wait_finished(client, r["id"]) for r in sweep["runs"]]
    assert all(r["status"] == "succeeded" for r in runs)
    pairs: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        pairs.setdefault(run["pair_id"], []).append(run)
    assert len(pairs) == 3
    for first, second in (sorted(p, key=lambda r: r["started_at"]) for p in pairs.values()):
        assert first["finished_at"] <= second["started_at"]
        assert first["worker_id"] == second["worker_id"]
    firsts = [min(p, key=lambda r: r["started_at"]) for p in pairs.values()]
    assert len({r["worker_id"] for r in firsts}) >= 2  # the pairs themselves side by side


def test_two_runs_starting_servers_of_one_model_each_name_their_own(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Two runs of one model at once, two GPUs: a server starts for each, and each run's wait
    # (its page, /live and the command line) names its own server, not the first one's.
    monkeypatch.setenv("STUB_STARTUP_DELAY_S", "4")
    with make_client(tmp_path, gpus="0,1") as client:
        ids = [client.post("/api/runs", json=_spec(1)).json()["id"] for _ in range(2)]
        for run_id in ids:
            wait_for(client, run_id, lambda r: r["status"] == "starting")
        named = {}
        for run_id in ids:
            live = client.get(f"/api/runs/{run_id}/live").json()
            found = re.search(r"starting vLLM server (w-\w+)", live["waiting"] or "")
            assert found, live
            named[run_id] = found[1]
        assert len(set(named.values())) == 2, named
        done = [wait_finished(client, run_id) for run_id in ids]
        assert {r["worker_id"] for r in done} == set(named.values())
