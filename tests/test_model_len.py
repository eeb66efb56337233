"""A run longer than its model takes is refused at submit, with the model's limit: read from
a local model's config.json as vLLM reads it, or ``engine.max_model_len``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service.core.modelconfig import ASSUMED_LEN, max_len_of
from service.core.spec import RunSpec

QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 1000,
        "max_position_embeddings": 32768}
SMALL = {"output_len": 128, "num_prompts": 2, "max_concurrency": 1}


def _model_dir(root: Path, config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None) -> str:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text("{}")
    if tokenizer_config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(root)


def _local(tmp_path: Path, **spec: Any) -> dict[str, Any]:
    model = _model_dir(tmp_path / "qwen", QWEN)
    engine = {"load_format": "dummy", **spec.pop("engine", {})}
    return {**SMALL, "model": model, "engine": engine, **spec}


def test_input_the_length_of_the_model_is_refused_naming_its_limit(client: TestClient,
                                                                   tmp_path: Path) -> None:
    # The case met: input 32768 on a model whose maximum is 32768 was queued, a server started,
    # then every request failed in vLLM.
    response = client.post("/api/runs", json=_local(tmp_path, input_len=32768))
    assert response.status_code == 422, response.text
    detail = json.dumps(response.json()["detail"])
    assert "32896 tokens" in detail and "max length 32768" in detail
    assert "max_position_embeddings" in detail
    assert client.get("/api/runs").json()["total"] == 0


def test_engine_max_model_len_is_the_limit_when_given(client: TestClient, tmp_path: Path) -> None:
    response = client.post("/api/runs", json=_local(tmp_path, input_len=8192,
                                                    engine={"max_model_len": 8192}))
    assert response.status_code == 422, response.text
    assert "max length 8192 (engine.max_model_len)" in json.dumps(response.json()["detail"])


def test_engine_max_model_len_above_the_model_is_refused(client: TestClient, tmp_path: Path) -> None:
    response = client.post("/api/runs", json=_local(tmp_path, input_len=1024,
                                                    engine={"max_model_len": 65536}))
    assert response.status_code == 422, response.text
    detail = json.dumps(response.json()["detail"])
    assert "engine.max_model_len 65536 is above the model's max length 32768" in detail


def test_a_sweep_with_a_point_too_long_is_refused_whole(client: TestClient, tmp_path: Path) -> None:
    base = _local(tmp_path, input_len=1024)
    response = client.post("/api/sweeps", json={"base": base, "grid": {"input_len": [1024, 32768]}})
    assert response.status_code == 422, response.text
    assert "max length 32768" in json.dumps(response.json()["detail"])
    assert client.get("/api/runs").json()["total"] == 0


def test_a_run_that_fits_is_accepted(tmp_path: Path) -> None:
    spec = RunSpec.model_validate(_local(tmp_path, input_len=32768 - 128))
    assert spec.longest_request_tokens() == 32768
    # As submitted to the API: the same fits there (a spec, not yet a run).
    with pytest.raises(ValidationError, match="max length 32768"):
        RunSpec.model_validate({**spec.model_dump(), "input_len": 32768 - 127})


@pytest.mark.parametrize(("config", "tokenizer", "tokens", "source"), [
    ({"max_position_embeddings": 4096}, None, 4096, "max_position_embeddings"),
    # The smallest of the keys; model_max_length wins over the others where set.
    ({"max_position_embeddings": 4096, "seq_length": 2048}, None, 2048, "seq_length"),
    ({"max_position_embeddings": 4096, "model_max_length": 8192}, None, 8192, "model_max_length"),
    # A smaller tokenizer limit is the limit.
    ({"max_position_embeddings": 4096}, {"model_max_length": 1024}, 1024, "tokenizer_config.json"),
    ({"max_position_embeddings": 4096}, {"model_max_length": 1e30}, 4096, "max_position_embeddings"),
    # A multimodal model's text config.
    ({"text_config": {"max_position_embeddings": 16384}}, None, 16384, "max_position_embeddings"),
    # Linear RoPE scaling stretches the length; llama3 and yarn configs are already stretched.
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, None,
     16384, "factor 4"),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, None,
     131072, "max_position_embeddings"),
    ({"model_type": "llama"}, None, ASSUMED_LEN, "vLLM assumes"),
])
def test_the_limit_is_read_as_vllm_reads_it(config: dict[str, Any], tokenizer: dict[str, Any] | None,
                                            tokens: int, source: str) -> None:
    found = max_len_of(config, tokenizer)
    assert found.tokens == tokens and source in found.source, found


def _hub_cache(root: Path, repo_id: str, config: dict[str, Any]) -> Path:
    """A Hugging Face cache in ``root`` holding a snapshot of ``repo_id`` (its config only)."""
    snapshot = root / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    return root


def test_a_cached_hub_model_is_held_to_its_config_too(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_cache(tmp_path / "hf", "acme/qwen-7b", QWEN)))
    too_long = client.post("/api/runs", json={**SMALL, "model": "acme/qwen-7b", "input_len": 32768})
    assert too_long.status_code == 422, too_long.text
    detail = json.dumps(too_long.json()["detail"])
    assert "acme/qwen-7b" in detail and "max length 32768" in detail
    sweep = client.post("/api/sweeps", json={"base": {**SMALL, "model": "acme/qwen-7b"},
                                             "grid": {"input_len": [1024, 40000]}})
    assert sweep.status_code == 422 and "max length 32768" in json.dumps(sweep.json()["detail"])
    assert client.get("/api/runs").json()["total"] == 0
