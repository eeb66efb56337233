"""Is a dummy KV fill neutral for a model? Where it is not, ``seeded`` is the remedy.

A filled KV cache holds the same value everywhere (or noise). For dense attention that
changes no work the engine does per step: the same bytes are read, the same products
computed. It does change the work where what the model attends to decides what runs:

- a mixture of experts routes each token by its hidden state, which attention over dummy KV
  makes unlike any real prompt's: other experts, another load per expert;
- speculative decoding accepts draft tokens by what the model predicts: acceptance (and so
  tokens per step) depends on the KV (vLLM's synthetic acceptance fixes it instead);
- sparse index attention (DeepSeek's DSA) selects the tokens to attend to by their content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.analysis.checks import TEXT_CONFIGS, Warning_, num_experts
from service.core.mode import Mode

# Config keys of an attention that selects tokens by an indexer (DeepSeek V3.2's DSA).
INDEX_KEYS = ("index_topk", "index_n_heads", "index_head_dim")


def fill_neutrality(config: Mapping[str, Any] | None,
                    speculative: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Whether a dummy fill leaves a model's decode work as a real prompt's would:
    ``{"neutral": bool | None, "reasons": [...]}`` (None: the config is not known here)."""
    reasons: list[str] = []
    if config is not None:
        text = next((config[k] for k in TEXT_CONFIGS if isinstance(config.get(k), Mapping)), config)
        experts = num_experts(config)
        if experts > 0:
            reasons.append(f"mixture of experts ({experts} experts per layer): the router picks "
                           "experts from hidden states that attention over dummy KV makes unlike "
                           "a real prompt's")
        if any(key in text for key in INDEX_KEYS):
            reasons.append("sparse index attention: an indexer selects the tokens attended to by "
                           "their content, which a dummy fill makes all alike")
    if speculative:
        synthetic = speculative.get("rejection_sample_method") == "synthetic"
        reasons.append("speculative decoding: draft acceptance depends on what the model attends to"
                       + (" (synthetic acceptance set: acceptance is fixed, not read from the KV)"
                          if synthetic else ""))
    if config is None and not speculative:
        return {"neutral": None, "reasons": []}
    return {"neutral": not reasons, "reasons": reasons}


def fill_not_neutral(mode: str, neutrality: Mapping[str, Any]) -> list[Warning_]:
    """``fill_not_neutral`` for a fill run of a model where a dummy fill changes the work."""
    if not Mode(mode).fills or neutrality.get("neutral") is not False:
        return []
    reasons = list(neutrality.get("reasons") or [])
    return [{"code": "fill_not_neutral",
             "message": "a dummy KV fill is not neutral for this model: " + "; ".join(reasons)
             + ". Mode \"seeded\" measures decode on real KV (prompts prefilled once, replayed "
             "from the prefix cache)", "figure": len(reasons)}]
