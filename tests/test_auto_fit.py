"""A run with no ``engine.max_model_len`` gets a server started with ``--max-model-len -1``
(vLLM fits the length to its KV cache memory); the length the server chose is kept on its
worker, and a run longer than it fails with the sums instead of sending requests vLLM
would cut short."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from fastapi.testclient import TestClient

from service.control.vllm_cli import engine_flags
from service.core.spec import EngineSpec, RunSpec, point_key
from service.core.tinymodel import TINY_MODEL_NAME
from tests.conftest import wait_finished

# The stub's KV cache: 64 blocks of 16 tokens. vLLM keeps one block back, so the longest
# request it fits is 63 * 16 tokens, far below the tiny model's own 131072.
KV = {"STUB_KV_BLOCKS": "64"}
FITTED = 1008
FITS = {"input_len": 512, "output_len": 128, "num_prompts": 2, "max_concurrency": 1}
LONG = {**FITS, "input_len": 1024}


def _too_long(worker_id: str) -> str:
    return (f"infeasible: input 1024 + output 128 = 1152 tokens > {FITTED}, the longest server "
            f"{worker_id} fits (vLLM auto-fit to its KV cache memory); lower input_len or "
            "output_len, or raise engine.gpu_memory_utilization")


def _flag(flags: list[str]) -> str:
    return flags[flags.index("--max-model-len") + 1]


def test_without_engine_max_model_len_vllm_is_told_to_fit_it() -> None:
    assert _flag(engine_flags(TINY_MODEL_NAME, EngineSpec(), on_cpu=True)) == "-1"
    assert _flag(engine_flags("org/model", EngineSpec(), on_cpu=False)) == "-1"
    assert _flag(engine_flags(TINY_MODEL_NAME, EngineSpec(max_model_len=4096), on_cpu=True)) == "4096"


def test_a_kv_cache_size_is_passed_as_bytes_and_replaces_the_cpu_share() -> None:
    cpu = engine_flags(TINY_MODEL_NAME, EngineSpec(kv_cache_gib=1.5), on_cpu=True)
    assert cpu[cpu.index("--kv-cache-memory-bytes") + 1] == str(3 << 29)
    assert "--gpu-memory-utilization" not in cpu  # vLLM would ignore it; it is not claimed
    shared = engine_flags(TINY_MODEL_NAME, EngineSpec(), on_cpu=True)
    assert "--kv-cache-memory-bytes" not in shared
    assert shared[shared.index("--gpu-memory-utilization") + 1] == "0.3"
    # A server of its own (another KV cache), while runs that leave it unset keep the key
    # servers and runs had before the field existed.
    sized, plain = RunSpec(engine=EngineSpec(kv_cache_gib=1.5)), RunSpec()
    assert sized.worker_key() != plain.worker_key() and "kv_cache_gib" not in plain.worker_key()
    assert point_key(sized.model_dump()) != point_key(plain.model_dump())


def test_a_run_longer_than_its_new_server_fits_fails_and_leaves_the_server_idle(
        stub_service: Callable[..., TestClient]) -> None:
    client = stub_service(env=KV)
    long = wait_finished(client, client.post("/api/runs", json=LONG).json()["id"])
    [worker] = client.get("/api/workers").json()
    assert long["status"] == "failed"
    assert long["error"] == _too_long(worker["id"])
    assert long["worker_id"] == worker["id"]  # a server was started for it, then found short
    assert worker["status"] == "ready" and worker["max_model_len"] == FITTED
    seen = httpx.get(f"{worker['url']}/stub/requests").json()
    assert seen["max_model_len_flag"] == -1
    assert seen["requests"] == 0  # not one request of the long run was sent

    fits = wait_finished(client, client.post("/api/runs", json=FITS).json()["id"])
    assert fits["status"] == "succeeded", fits["error"]
    assert fits["worker_id"] == worker["id"]
    assert httpx.get(f"{worker['url']}/stub/requests").json()["requests"] == 2


def test_a_queued_run_longer_than_its_kinds_server_fails_at_placement(
        stub_service: Callable[..., TestClient]) -> None:
    client = stub_service(env=KV)
    fits = wait_finished(client, client.post("/api/runs", json=FITS).json()["id"])
    assert fits["status"] == "succeeded", fits["error"]
    [worker] = client.get("/api/workers").json()
    assert worker["max_model_len"] == FITTED

    long = wait_finished(client, client.post("/api/runs", json=LONG).json()["id"])
    assert long["status"] == "failed"
    assert long["error"] == _too_long(worker["id"])
    assert long["worker_id"] is None  # failed before any server was given to it
    assert httpx.get(f"{worker['url']}/stub/requests").json()["requests"] == 2


def test_the_fitted_length_is_shown_with_the_servers_facts(
        stub_service: Callable[..., TestClient]) -> None:
    client = stub_service(env=KV)
    run = wait_finished(client, client.post("/api/runs", json=FITS).json()["id"])
    worker_id = run["worker_id"]
    assert client.get(f"/api/workers/{worker_id}").json()["max_model_len"] == FITTED
    servers: list[dict[str, Any]] = [s for n in client.get("/api/cluster").json()["nodes"]
                                     for s in n["servers"]]
    assert [(s["id"], s["max_model_len"]) for s in servers] == [(worker_id, FITTED)]
    row = client.get("/").text.split(f"<code>{worker_id}</code>")[1].split("</tr>")[0]
    assert f'<td class="num max-len">{FITTED}</td>' in row
    # What the server's connector reported of its engine says the same.
    assert run["provenance"]["engine"]["max_model_len"] == FITTED


def test_a_given_engine_max_model_len_is_passed_as_it_is(
        stub_service: Callable[..., TestClient]) -> None:
    client = stub_service(env=KV)
    run = wait_finished(client, client.post(
        "/api/runs", json={**FITS, "engine": {"max_model_len": 800}}).json()["id"])
    assert run["status"] == "succeeded", run["error"]
    worker = client.get(f"/api/workers/{run['worker_id']}").json()
    assert worker["max_model_len"] == 800
    assert httpx.get(f"{worker['url']}/stub/requests").json()["max_model_len_flag"] == 800


def test_a_sweep_point_longer_than_its_server_fits_counts_as_infeasible(
        stub_service: Callable[..., TestClient]) -> None:
    client = stub_service(env=KV)
    sweep = client.post("/api/sweeps", json={"base": FITS, "grid": {"input_len": [512, 1024]}}).json()
    fits, long = (wait_finished(client, r["id"]) for r in sweep["runs"])
    assert fits["status"] == "succeeded", fits["error"]
    assert long["status"] == "failed" and long["error"] == _too_long(fits["worker_id"])
    assert client.get(f"/api/sweeps/{sweep['id']}").json()["progress"]["infeasible"] == 1
