"""Mode ``seeded`` end to end: a real vLLM (CPU) server on the tiny model, through the service.

One service process for the module; its first run starts the server, the others reuse it.
What is checked comes from the server's own prefix-cache counters (the run's proof and the
server metrics the service scraped around the measured requests).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import wait_finished

pytestmark = pytest.mark.e2e

POINT = {"input_len": 4096, "output_len": 16, "num_prompts": 8, "seed": 7}


@pytest.fixture(scope="module")
def service(real_tiny_service: httpx.Client) -> httpx.Client:
    return real_tiny_service  # one service and tiny server for the tiny model's e2e modules


def _run(client: httpx.Client, **spec: Any) -> dict[str, Any]:
    response = client.post("/api/runs", json=spec)
    assert response.status_code == 201, response.text
    return wait_finished(client, response.json()["id"], timeout=600)


def _ok(client: httpx.Client, **spec: Any) -> dict[str, Any]:
    run = _run(client, **spec)
    assert run["status"] == "succeeded", run["error"]
    return run


def _most_hits(length: int, block: int) -> int:
    return (length - 1) // block * block


@pytest.fixture(scope="module")
def first_seeded(service: httpx.Client) -> dict[str, Any]:
    return _ok(service, mode="seeded", max_concurrency=4, **POINT)


def test_every_measured_request_hits_its_whole_prompt_but_the_last_block(
        service: httpx.Client, first_seeded: dict[str, Any]) -> None:
    seeding = first_seeded["summary"]["seeding"]
    block = seeding["block_size"]
    # The seeding pass prefilled all eight prompts; nothing was cached before.
    assert seeding["prompts"] == 8 and seeding["prompt_tokens"] == 8 * 4096
    assert seeding["reused"] is False and seeding["reused_tokens"] == 0
    assert seeding["seconds"] > 0
    # Over the measured requests, the server's own counters: queried exactly the run's
    # prompts, and hit every one of them for all but its last block.
    measured = seeding["measured"]
    assert measured["queries"] == 8 * 4096
    assert measured["hits"] == 8 * _most_hits(4096, block)
    assert seeding["proven"] is True
    view = service.get(f"/api/runs/{first_seeded['id']}/server-metrics").json()
    deltas = view["summary"]["deltas"]
    assert deltas["vllm:prefix_cache_hits"] == 8 * _most_hits(4096, block)
    # The connector did not fill: it left each request (seeding and measured) to vLLM.
    connector = first_seeded["connector"]
    assert connector["filled_requests"] == 0 and connector["prefill_requests"] == 8
    assert connector["seeding_requests"] == 8
    assert "foreign_prefix_hits" not in {w["code"] for w in first_seeded["warnings"]}
    page = service.get(f"/runs/{first_seeded['id']}").text
    assert "Seeding" in page and "every measured request" in page
    # The tiny model is a dense Llama: a dummy fill would have been neutral for it.
    assert first_seeded["summary"]["fill_neutrality"] == {"neutral": True, "reasons": []}
    assert "Dummy KV fill for this model: <strong>neutral</strong>" in page


def test_a_second_run_of_the_same_point_reuses_the_seed_set(
        service: httpx.Client, first_seeded: dict[str, Any]) -> None:
    # Another concurrency, the same prompts (model, engine, input length, seed).
    second = _ok(service, mode="seeded", max_concurrency=1, **POINT)
    seeding = second["summary"]["seeding"]
    block = seeding["block_size"]
    assert seeding["cache_salt"] == first_seeded["summary"]["seeding"]["cache_salt"]
    # The seeding pass found every prompt cached: no second prefill, by the counters.
    assert seeding["reused"] is True
    assert seeding["reused_tokens"] == 8 * _most_hits(4096, block)
    assert seeding["measured"]["hits"] == 8 * _most_hits(4096, block)
    # Another seed: another seed set, seeded afresh.
    other = _ok(service, mode="seeded", max_concurrency=4, **{**POINT, "seed": 8})
    assert other["summary"]["seeding"]["reused"] is False


def test_seeded_ttft_is_a_fill_runs_not_a_prefill_runs(
        service: httpx.Client, first_seeded: dict[str, Any]) -> None:
    point = {**POINT, "max_concurrency": 1, "input_len": 16384, "num_prompts": 6, "seed": 11}
    seeded = _ok(service, mode="seeded", **point)["summary"]["median_ttft_ms"]
    fill = _ok(service, mode="fill", **point)["summary"]["median_ttft_ms"]
    prefill = _ok(service, mode="prefill", **point)["summary"]["median_ttft_ms"]
    assert prefill > 2 * fill, (fill, prefill)
    assert abs(seeded - fill) < abs(seeded - prefill), (seeded, fill, prefill)


def test_a_seed_set_larger_than_the_kv_cache_fails_with_the_arithmetic(
        service: httpx.Client, first_seeded: dict[str, Any]) -> None:
    kv_tokens = first_seeded["provenance"]["kv_cache_tokens"]
    input_len = 16384
    prompts = kv_tokens // input_len + 2
    run = _run(service, mode="seeded", input_len=input_len, output_len=1, num_prompts=prompts,
               max_concurrency=1)
    assert run["status"] == "failed"
    assert "the seed set does not fit" in run["error"]
    assert f"the KV cache holds {kv_tokens:,} tokens" in run["error"]
    # Refused before a request was sent.
    assert run["progress"]["completed"] == 0
