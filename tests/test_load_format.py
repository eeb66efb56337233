"""Dummy weights (``engine.load_format: "dummy"``): a decode curve of any model from its
config.json and tokenizer alone. Validation, the server's command line and key, the MoE
warning, and what the page and the export say about the weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlmodel import Session

from service.analysis.checks import dummy_moe, num_experts
from service.analysis.metrics import summarize
from service.control.vllm_cli import engine_flags
from service.core.ids import new_id
from service.core.sample import Sample
from service.core.spec import EngineSpec, RunSpec
from service.core.status import RunStatus
from service.core.tinymodel import TINY_MODEL_NAME
from service.storage import measurements
from service.storage.tables import Run
from tests.conftest import FINISHED, wait_for

SMALL = {"input_len": 16, "output_len": 4, "num_prompts": 3, "max_concurrency": 3}
DENSE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 1000,
           "num_local_experts": 8, "num_experts_per_tok": 2}


def _model_dir(root: Path, config: dict[str, Any], *files: str) -> str:
    """A local model directory with a config.json, a tokenizer and the given files."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text("{}")
    for name in files:
        (root / name).write_bytes(b"\0")
    return str(root)


def _load_format_flag(flags: list[str]) -> str | None:
    return flags[flags.index("--load-format") + 1] if "--load-format" in flags else None


# ------------------------------------------------------------------ validation


def test_dummy_weights_run_a_model_directory_without_weight_files(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "llama-70b", DENSE)
    spec = RunSpec(model=model, engine=EngineSpec(load_format="dummy"))
    assert spec.engine.load_format == "dummy"


def test_real_weights_need_weight_files_in_a_model_directory(client: TestClient,
                                                              tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "llama-70b", DENSE)
    response = client.post("/api/runs", json={**SMALL, "model": model})
    assert response.status_code == 422
    detail = json.dumps(response.json()["detail"])
    assert "has no weight files" in detail and model in detail
    assert 'load_format \\"dummy\\" runs it without them' in detail


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model-00001-of-00002.bin",
                                     "consolidated.00.pt"])
def test_real_weights_run_a_model_directory_with_weight_files(tmp_path: Path, weights: str) -> None:
    model = _model_dir(tmp_path / "llama-8b", DENSE, weights)
    assert RunSpec(model=model).engine.load_format == "auto"


def test_the_bundled_tiny_model_needs_no_weights_whatever_is_asked() -> None:
    for load_format in ("auto", "dummy"):
        spec = RunSpec(model=TINY_MODEL_NAME, engine=EngineSpec(load_format=load_format))
        assert _load_format_flag(engine_flags(spec.model, spec.engine, on_cpu=True)) == "dummy"


def test_an_unknown_load_format_is_refused() -> None:
    with pytest.raises(ValidationError, match="'auto' or 'dummy'"):
        EngineSpec.model_validate({"load_format": "safetensors"})


# ------------------------------------------------------------------ the server


def test_engine_flags_load_dummy_weights_when_asked() -> None:
    dummy = engine_flags("meta-llama/Llama-3.1-70B", EngineSpec(load_format="dummy"), on_cpu=False)
    real = engine_flags("meta-llama/Llama-3.1-70B", EngineSpec(), on_cpu=False)
    tiny = engine_flags(TINY_MODEL_NAME, EngineSpec(), on_cpu=True)
    assert _load_format_flag(dummy) == "dummy"
    assert _load_format_flag(real) is None  # vLLM's own default: the real weights
    assert _load_format_flag(tiny) == "dummy"


def test_runs_with_dummy_and_real_weights_never_share_a_server() -> None:
    hub = "meta-llama/Llama-3.1-70B"
    dummy = RunSpec(model=hub, engine=EngineSpec(load_format="dummy"))
    real = RunSpec(model=hub, engine=EngineSpec(load_format="auto"))
    assert dummy.worker_key() != real.worker_key()
    # The tiny model loads dummy weights either way: one server serves both.
    assert (RunSpec(engine=EngineSpec(load_format="dummy")).worker_key()
            == RunSpec(engine=EngineSpec(load_format="auto")).worker_key())


def test_the_worker_key_of_real_weights_is_the_key_from_before_load_format() -> None:
    """Registered servers keep their stored key across an upgrade."""
    before = json.dumps({"model": "org/m", "engine": {
        "tensor_parallel_size": 1, "max_model_len": None, "dtype": None,
        "gpu_memory_utilization": None, "extra_args": []}}, sort_keys=True)
    assert RunSpec(model="org/m").worker_key() == before


def test_a_registered_server_for_dummy_weights_is_told_to_load_them(client: TestClient) -> None:
    body = {"url": "http://127.0.0.1:9", "model": "acme/moe-big", "engine": {"load_format": "dummy"}}
    response = client.post("/api/workers", json=body)
    assert response.status_code == 201, response.text
    assert "--load-format dummy" in response.json()["vllm_serve"]
    real = client.post("/api/workers", json={**body, "url": "http://127.0.0.1:10", "engine": {}})
    assert "--load-format" not in real.json()["vllm_serve"]


def test_a_dummy_moe_run_is_served_dummy_weights_and_warned(client: TestClient, tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "mixtral", MIXTRAL)
    run = client.post("/api/runs", json={**SMALL, "model": model,
                                         "engine": {"load_format": "dummy"}}).json()
    done = wait_for(client, run["id"], lambda r: r["status"] in FINISHED)
    assert done["status"] == "succeeded", done["error"]
    warning = next(w for w in done["warnings"] if w["code"] == "dummy_moe_routing")
    assert warning["figure"] == 8 and "routing" in warning["message"]
    worker = client.get(f"/api/workers/{done['worker_id']}").json()
    argv = Path(f"/proc/{worker['pid']}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--load-format") + 1] == b"dummy"


# ------------------------------------------------------------------ the MoE warning (pure)


@pytest.mark.parametrize(("config", "experts"), [
    (MIXTRAL, 8),
    ({"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4}, 60),
    ({"model_type": "deepseek_v3", "n_routed_experts": 256}, 256),
    ({"model_type": "dbrx", "moe_num_experts": 16}, 16),
    ({"model_type": "llama4", "text_config": {"num_local_experts": 16}}, 16),
    ({"model_type": "nemotron_h", "block_configs": [{"block_type": "mamba"},
                                                    {"block_type": "moe", "n_routed_experts": 128}]}, 128),
    (DENSE, 0),
    ({"model_type": "qwen3", "num_experts": 0}, 0),
])
def test_num_experts_reads_the_names_vllm_reads(config: dict[str, Any], experts: int) -> None:
    assert num_experts(config) == experts


def test_dummy_weights_on_a_moe_model_warn_that_routing_is_not_the_real_one() -> None:
    [warning] = dummy_moe("dummy", MIXTRAL)
    assert warning["code"] == "dummy_moe_routing" and warning["figure"] == 8
    assert "not the real model's routing" in warning["message"]
    assert dummy_moe("auto", MIXTRAL) == []  # real weights route for real
    assert dummy_moe("dummy", DENSE) == []
    assert dummy_moe("dummy", None) == []  # a hub model's config is not here to read


# ------------------------------------------------------------------ page and export


def _stored_run(client: TestClient, spec: dict[str, Any]) -> str:
    """A succeeded run with its spec stored as given, written straight to the database."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    samples = [Sample(index=i, prompt_len=16, output_tokens=4, ttft=0.1, itl=[0.1] * 3,
                      latency=0.4, start_time=100.0 + i, success=True) for i in range(2)]
    run = Run(id=new_id("r"), spec=spec, model=spec["model"], status=RunStatus.succeeded.value,
              total=2, completed=2, summary=summarize(samples, 2.0, {}))
    with Session(engine, expire_on_commit=False) as session:
        session.add(run)
        session.commit()
    measurements.save_samples(engine, run.id, samples)
    return run.id


def test_run_page_says_the_weights_were_dummy(client: TestClient) -> None:
    spec = RunSpec(model="acme/moe-big", engine=EngineSpec(load_format="dummy")).model_dump()
    html = client.get(f"/runs/{_stored_run(client, spec)}").text
    assert "Weights: <strong>dummy</strong> (random values; decode speed depends on the " \
           "architecture, not the weights)" in html


def test_run_page_says_the_tiny_model_ran_on_dummy_weights_and_a_hub_model_on_real(
    client: TestClient,
) -> None:
    tiny = _stored_run(client, RunSpec().model_dump())
    assert "Weights: <strong>dummy</strong>" in client.get(f"/runs/{tiny}").text
    old = RunSpec(model="acme/dense").model_dump()
    del old["engine"]["load_format"]  # stored before the field existed
    html = client.get(f"/runs/{_stored_run(client, old)}").text
    assert 'id="weights">Weights: real</p>' in html


def test_vllm_export_carries_the_effective_load_format(client: TestClient) -> None:
    tiny = _stored_run(client, RunSpec().model_dump())
    real = _stored_run(client, RunSpec(model="acme/dense").model_dump())
    for run_id, expected in ((tiny, "dummy"), (real, "auto")):
        exported = client.get(f"/api/runs/{run_id}/export?format=vllm").json()
        assert exported["decodebench"]["load_format"] == expected
