"""Each attention family's roofline facts against a count by hand from its published config:
the parameters a decode step streams, the KV bytes one token of context takes, what windowed
layers and per-sequence state change in a step's bytes, and what one GPU holds under tensor
parallelism. The KV tensors are meta tensors laid out as vLLM allocates them (no memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.analysis.roofline import kv_read_per_sequence
from service.core import shapes
from tests.lazy import Lazy

torch = Lazy("torch")
transformers = Lazy("transformers")
roofline = Lazy("connector.roofline")

BLOCKS, BLOCK = 4, 16
BF16 = 2


def _config(tmp_path: Path, name: str) -> Any:
    return transformers.AutoConfig.from_pretrained(shapes.ensure_shape(tmp_path, shapes.PREFIX + name))


def _attention(layers: list[int], kv_heads: int, head_dim: int) -> dict[str, Any]:
    """Full or windowed attention layers in the CPU backend's layout: (K and V, blocks, KV
    heads, tokens, head dim)."""
    return {f"model.layers.{i}.self_attn.attn": torch.empty((2, BLOCKS, kv_heads, BLOCK, head_dim),
                                                            dtype=torch.bfloat16, device="meta")
            for i in layers}


def _facts(config: Any, tp: int, caches: dict[str, Any], attention: list[str]) -> dict[str, Any]:
    facts: dict[str, Any] = roofline.facts(config, "bfloat16", tp, caches, dict.fromkeys(attention, BLOCK),
                                           BLOCKS, "bfloat16", "cpu")
    return facts


# ---------------------------------------------------------------- GQA: Llama-3.1-8B


def test_gqa_llama_31_8b_by_hand(tmp_path: Path) -> None:
    config = _config(tmp_path, "llama-3.1-8b")
    attention = 4096 * 4096 + 2 * 4096 * 8 * 128 + 4096 * 4096  # q, k and v (8 KV heads), o
    mlp = 3 * 4096 * 14336  # gate, up, down
    per_layer = attention + mlp + 2 * 4096  # 41943040 + 176160768 + 8192
    params = 32 * per_layer + 4096 + 128256 * 4096  # layers, final norm, LM head
    assert params == 7_504_924_672
    kv = 32 * 8 * 128 * 2 * BF16  # layers x KV heads x head dim x (K, V) x bytes
    assert kv == 131_072
    for tp in (1, 2):
        caches = _attention(list(range(32)), 8 // tp, 128)  # one GPU holds 8 / tp KV heads
        facts = _facts(config, tp, caches, list(caches))
        assert facts["weight_params"] == params
        assert facts["weight_bytes"] == params * BF16 // tp
        assert facts["kv_bytes_per_token"] == kv // tp
        assert "windowed_kv" not in facts and "state_bytes_per_sequence" not in facts
        # A step at batch 8, 32k context each: every weight once, every token's KV.
        assert kv_read_per_sequence(facts, facts["kv_bytes_per_token"], 32768) == 32768 * kv // tp


# ---------------------------------------------------------------- MLA: DeepSeek-V2-Lite, DeepSeek-V3


def test_mla_deepseek_v2_lite_by_hand(tmp_path: Path) -> None:
    config = _config(tmp_path, "deepseek-v2-lite")
    hidden, heads = 2048, 16
    attention = (hidden * heads * (128 + 64)  # q_proj (no q_lora_rank): nope + rope dims per head
                 + hidden * (512 + 64) + 512  # kv_a_proj_with_mqa to the latent + rope key, its norm
                 + 512 * heads * (128 + 128)  # kv_b_proj: the latent to per-head nope key and value
                 + heads * 128 * hidden)  # o_proj
    assert attention == 13_763_072
    dense = 3 * hidden * 10944  # the first layer (first_k_dense_replace 1)
    routed = 64 * 3 * hidden * 1408  # 64 experts of moe_intermediate_size 1408
    moe = routed + 3 * hidden * (2 * 1408) + 64 * hidden  # + 2 shared experts as one MLP, + router
    params = 27 * (attention + 2 * hidden) + dense + 26 * moe + hidden + 102400 * hidden
    assert params == 15_496_769_024
    # The latent cache: one (kv_lora_rank + qk_rope_head_dim) vector a token a layer, the same on
    # every GPU (MLA's latent is not split by heads: each rank holds all of it).
    kv = 27 * (512 + 64) * BF16
    assert kv == 31_104
    for tp in (1, 2):
        caches = {f"model.layers.{i}.self_attn.attn": torch.empty((BLOCKS, BLOCK, 576), dtype=torch.bfloat16,
                                                                  device="meta") for i in range(27)}
        facts = _facts(config, tp, caches, list(caches))
        assert facts["weight_params"] == params
        assert facts["expert_weight_bytes"] == 26 * routed * BF16 // tp
        assert (facts["num_experts"], facts["experts_per_token"]) == (64, 6)
        assert facts["kv_bytes_per_token"] == kv  # replicated, not divided by tp


def test_mla_deepseek_v3_streams_its_published_671b(tmp_path: Path) -> None:
    params, experts = roofline.counted_params(_config(tmp_path, "deepseek-v3"))
    assert experts == 58 * 256 * 3 * 7168 * 2048  # 58 MoE layers (61 - 3 dense) x 256 experts
    assert params + 129280 * 7168 == 671_026_404_352  # with the input embedding: 671 B


# ---------------------------------------------------------------- sinks + sliding: gpt-oss-20b


def test_sinks_and_sliding_gpt_oss_20b_by_hand(tmp_path: Path) -> None:
    config = _config(tmp_path, "gpt-oss-20b")
    hidden, q, kv_width = 2880, 64 * 64, 8 * 64
    attention = (hidden * q + q + 2 * (hidden * kv_width + kv_width)  # q, k, v with biases
                 + q * hidden + hidden + 64)  # o with bias; one sink logit per head
    experts = 32 * (hidden * 2 * 2880 + 2 * 2880 + 2880 * hidden + hidden)  # gate_up, down, biases
    router = 32 * hidden + 32
    params = 24 * (attention + experts + router + 2 * hidden) + hidden + 201088 * hidden
    assert params == 20_335_623_744  # + the 579 M embedding: the published 20.9 B
    kv_layer = 8 * 64 * 2 * BF16  # 2048 bytes a token a layer
    for tp in (1, 2):
        caches = _attention(list(range(24)), 8 // tp, 64)
        facts = _facts(config, tp, caches, list(caches))
        assert facts["weight_params"] == params
        assert facts["kv_bytes_per_token"] == 24 * kv_layer // tp
        # The 12 even layers slide over 128 tokens: a step reads at most 128 of theirs.
        sliding = {"kind": "sliding", "window": 128, "bytes_per_token": 12 * kv_layer // tp}
        assert facts["windowed_kv"] == [sliding]
        read = kv_read_per_sequence(facts, facts["kv_bytes_per_token"], 32768)
        assert read == (12 * kv_layer * 32768 + 12 * kv_layer * 128) // tp
        assert kv_read_per_sequence(facts, facts["kv_bytes_per_token"], 100) == 24 * kv_layer * 100 // tp


# ---------------------------------------------------------------- gated DeltaNet: Qwen3-Next-80B-A3B


def test_gated_deltanet_qwen3_next_by_hand(tmp_path: Path) -> None:
    config = _config(tmp_path, "qwen3-next-80b-a3b")
    hidden = 2048
    # Routed experts, the shared expert, its gate, the router.
    moe = 512 * 3 * hidden * 512 + 3 * hidden * 512 + hidden + 512 * hidden
    # q with its output gate, k and v (2 KV heads), o, the q and k norms.
    full = hidden * 16 * 256 * 2 + 2 * hidden * 2 * 256 + 16 * 256 * hidden + 2 * 256
    key_dim, value_dim = 16 * 128, 32 * 128
    deltanet = (hidden * (2 * key_dim + 2 * value_dim) + hidden * 2 * 32  # in_proj_qkvz, in_proj_ba
                + (2 * key_dim + value_dim) * 4 + 32 + 32 + 128  # conv1d, dt_bias, A_log, gated norm
                + value_dim * hidden)  # out_proj
    params = 48 * (moe + 2 * hidden) + 12 * full + 36 * deltanet + hidden + 151936 * hidden
    assert params == 79_363_226_368
    full_layers = [i for i in range(48) if (i + 1) % 4 == 0]
    for tp in (1, 2):
        caches: dict[str, Any] = _attention(full_layers, 2 // tp, 256)
        for i in set(range(48)) - set(full_layers):
            # vLLM's per-layer state: the causal conv's last 3 inputs (bf16) and the recurrent
            # state of each value head, key dim x value dim (float32 on a CPU).
            caches[f"model.layers.{i}.linear_attn"] = [
                torch.empty((BLOCKS, (2 * key_dim + value_dim) // tp, 3), dtype=torch.bfloat16,
                            device="meta"),
                torch.empty((BLOCKS, 32 // tp, 128, 128), dtype=torch.float32, device="meta")]
        facts = _facts(config, tp, caches, [f"model.layers.{i}.self_attn.attn" for i in full_layers])
        assert facts["weight_params"] == params
        assert facts["kv_bytes_per_token"] == 12 * 2 * 256 * 2 * BF16 // tp == 24_576 // tp
        state = 36 * (8192 * 3 * BF16 + 32 * 128 * 128 * 4) // tp  # fixed per sequence, not per token
        assert facts["state_bytes_per_sequence"] == state == 77_266_944 // tp
        assert kv_read_per_sequence(facts, facts["kv_bytes_per_token"], 32768) == 32768 * 24_576 // tp + state


# ---------------------------------------------------------------- chunked local: Llama-4-Scout


def test_chunked_local_llama_4_scout_by_hand(tmp_path: Path) -> None:
    config = _config(tmp_path, "llama-4-scout-17b-16e")
    hidden = 5120
    attention = hidden * 40 * 128 + 2 * hidden * 8 * 128 + 40 * 128 * hidden
    moe = 16 * 3 * hidden * 8192 + 3 * hidden * 8192 + 16 * hidden  # 16 experts, 1 shared, router
    params = 48 * (attention + moe + 2 * hidden) + hidden + 202048 * hidden
    assert params == 106_735_375_360
    kv_layer = 8 * 128 * 2 * BF16  # 4096 bytes a token a layer
    for tp in (1, 2):
        caches = _attention(list(range(48)), 8 // tp, 128)
        facts = _facts(config, tp, caches, list(caches))
        assert facts["expert_weight_bytes"] == 48 * 16 * 3 * hidden * 8192 * BF16 // tp
        assert facts["kv_bytes_per_token"] == 48 * kv_layer // tp
        # 36 RoPE layers attend within their chunk of 8192; the 12 NoPE layers (every 4th) globally.
        chunked = {"kind": "chunked", "window": 8192, "bytes_per_token": 36 * kv_layer // tp}
        assert facts["windowed_kv"] == [chunked]
        # At 20000 tokens the current chunk began at 16384: 3616 tokens of it are read.
        read = kv_read_per_sequence(facts, facts["kv_bytes_per_token"], 20000)
        assert read == (12 * kv_layer * 20000 + 36 * kv_layer * 3616) // tp


@pytest.mark.parametrize("name", [s.name for s in shapes.SHAPES.values()])
def test_every_shape_builds_on_the_meta_device(tmp_path: Path, name: str) -> None:
    params, experts = roofline.counted_params(_config(tmp_path, name))
    assert params > 0 and (experts > 0) == shapes.SHAPES[name].mixture_of_experts()


@pytest.mark.parametrize("name", [s.name for s in shapes.SHAPES.values()])
def test_a_shapes_parameters_as_the_service_counts_them_are_its_models(tmp_path: Path, name: str) -> None:
    # The service holds a shape to a CPU machine's memory by ``Shape.params`` (it imports no
    # torch): at its fewest layers and one more (a kind added by ``layer_plan``'s order),
    # the sum of those is the transformers model's own count, every parameter included.
    shape = shapes.SHAPES[name]
    for layers in sorted({shape.fewest_layers(), min(shape.layers, shape.fewest_layers() + 1)}):
        path = shapes.ensure_shape(tmp_path, shape.model, layers)
        model = roofline.meta_model(transformers.AutoConfig.from_pretrained(path))
        assert shapes.plan_params(shape, layers) == sum(p.numel() for p in model.parameters()), layers
