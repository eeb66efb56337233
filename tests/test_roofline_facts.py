"""The decode roofline's facts the connector reports: parameters read per step, KV bytes
per token in every cache layout, the measured bandwidth, and how the service keeps them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.core.protocol import WorkerProvenance
from service.core.spec import RunSpec
from service.core.status import RunStatus
from service.core.tinymodel import ensure_tiny_model
from service.storage import store, workers
from service.storage.db import make_engine
from service.storage.tables import Worker
from tests.lazy import Lazy
from tests.test_provenance import SMALL, TOKEN, ProvenanceSink

# Imported at the first test that runs here (``tests.lazy``): collection needs none of them.
torch = Lazy("torch")
transformers = Lazy("transformers")
roofline = Lazy("connector.roofline")
connector_worker = Lazy("connector.worker")
h = Lazy("tests.vllm_harness")

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _config(tmp_path: Path, content: dict[str, Any]) -> Any:
    (tmp_path / "config.json").write_text(json.dumps(content))
    return transformers.AutoConfig.from_pretrained(tmp_path)


def test_llama_31_8b_streams_all_but_its_embedding_table(tmp_path: Path) -> None:
    assert roofline.streamed_params(_config(tmp_path, LLAMA_31_8B)) == 7_504_924_672


def _tiny_by_hand() -> int:
    """The tiny model's streamed parameters, from its config (``service.core.tinymodel``)."""
    hidden, inter, layers, heads, kv_heads, head_dim, vocab = 128, 256, 2, 4, 2, 32, 8192
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * inter  # gate, up, down
    norms = 2 * hidden  # input and post-attention RMSNorm
    per_layer = attention + mlp + norms  # 16384 + 16384 + 16384 + 98304 + 256 = 147712
    head = vocab * hidden  # 1048576; tied or not, this matrix is read once per step
    final_norm = hidden
    return layers * per_layer + final_norm + head  # 295424 + 128 + 1048576


def test_the_tiny_model_streams_what_its_config_adds_up_to(tmp_path: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(ensure_tiny_model(tmp_path))
    assert _tiny_by_hand() == 1_344_128
    assert roofline.streamed_params(config) == 1_344_128


def test_a_tied_embedding_is_counted_once_as_the_head(tmp_path: Path) -> None:
    content = json.loads((ensure_tiny_model(tmp_path) / "config.json").read_text())
    (tmp_path / "tied").mkdir()
    config = _config(tmp_path / "tied", {**content, "tie_word_embeddings": True})
    assert roofline.streamed_params(config) == _tiny_by_hand() == 1_344_128


# Llama-3.1-8B on one rank in bfloat16: 32 layers x (K, V) x 8 KV heads x 128 x 2 bytes.
LLAMA_KV = 32 * 2 * 8 * 128 * 2
BLOCKS, BLOCK = 6, 16


def _layers(shape: tuple[int, ...], n: int = 32) -> dict[str, Any]:
    return {f"layer{i}": torch.empty(shape, dtype=torch.bfloat16, device="meta") for i in range(n)}


@pytest.mark.parametrize("shape", [
    (2, BLOCKS, BLOCK, 8, 128),  # FlashAttention: K and V first
    (BLOCKS, 2, BLOCK, 8, 128),  # FlashInfer: blocks first
    (2, BLOCKS, 8, BLOCK, 128),  # heads before tokens (the CPU backend)
    (BLOCKS * 2, 2, BLOCK // 2, 8, 128),  # split into kernel blocks of half the size
])
def test_kv_bytes_per_token_is_the_same_in_every_layout(shape: tuple[int, ...]) -> None:
    caches = _layers(shape)
    assert LLAMA_KV == 131_072
    assert roofline.kv_bytes_per_token(caches, dict.fromkeys(caches, BLOCK), BLOCKS) == 131_072


def test_an_mla_latent_is_one_tensor_per_layer() -> None:
    # DeepSeek-V3: 61 layers, a latent of 512 + 64 rope dims, one per token, bfloat16.
    caches = _layers((BLOCKS, BLOCK, 576), n=61)
    assert roofline.kv_bytes_per_token(caches, dict.fromkeys(caches, BLOCK), BLOCKS) == 61 * 576 * 2


def test_a_hybrid_model_counts_its_attention_layers_not_its_states() -> None:
    caches: dict[str, Any] = _layers((2, BLOCKS, 2 * BLOCK, 8, 128), n=4)
    caches["mamba0"] = [torch.empty((BLOCKS, 64, 128), device="meta"),
                        torch.empty((BLOCKS, 4, 256), device="meta")]
    sizes = {f"layer{i}": 2 * BLOCK for i in range(4)}
    assert roofline.kv_bytes_per_token(caches, sizes, BLOCKS) == 4 * 2 * 8 * 128 * 2


def test_a_tensor_that_is_not_whole_blocks_is_refused() -> None:
    caches = {"layer0": torch.empty((BLOCKS, 2, 7), dtype=torch.uint8, device="meta")}
    with pytest.raises(ValueError, match="84 bytes is not 6 blocks of 16 tokens"):
        roofline.kv_bytes_per_token(caches, {"layer0": BLOCK}, BLOCKS)


def test_bandwidth_on_a_cpu_is_measured_and_has_no_rating() -> None:
    found = roofline.bandwidth("cpu")
    assert found["measured_bytes_per_s"] > 0 and found["fill_bytes_per_s"] > 0
    assert found["how"] == "copy of 64 MiB on cpu, best of 5"
    assert found["spec_bytes_per_s"] is None and found["spec_how"] is None


def test_the_worker_side_reports_the_tiny_models_roofline(tmp_path: Path) -> None:
    sink = ProvenanceSink()
    try:
        kv = h.kv_config([(["layer0", "layer1"], h.attention(BLOCK))], num_blocks=BLOCKS)
        config = h.vllm_config(tmp_path, h.OURS, {"control_url": sink.url})
        worker = connector_worker.FillConnectorWorker(config, kv)
        assert connector_worker.attention_block_sizes(kv) == {"layer0": BLOCK, "layer1": BLOCK}
        # The CPU backend's layout: (K and V, blocks, KV heads, tokens, head dim).
        worker.register_kv_caches({n: torch.zeros((2, BLOCKS, 2, BLOCK, 32)) for n in ("layer0", "layer1")})
        worker.shutdown()
    finally:
        sink.server.shutdown()
        sink.server.server_close()
    ((_auth, report),) = sink.reports
    assert set(report) == {"roofline"}
    facts = report["roofline"]
    assert facts["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4 == 1024  # layers, K+V, heads, dim, fp32
    assert facts["weight_params"] == 1_344_128
    assert facts["weight_bytes"] == 1_344_128 * 4
    assert (facts["kv_dtype"], facts["weight_dtype"], facts["tensor_parallel_size"]) == (
        "float32", "float32", 1)
    assert facts["bandwidth"]["measured_bytes_per_s"] > 0
    assert facts["device"].startswith("cpu")


def test_the_service_merges_both_sides_parts_into_the_runs_provenance(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "db.sqlite3")
    try:
        run, _ = store.create_run(engine, RunSpec(**SMALL))
        workers.add_worker(engine, Worker(
            id="w-1", key="k", model=run.model, engine={}, url="http://127.0.0.1:1", port=1,
            token_hash=workers.hash_token(TOKEN), log_path="/dev/null"))
        assert store.transition(engine, run.id, RunStatus.starting)
        store.update_fields(engine, run.id, worker_id="w-1")
        store.snapshot_provenance(engine, run.id, "w-1", "dummy", None, {})
        store.record_drivers(engine, run.id, [{"shard": 0}])
        facts = {"weight_bytes": 10, "weight_params": 5, "kv_bytes_per_token": 1024, "kv_dtype": "bfloat16",
                 "weight_dtype": "bfloat16", "tensor_parallel_size": 1, "device": "cpu",
                 "bandwidth": {"measured_bytes_per_s": 1e10, "how": "copy", "fill_bytes_per_s": 5e9,
                               "spec_bytes_per_s": None, "spec_how": None}}
        # The worker side's part first, then the scheduler side's, as the service gets them.
        for part in (WorkerProvenance(roofline=facts),
                     WorkerProvenance(engine={"dtype": "float32"})):
            workers.record_worker_provenance(engine, "w-1", part.model_dump(exclude_unset=True))
        row = workers.get_worker(engine, "w-1")
        assert row.provenance is not None
        assert row.provenance["reported"]["roofline"] == facts
        assert row.provenance["reported"]["engine"] == {"dtype": "float32"}
        recorded = store.get_run(engine, run.id).provenance
        assert recorded is not None
        assert recorded["roofline"] == facts and recorded["engine"] == {"dtype": "float32"}
        assert recorded["drivers"] == [{"shard": 0}]
    finally:
        engine.dispose()
