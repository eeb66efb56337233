"""Each bundled architecture family end to end on a real vLLM (CPU) server, reduced in depth.

One service process for the module. Per family: a fill run succeeds with the connector's
account whole (every request filled; per KV cache group the blocks expected, a sliding
window group only its window's), its greedy tokens equal those of vLLM's own
``DecodeBenchConnector`` on the same prompts (a plain vLLM server the test starts on the
same model files), and a prefill run on the same server succeeds. Families run one after
the other: on a CPU the service keeps one server and stops the idle one for the next.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.core import shapes
from service.core.spec import RunSpec
from service.load.plan import make_plan
from tests.conftest import wait_finished, wait_for
from tests.vllm_process import real_service, start_vllm, stop, wait_healthy

pytestmark = pytest.mark.e2e

INPUT_LEN = 2048
OUTPUT_LEN = 8
PROMPTS = 3
FILL_MEAN = 0.7

# (shape, layers, engine overrides): the fewest layers that keep every kind of layer the
# family has; bfloat16 halves the memory of the large vocabularies.
# Gemma comes last: the startup-fill test after these runs its per-request fill on the server
# gemma's test leaves, and starts only the server with the startup fill.
FAMILIES = [
    ("smollm2-135m", 2, {}),
    ("qwen2.5-0.5b", 2, {}),
    ("granite-4.0-h-350m", 4, {}),
    # One MoE layer of 128 experts is 0.6 B parameters: the default share of the machine
    # would leave it no KV cache, so the cache's own size is given (it needs only itself
    # free beside the model, where a share must hold both).
    ("qwen3-30b-a3b", 1, {"kv_cache_gib": 1.0}),
    # Multi-head latent attention: one latent tensor a layer (vLLM's CPU_MLA backend).
    ("deepseek-v2-lite", 2, {}),
    ("gemma-3-1b", 6, {}),
]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with real_service(tmp_path_factory.mktemp("shapes") / "var") as client:
        yield client


def _spec(name: str, layers: int, engine: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": shapes.PREFIX + name, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
            "num_prompts": PROMPTS, "max_concurrency": 1, "seed": 5,
            "engine": {"num_layers": layers, "dtype": "bfloat16", **engine}, **extra}


def _run(client: httpx.Client, spec: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/api/runs", json=spec)
    assert response.status_code == 201, response.text
    done = wait_finished(client, response.json()["id"], timeout=900)
    assert done["status"] == "succeeded", done["error"]
    return done


def _texts(client: httpx.Client, run_id: str) -> list[str]:
    samples = client.get(f"/api/runs/{run_id}/requests").json()
    return [s["generated_text"] for s in sorted(samples, key=lambda s: s["index"])]


def _start_reference(model_dir: Path, served: str, log_path: Path,
                     *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """A plain vLLM server with vLLM's own DecodeBenchConnector, starting (not yet ready): it
    starts while the service's server runs the fill, as a second server start is most of a
    family's time."""
    config = json.dumps({"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": {"fill_mean": FILL_MEAN, "fill_std": 0.0}})
    return start_vllm(model_dir, log_path, "--kv-transfer-config", config, *extra, served_name=served,
                      dtype="bfloat16", kv_bytes=1 << 29)


def _reference_texts(proc: subprocess.Popen[bytes], url: str, model_dir: Path, served: str,
                     spec: dict[str, Any], log_path: Path) -> list[str]:
    """What vLLM's own DecodeBenchConnector generates, greedily, for the run's prompts, from
    the server ``_start_reference`` started; stopped after."""
    try:
        wait_healthy(proc, url, log_path)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        plan = make_plan(RunSpec(**spec), vocab)
        texts = []
        for position in range(plan.warmups, len(plan.input_lens)):
            body = {"model": served, "prompt": plan.prompt(position), "temperature": 0.0,
                    "max_tokens": int(plan.output_lens[position]), "ignore_eos": True}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        return texts
    finally:
        stop(proc)


def _expected_blocks(group: dict[str, Any]) -> tuple[int, int]:
    """The fewest and most blocks the connector should fill in a group over the run."""
    filled_tokens = INPUT_LEN - 1  # every prompt token but the last, which decode computes
    size = int(group["block_size"])
    if group["kind"] in ("FullAttention", "MLAAttention"):
        blocks = math.ceil(filled_tokens / size)
        return PROMPTS * blocks, PROMPTS * blocks
    if group["kind"] == "SlidingWindow":
        # Only the blocks the window still reaches; the ones before it are vLLM's null block.
        window = int(group["sliding_window"])
        return PROMPTS, PROMPTS * (math.ceil(window / size) + 1)
    # A state group (Mamba): the request's own state block(s).
    return PROMPTS, PROMPTS * math.ceil(filled_tokens / size)


def filled_groups(client: httpx.Client, fill: dict[str, Any]) -> tuple[set[str], list[dict[str, Any]]]:
    """Assert a fill run's connector account is whole: every request filled, none other,
    and in each KV cache group the blocks its requests hold (``_expected_blocks``), filled
    per request; the kinds of its groups and the groups, for the caller's family check."""
    report = wait_for(client, fill["id"], lambda r: r["connector"].get("requests_filled") == PROMPTS,
                      timeout=15)["connector"]
    assert report["filled_requests"] == PROMPTS and report["other_requests"] == 0
    groups = fill["provenance"]["kv_cache_groups"]
    assert groups, "the connector described the server's KV cache groups"
    for group in groups:
        assert group["fill"] == "per request"
        low, high = _expected_blocks(group)
        got = report["group_blocks"].get(str(group["index"]), 0)
        assert low <= got <= high, (group, got)
    return {g["kind"] for g in groups}, groups


def prefills_on_its_server(client: httpx.Client, spec: dict[str, Any], fill: dict[str, Any]) -> None:
    """Assert a prefill run of ``spec`` runs on the fill run's server and the connector
    filled nothing of it."""
    prefill = _run(client, {**spec, "mode": "prefill", "seed": 6})
    assert prefill["worker_id"] == fill["worker_id"]  # one server for both modes
    report = wait_for(client, prefill["id"],
                      lambda r: r["connector"].get("prefill_requests") == PROMPTS, timeout=15)["connector"]
    assert report["filled_requests"] == 0 and report["requests_filled"] == 0


@pytest.mark.parametrize(("name", "layers", "engine"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_family_fills_like_vllm_and_prefills_on_one_server(
    service: httpx.Client, tmp_path: Path, name: str, layers: int, engine: dict[str, Any]
) -> None:
    spec = _spec(name, layers, engine, fill={"mean": FILL_MEAN, "std": 0.0})
    model_dir = shapes.ensure_shape(tmp_path / "models", spec["model"], layers)
    reference, url = _start_reference(model_dir, spec["model"], tmp_path / "upstream.log")
    try:
        fill = _run(service, spec)
        kinds, _ = filled_groups(service, fill)
        shape = shapes.shape_of(spec["model"])
        if shape.family == "sliding-window":
            assert kinds == {"FullAttention", "SlidingWindow"}
        elif shape.family == "mamba-hybrid":
            assert "FullAttention" in kinds and any("Mamba" in k for k in kinds)
        elif shape.family == "mla":
            assert kinds == {"MLAAttention"}
        else:
            assert kinds == {"FullAttention"}

        expected = _reference_texts(reference, url, model_dir, spec["model"], spec, tmp_path / "upstream.log")
    finally:
        stop(reference)  # stopped already unless an assertion above failed
    assert _texts(service, fill["id"]) == expected
    prefills_on_its_server(service, spec, fill)


def test_startup_fill_writes_nothing_per_request_and_decodes_what_a_per_request_fill_does(
    service: httpx.Client,
) -> None:
    spec = _spec("gemma-3-1b", 6, {}, seed=9, fill={"mean": FILL_MEAN, "std": 0.0})
    per_request = _run(service, spec)
    at_start = _run(service, {**spec, "fill": {"mean": FILL_MEAN, "std": 0.0, "startup": True}})
    assert at_start["worker_id"] != per_request["worker_id"]  # a server property: its own server
    groups = at_start["provenance"]["kv_cache_groups"]
    assert {g["kind"] for g in groups} == {"FullAttention", "SlidingWindow"}
    assert all(g["fill"] == "at start" for g in groups)
    assert at_start["provenance"]["fill"]["startup"] is True
    report = wait_for(service, at_start["id"], lambda r: r["connector"].get("requests_filled") == PROMPTS,
                      timeout=15)["connector"]
    assert report["filled_requests"] == PROMPTS and report["other_requests"] == 0
    assert report["blocks_filled"] == 0 and report["bytes_filled"] == 0
    # A fresh server hands out blocks no request wrote yet: they hold the startup values.
    assert _texts(service, at_start["id"]) == _texts(service, per_request["id"])
