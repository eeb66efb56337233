"""Bundled model shapes: published architectures' configs, served with dummy weights.

A shape is a real model's ``config.json`` (its layers, widths, heads, KV heads, head
dim, vocabulary, window pattern, experts: the numbers its publisher gives) written
locally beside a word-level tokenizer as large as its vocabulary, so that a run measures
decode on the architecture people serve with no download and no weights
(``--load-format dummy``: decode speed depends on the shape, not on weight values).

A run names one as ``decodebench-shapes/<name>``; ``engine.num_layers`` builds it with
fewer layers (tests stay small) and keeps every kind of layer the shape has (see
:func:`layer_plan`). The special token ids of each config are the bundled tokenizer's,
not the publisher's: the tokenizer is ours.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.core import tinymodel

PREFIX = "decodebench-shapes/"


@dataclass(frozen=True)
class Shape:
    """One published architecture as decodebench serves it."""

    name: str
    # The published model whose config.json these dimensions are.
    source: str
    # What the shape stands for: "gqa", "sliding-window", "mamba-hybrid", "moe", "mla",
    # "sinks-sliding", "gated-deltanet-hybrid", "chunked-local".
    family: str
    summary: str
    config: dict[str, Any]
    # The config key holding the per-layer kinds, when the shape mixes kinds of layers.
    layer_types_key: str | None = None
    # The kind each value under ``layer_types_key`` stands for, where the config writes codes
    # rather than names (Llama 4's ``no_rope_layers``: 1 a RoPE layer, 0 a NoPE one).
    layer_codes: tuple[tuple[Any, str], ...] = ()
    # The config key counting the dense layers a mixture of experts starts with (DeepSeek's
    # ``first_k_dense_replace``): "dense" and "moe" are then the kinds of its layers.
    dense_prefix_key: str | None = None
    # vLLM flags a server of this shape gets on a CPU unless the run's extra_args say
    # otherwise, each with the reason (a defect of the pinned vLLM CPU build it avoids).
    cpu_flags: tuple[tuple[str, str], ...] = ()
    # Its parameters: "base" (embeddings, LM head, final norm) and one layer of each kind,
    # counted on its transformers model (tests/test_shape_facts.py holds each to that count).
    params: dict[str, int] = field(default_factory=dict)
    # Why vLLM's CPU build cannot serve this shape's family, as tried with the pinned build;
    # None where it does. Whether a CPU machine's memory holds it is ``cpu_memory_problem``'s.
    cpu: str | None = None

    @property
    def model(self) -> str:
        """The name a run gives as its model."""
        return PREFIX + self.name

    @property
    def layers(self) -> int:
        """The published number of layers."""
        return int(self.config["num_hidden_layers"])

    def layer_kinds(self) -> list[str]:
        """The kind of each published layer (one kind for a uniform stack)."""
        if self.dense_prefix_key is not None:
            dense = int(self.config[self.dense_prefix_key])
            return ["dense"] * dense + ["moe"] * (self.layers - dense)
        if self.layer_types_key is None:
            return ["decoder"] * self.layers
        names = dict(self.layer_codes)
        return [names.get(value, value) for value in self.config[self.layer_types_key]]

    def mixture_of_experts(self) -> bool:
        """Whether the shape routes tokens to experts."""
        return int(self.config.get("num_experts") or self.config.get("num_local_experts")
                   or self.config.get("n_routed_experts") or 0) > 0

    @property
    def runs_on_cpu(self) -> bool:
        """Whether vLLM's CPU build serves this shape's family (``cpu`` says why not)."""
        return self.cpu is None

    def fewest_layers(self) -> int:
        """The fewest layers that keep every kind it has (``layer_plan``'s floor)."""
        return len(set(self.layer_kinds()))


def _gemma3_layer_types(layers: int, pattern: int) -> list[str]:
    # Every ``pattern``-th layer attends globally, the others over the sliding window.
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]


def _every_nth(layers: int, nth: int, kind: str, other: str) -> list[str]:
    # Every ``nth`` layer is of ``kind``, the others of ``other``.
    return [kind if (i + 1) % nth == 0 else other for i in range(layers)]


# Llama 3.1's RoPE: base 500000 stretched eight times past the 8192 positions it was trained on.
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

# gpt-oss: both sizes share everything but their depth and their number of experts.
_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "attention_bias": True,
    "attention_dropout": 0.0, "experts_per_token": 4, "num_experts_per_tok": 4,
    "sliding_window": 128, "initial_context_length": 4096, "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "hidden_act": "silu", "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.9,
    "output_router_logits": False, "vocab_size": 201088, "tie_word_embeddings": False,
}

# DeepSeek's multi-head latent attention and its routed + shared experts, as both configs write them.
_DEEPSEEK_YARN = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 4096}

# Granite 4.0-H-350M: 28 Mamba2 layers and 4 of attention, in the published order.
_GRANITE_LAYERS = (["mamba"] * 10 + ["attention"] + ["mamba"] * 2 + ["attention"] + ["mamba"] * 3
                   + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4)

SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape(
        name="smollm2-135m",
        source="HuggingFaceTB/SmolLM2-135M",
        family="gqa",
        summary="Llama-style GQA, 30 layers, 9 query / 3 KV heads, head dim 64",
        config={
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
            "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0, "vocab_size": 49152, "tie_word_embeddings": True,
        },
        params={"base": 28_312_128, "decoder": 3_540_096},
    ),
    Shape(
        name="llama-3.2-1b",
        source="meta-llama/Llama-3.2-1B",
        family="gqa",
        summary="Llama 3 GQA, 16 layers, 32 query / 8 KV heads, head dim 64, 128k context",
        config={
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "vocab_size": 128256, "tie_word_embeddings": True,
        },
        params={"base": 262_670_336, "decoder": 60_821_504},
    ),
    Shape(
        name="qwen2.5-0.5b",
        source="Qwen/Qwen2.5-0.5B",
        family="gqa",
        summary="Qwen2.5 GQA with q/k/v bias, 24 layers, 14 query / 2 KV heads, head dim 64",
        config={
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_act": "silu",
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 24,
            "vocab_size": 151936, "tie_word_embeddings": True,
        },
        params={"base": 136_135_552, "decoder": 14_912_384},
    ),
    Shape(
        name="gemma-3-1b",
        source="google/gemma-3-1b-it",
        family="sliding-window",
        summary="Gemma 3: 5 local (window 512) : 1 global layers, 26 layers, 4 query / 1 KV head, "
                "head dim 256; two KV cache groups",
        config={
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
            "sliding_window": 512, "sliding_window_pattern": 6,
            "layer_types": _gemma3_layer_types(26, 6),
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
            "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "attention_bias": False, "vocab_size": 262144, "tie_word_embeddings": True,
        },
        layer_types_key="layer_types",
        params={"base": 301_991_040, "sliding_attention": 26_842_112, "full_attention": 26_842_112},
    ),
    Shape(
        name="granite-4.0-h-350m",
        source="ibm-granite/granite-4.0-h-350m",
        family="mamba-hybrid",
        summary="Granite 4.0-H: 28 Mamba2 + 4 attention layers (no positional encoding), "
                "12 query / 4 KV heads; Mamba state and KV cache groups",
        config={
            "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
            "hidden_size": 768, "intermediate_size": 2048, "shared_intermediate_size": 2048,
            "num_hidden_layers": 32, "layer_types": _GRANITE_LAYERS,
            "num_attention_heads": 12, "num_key_value_heads": 4, "attention_bias": False,
            "attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
            "logits_scaling": 3.0, "residual_multiplier": 0.246,
            "mamba_n_heads": 48, "mamba_d_head": 32, "mamba_d_state": 128, "mamba_n_groups": 1,
            "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
            "mamba_conv_bias": True, "mamba_proj_bias": False,
            "num_local_experts": 0, "num_experts_per_tok": 0,
            "position_embedding_type": "nope", "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "vocab_size": 100352, "tie_word_embeddings": True,
        },
        layer_types_key="layer_types",
        # With prefix caching on, vLLM 0.32's CPU build keeps Mamba state in "align" mode, and
        # a real prefill longer than one attention block (896 tokens here) then fails in the
        # Mamba2 mixer ("IndexError: index 7 is out of bounds for dimension 0 with size 1"),
        # killing the engine; decode after a fill works either way.
        cpu_flags=(("--no-enable-prefix-caching",
                    "vLLM 0.32 on CPU fails a real prefill of a Mamba hybrid longer than one "
                    "attention block while prefix caching keeps Mamba state aligned"),),
        params={"base": 77_071_104, "mamba": 8_503_184, "attention": 6_292_992},
    ),
    Shape(
        name="qwen3-30b-a3b",
        source="Qwen/Qwen3-30B-A3B",
        family="moe",
        summary="Qwen3 mixture of experts: 128 experts, 8 per token, 48 layers, 32 query / "
                "4 KV heads, head dim 128",
        config={
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
            "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "attention_bias": False, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": 48,
            "vocab_size": 151936, "tie_word_embeddings": False,
        },
        params={"base": 622_331_904, "decoder": 623_120_640},
    ),
    Shape(
        name="llama-3.1-8b",
        source="meta-llama/Llama-3.1-8B",
        family="gqa",
        summary="Llama 3.1 GQA, 32 layers, 32 query / 8 KV heads, head dim 128, 128k context",
        config={
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "attention_bias": False,
            "mlp_bias": False, "hidden_act": "silu", "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE,
            "vocab_size": 128256, "tie_word_embeddings": False,
        },
        params={"base": 1_050_677_248, "decoder": 218_112_000},
    ),
    Shape(
        name="llama-3.1-70b",
        source="meta-llama/Llama-3.1-70B",
        family="gqa",
        summary="Llama 3.1 GQA, 80 layers, 64 query / 8 KV heads, head dim 128, 128k context",
        config={
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
            "num_attention_heads": 64, "num_key_value_heads": 8, "attention_bias": False,
            "mlp_bias": False, "hidden_act": "silu", "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE,
            "vocab_size": 128256, "tie_word_embeddings": False,
        },
        params={"base": 2_101_354_496, "decoder": 855_654_400},
    ),
    Shape(
        name="qwen3-32b",
        source="Qwen/Qwen3-32B",
        family="gqa",
        summary="Qwen3 GQA with q/k norm, 64 layers, 64 query / 8 KV heads, head dim 128",
        config={
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
            "attention_bias": False, "hidden_act": "silu", "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": 64,
            "vocab_size": 151936, "tie_word_embeddings": False,
        },
        params={"base": 1_555_829_760, "decoder": 487_598_336},
    ),
    Shape(
        name="deepseek-v2-lite",
        source="deepseek-ai/DeepSeek-V2-Lite",
        family="mla",
        summary="DeepSeek-V2-Lite: multi-head latent attention (KV latent 512 + 64 RoPE dims), "
                "27 layers (1 dense, then 64 routed experts, 6 per token, + 2 shared), 16 heads",
        config={
            "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
            "num_hidden_layers": 27, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "num_attention_heads": 16, "num_key_value_heads": 16, "attention_bias": False,
            "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
            "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax",
            "norm_topk_prob": False, "routed_scaling_factor": 1.0, "aux_loss_alpha": 0.001,
            "seq_aux": True, "hidden_act": "silu", "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "rope_scaling": {**_DEEPSEEK_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
            "vocab_size": 102400, "tie_word_embeddings": False,
        },
        dense_prefix_key="first_k_dense_replace",
        params={"base": 419_432_448, "dense": 81_007_104, "moe": 584_847_872},
    ),
    Shape(
        name="deepseek-v3",
        source="deepseek-ai/DeepSeek-V3",
        family="mla",
        summary="DeepSeek-V3: multi-head latent attention (KV latent 512 + 64 RoPE dims, query "
                "rank 1536), 61 layers (3 dense, then 256 routed experts, 8 per token, + 1 "
                "shared), 128 heads; served in bfloat16 (published weights are FP8)",
        config={
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
            "num_attention_heads": 128, "num_key_value_heads": 128, "attention_bias": False,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "ep_size": 1,
            "num_nextn_predict_layers": 1, "hidden_act": "silu",
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "rope_scaling": {**_DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
            "vocab_size": 129280, "tie_word_embeddings": False,
        },
        dense_prefix_key="first_k_dense_replace",
        params={"base": 1_853_365_248, "dense": 583_483_392, "moe": 11_507_286_016},
    ),
    Shape(
        name="gpt-oss-20b",
        source="openai/gpt-oss-20b",
        family="sinks-sliding",
        summary="gpt-oss: attention sinks, sliding window 128 and full layers alternating, 24 "
                "layers, 64 query / 8 KV heads, head dim 64, 32 experts, 4 per token; served in "
                "bfloat16 (published experts are MXFP4)",
        config={**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32,
                "layer_types": ["sliding_attention", "full_attention"] * 12},
        layer_types_key="layer_types",
        params={"base": 1_158_269_760, "sliding_attention": 823_186_976, "full_attention": 823_186_976},
    ),
    Shape(
        name="gpt-oss-120b",
        source="openai/gpt-oss-120b",
        family="sinks-sliding",
        summary="gpt-oss: attention sinks, sliding window 128 and full layers alternating, 36 "
                "layers, 64 query / 8 KV heads, head dim 64, 128 experts, 4 per token; served in "
                "bfloat16 (published experts are MXFP4)",
        config={**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18},
        layer_types_key="layer_types",
        params={"base": 1_158_269_760, "sliding_attention": 3_213_080_192, "full_attention": 3_213_080_192},
    ),
    Shape(
        name="qwen3-next-80b-a3b",
        source="Qwen/Qwen3-Next-80B-A3B-Instruct",
        family="gated-deltanet-hybrid",
        summary="Qwen3-Next: 36 gated DeltaNet + 12 gated attention layers (every 4th), 16 query "
                "/ 2 KV heads, head dim 256; 512 experts, 10 per token, + 1 shared; 256k context",
        config={
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "num_hidden_layers": 48,
            # Published as full_attention_interval 4 only; transformers derives these from it.
            "full_attention_interval": 4,
            "layer_types": _every_nth(48, 4, "full_attention", "linear_attention"),
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
            "attention_bias": False, "partial_rotary_factor": 0.25,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
            "output_router_logits": False, "hidden_act": "silu", "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "rope_theta": 10000000, "rope_scaling": None,
            "use_sliding_window": False, "vocab_size": 151936, "tie_word_embeddings": False,
        },
        layer_types_key="layer_types",
        params={"base": 622_331_904, "linear_attention": 1_648_531_648, "full_attention": 1_642_076_672},
    ),
    Shape(
        name="llama-4-scout-17b-16e",
        source="meta-llama/Llama-4-Scout-17B-16E",
        family="chunked-local",
        summary="Llama 4 Scout (its text model): 36 layers of chunked local attention (chunks of "
                "8192, RoPE) and 12 global NoPE layers (every 4th), 40 query / 8 KV heads, head "
                "dim 128; 16 experts, 1 per token, + 1 shared",
        config={
            "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
            "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
            "head_dim": 128, "attention_bias": False, "attention_chunk_size": 8192,
            # 1: a RoPE layer attending within its chunk; 0: a NoPE layer attending globally.
            "no_rope_layers": [1, 1, 1, 0] * 12, "use_qk_norm": True,
            "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
            "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
            "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
            "output_router_logits": False, "hidden_act": "silu",
            "max_position_embeddings": 10485760, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
            "vocab_size": 202048, "tie_word_embeddings": False,
        },
        layer_types_key="no_rope_layers",
        layer_codes=((1, "chunked_attention"), (0, "full_attention")),
        params={"base": 2_068_976_640, "chunked_attention": 2_202_101_760, "full_attention": 2_202_101_760},
    ),
)}


def is_shape(model: str) -> bool:
    """Whether ``model`` names a bundled shape (known or not)."""
    return model.startswith(PREFIX)


def shape_of(model: str) -> Shape:
    """The bundled shape ``model`` names; ``KeyError`` with the known names if none."""
    name = model.removeprefix(PREFIX)
    if not is_shape(model) or name not in SHAPES:
        known = ", ".join(s.model for s in SHAPES.values())
        raise KeyError(f"no bundled shape {model!r} (known: {known})")
    return SHAPES[name]


def layer_plan(shape: Shape, layers: int | None) -> list[str]:
    """The kinds of the layers a shape is built with: the published ones, or the first
    ``layers`` of them with the last ones swapped for any kind that would go missing, so
    a reduced Gemma 3 keeps a global layer and a reduced Granite an attention layer."""
    kinds = shape.layer_kinds()
    if layers is None or layers >= len(kinds):
        return kinds
    distinct = list(dict.fromkeys(kinds))
    if layers < len(distinct):
        raise ValueError(f"{shape.model} mixes {len(distinct)} kinds of layers ({', '.join(distinct)}): "
                         f"engine.num_layers must be at least {len(distinct)}")
    plan = kinds[:layers]
    missing = [k for k in distinct if k not in plan]
    for i, kind in enumerate(missing):
        plan[layers - 1 - i] = kind
    return plan


def plan_params(shape: Shape, layers: int | None) -> int:
    """The parameters of a shape built with ``layers`` layers (all when None)."""
    return shape.params["base"] + sum(shape.params[kind] for kind in layer_plan(shape, layers))


# What vLLM 0.32's CPU server of a shape with dummy weights held at its peak, as a multiple
# of those weights in the dtype it serves, and the process beside them. Measured here at 2
# layers in bfloat16: gpt-oss-20b 10 GB for 5.6 GB of weights, Llama-4-Scout 23.2 GB for
# 12.9 GB (1.78 and 1.79; the CPU build keeps a second, repacked copy of much of them while
# it loads).
CPU_PEAK_PER_WEIGHT = 1.8
CPU_PROCESS_BYTES = 2**30
# What a CPU machine keeps beside a server's peak: its KV cache, the service, the system.
CPU_RESERVE_SHARE, CPU_RESERVE_BYTES = 0.10, 2 * 2**30
# Bytes a parameter, by a run's engine.dtype; on a CPU the service's default is float32
# (``vllm_cli.engine_flags``), and "auto" is the shapes' own bfloat16.
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "auto": 2}


def cpu_peak_bytes(shape: Shape, layers: int | None, dtype: str = "bfloat16") -> float:
    """About the most memory a vLLM CPU server of the shape holds while it starts (weights
    in ``dtype`` and process; its KV cache is on top)."""
    return plan_params(shape, layers) * DTYPE_BYTES[dtype] * CPU_PEAK_PER_WEIGHT + CPU_PROCESS_BYTES


def cpu_memory_problem(shape: Shape, layers: int | None, memory_bytes: int, dtype: str = "bfloat16",
                       kv_cache_bytes: int | None = None) -> str | None:
    """Why a CPU machine of ``memory_bytes`` cannot hold a server of the shape at ``layers``
    in ``dtype`` (and its KV cache, where the run sizes it): its peak, with the arithmetic,
    against the memory less what the machine keeps beside it; None where it fits."""
    reserve = max(CPU_RESERVE_BYTES, CPU_RESERVE_SHARE * memory_bytes)
    peak = cpu_peak_bytes(shape, layers, dtype)
    need = peak + (kv_cache_bytes or 0)
    if need <= memory_bytes - reserve:
        return None
    plan = layer_plan(shape, layers)
    params = plan_params(shape, layers)
    kv = f" and its {kv_cache_bytes / 2**30:.1f} GiB KV cache" if kv_cache_bytes else ""
    fewest = shape.fewest_layers()
    fewer = ("" if len(plan) <= fewest else f"; at engine.num_layers {fewest}, its fewest, it peaks near "
             f"{cpu_peak_bytes(shape, fewest, dtype) / 2**30:.1f} GiB")
    wider = "" if DTYPE_BYTES[dtype] <= 2 else "; engine.dtype bfloat16 halves the weights"
    return (f"at {len(plan)} of its {shape.layers} layers it holds {params / 1e9:.2f} B parameters, "
            f"{params * DTYPE_BYTES[dtype] / 2**30:.1f} GiB in {dtype}, and vLLM's CPU server peaks near "
            f"{CPU_PEAK_PER_WEIGHT:g}x its weights plus {CPU_PROCESS_BYTES / 2**30:g} GiB: about "
            f"{peak / 2**30:.1f} GiB{kv}, more than the {(memory_bytes - reserve) / 2**30:.1f} GiB "
            f"a machine of {memory_bytes / 2**30:.1f} GiB has for it (it keeps "
            f"{reserve / 2**30:.1f} GiB for the KV cache, the service and the system){fewer}{wider}")


def shape_config(shape: Shape, layers: int | None) -> dict[str, Any]:
    """The config.json of a shape built with ``layers`` layers (all when None)."""
    plan = layer_plan(shape, layers)
    config = {**shape.config, "num_hidden_layers": len(plan),
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"}
    if shape.layer_types_key is not None:
        codes = {name: code for code, name in shape.layer_codes}
        config[shape.layer_types_key] = [codes.get(kind, kind) for kind in plan]
    if shape.dense_prefix_key is not None:
        # layer_plan keeps the dense layers first: the reduced stack starts with them too.
        config[shape.dense_prefix_key] = plan.count("dense")
    if shape.config.get("max_window_layers") is not None:
        config["max_window_layers"] = len(plan)
    return config


def directory_name(shape: Shape, layers: int | None) -> str:
    """The shape's directory under the models dir: one per layer count."""
    if layers is None or layers >= shape.layers:
        return shape.name
    return f"{shape.name}-{layers}l"


def ensure_shape(models_dir: Path, model: str, layers: int | None = None) -> Path:
    """Write a shape's files under ``models_dir`` unless present; return its directory."""
    shape = shape_of(model)
    path = models_dir / PREFIX.rstrip("/") / directory_name(shape, layers)
    config = shape_config(shape, layers)
    marker = path / "config.json"
    try:
        if json.loads(marker.read_text()) == config:
            return path
    except (OSError, ValueError):
        pass  # not written yet, or by a version with other dimensions: written again
    path.mkdir(parents=True, exist_ok=True)
    vocab = int(config["vocab_size"])
    files = {
        "tokenizer.json": tinymodel.tokenizer_json(vocab),
        "tokenizer_config.json": {**tinymodel.TOKENIZER_CONFIG,
                                  "model_max_length": int(config["max_position_embeddings"])},
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2},
        # config.json last: its presence marks a complete model directory.
        "config.json": config,
    }
    for name, content in files.items():
        tinymodel.write_atomically(path / name, json.dumps(content))
    return path


def catalogue(cpu_memory_bytes: int | None = None) -> list[dict[str, Any]]:
    """Every bundled shape as the pages, the CLI and the API list them. With the memory of
    the CPU machine this service starts its servers on, ``runs_on_cpu`` says whether the
    shape at its fewest layers runs there, and ``why_not`` why not."""
    def why_not(s: Shape) -> str | None:
        if s.cpu is not None or cpu_memory_bytes is None:
            return s.cpu
        return cpu_memory_problem(s, s.fewest_layers(), cpu_memory_bytes)

    return [{
        "model": s.model, "source": s.source, "family": s.family, "summary": s.summary,
        "layers": s.layers, "vocab_size": s.config["vocab_size"],
        "max_position_embeddings": s.config["max_position_embeddings"],
        "cpu_flags": [{"flag": flag, "why": why} for flag, why in s.cpu_flags],
        "params": plan_params(s, None), "fewest_layers": s.fewest_layers(),
        "cpu_peak_gib_at_fewest_layers": round(cpu_peak_bytes(s, s.fewest_layers()) / 2**30, 1),
        "runs_on_cpu": why_not(s) is None, "why_not": why_not(s),
    } for s in SHAPES.values()]


def is_bundled(model: str) -> bool:
    """Whether the service writes ``model``'s files itself (the tiny model or a shape):
    such a model has no weights and is served with dummy ones."""
    return model == tinymodel.TINY_MODEL_NAME or is_shape(model)


def ensure_bundled(models_dir: Path, model: str, layers: int | None = None) -> Path:
    """The directory of a bundled model under ``models_dir``, written if missing."""
    if model == tinymodel.TINY_MODEL_NAME:
        return tinymodel.ensure_tiny_model(models_dir)
    return ensure_shape(models_dir, model, layers)
