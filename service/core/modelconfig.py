"""What a model's ``config.json`` says about how long a sequence it takes, read as vLLM
derives its default ``--max-model-len``, so a run too long for its model is refused at
submit instead of failing every request once a server was started for it.

vLLM takes the smallest of several length keys of the (text) config (``model_max_length``
wins where set), the tokenizer config's ``model_max_length`` when smaller, and multiplies
by the RoPE scaling factor for the scaling types that do not already count it; with no
key at all it assumes 2048. A ``--max-model-len`` above that limit makes it refuse to
start unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set.

A server started with ``--max-model-len -1`` may take less: vLLM lowers the model's length
to what its KV cache memory holds. ``RequestLen`` is a run's longest request held to such
a server's limit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The keys vLLM reads a model's length from, of several model families.
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE scaling types whose config length already includes the factor.
PRESCALED_ROPE = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
# What vLLM assumes when the config names no length.
ASSUMED_LEN = 2048
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class MaxLen:
    """A model's longest sequence (prompt plus output, tokens) and where that was read."""

    tokens: int
    source: str


@dataclass(frozen=True)
class RequestLen:
    """A run's longest request: prompt and output tokens, ``range_ratio`` applied."""

    input: int
    output: int
    range_ratio: float = 0.0

    @property
    def tokens(self) -> int:
        """Prompt plus output: what vLLM holds to its ``max_model_len``."""
        return self.input + self.output

    def over(self, limit: int, why: str) -> str | None:
        """Why this request does not fit a server whose ``max_model_len`` is ``limit``
        (``why``: whose limit that is and what to change), with the sums; None if it fits.
        "infeasible" first, as for a batch the KV cache cannot hold: a sweep counts both."""
        if self.tokens <= limit:
            return None
        ranged = f" (the longest request at range_ratio {self.range_ratio:g})" if self.range_ratio else ""
        return (f"infeasible: input {self.input} + output {self.output} = {self.tokens} tokens{ranged} "
                f"> {limit}, {why}")


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _rope_factor(config: Mapping[str, Any]) -> float:
    if "gemma3" in str(config.get("model_type", "")):
        return 1.0
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if not isinstance(rope, Mapping):
        return 1.0
    # Per-layer-type parameters ({"full_attention": {...}, ...}) or one set for all layers.
    sets = [rope] if "factor" in rope or "rope_type" in rope or "type" in rope else [
        v for v in rope.values() if isinstance(v, Mapping)]
    factor = 1.0
    for params in sets:
        kind = params.get("rope_type", params.get("type"))
        if kind not in PRESCALED_ROPE and (f := _number(params.get("factor"))) is not None:
            factor = f
    return factor


def max_len_of(config: Mapping[str, Any], tokenizer_config: Mapping[str, Any] | None = None) -> MaxLen:
    """The longest sequence a server of this model takes by default (vLLM's derivation)."""
    text = config.get("text_config")
    text_config: Mapping[str, Any] = text if isinstance(text, Mapping) else config
    found = {key: n for key in LENGTH_KEYS if (n := _number(text_config.get(key))) is not None}
    if "model_max_length" in found:
        length, source = found["model_max_length"], "model_max_length"
    elif found:
        source = min(found, key=lambda k: found[k])
        length = found[source]
    else:
        length = float(ASSUMED_LEN)
        source = f"none of {', '.join(LENGTH_KEYS)} set: vLLM assumes {ASSUMED_LEN}"
    source = f"config.json {source}" if found else source
    tokenizer_len = _number((tokenizer_config or {}).get("model_max_length"))
    if tokenizer_len is not None and tokenizer_len < length:
        length, source = tokenizer_len, "tokenizer_config.json model_max_length"
    factor = _rope_factor(text_config)
    if factor != 1.0:
        length *= factor
        source += f" x RoPE scaling factor {factor:g}"
    return MaxLen(int(length), source)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def model_dir_max_len(model_dir: Path) -> MaxLen | None:
    """``max_len_of`` a local model directory's config files; None when its config.json
    cannot be read as a JSON object (vLLM will say what is wrong with it)."""
    config = _read(model_dir / "config.json")
    if config is None:
        return None
    return max_len_of(config, _read(model_dir / "tokenizer_config.json"))


def long_max_len_allowed(env: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM is told to accept a ``--max-model-len`` above the model's own."""
    env = os.environ if env is None else env
    return env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower() in _TRUE
