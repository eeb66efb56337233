"""How close a run's decode came to the memory-bandwidth floor of its hardware.

A decode step reads every weight once and, for each sequence in the batch, the KV cache of
every token it holds so far. No step can take less than those bytes over the device's
memory bandwidth:

    min_step_s = (weight_bytes + batch x mean_context x kv_bytes_per_token) / bandwidth

with ``batch x mean_context`` the sum of the context lengths of the sequences decoding.
Weights and KV sizes are per tensor-parallel rank, as the connector reports them, and the
bandwidth is one device's: each rank reads its own share from its own memory at the same
time. ``pct_of_roofline`` is that floor over the measured decode median ITL, in percent:
100 would be a decode that does nothing but stream its bytes at full bandwidth.

Not every layer reads the whole context. A sliding window layer (Gemma 3's local layers,
gpt-oss's) reads at most its window's tokens, a chunked local attention layer (Llama 4's RoPE
layers) those of the current chunk, and a layer that keeps state instead of KV (Mamba, gated
DeltaNet) its sequence's fixed state: the connector reports those parts apart
(``windowed_kv``, ``state_bytes_per_sequence``) and a sequence's KV read is counted per part at
the mean context (``kv_read_per_sequence``).

A mixture of experts reads only the routed experts its tokens go to: with ``E`` experts a
layer, ``k`` per token and a batch of ``B`` tokens a step, routed uniformly at random (as a
router with dummy weights does), a step touches ``E x (1 - (1 - k/E)^B)`` experts a layer on
average, and reads that share of the routed experts' bytes (``expert_weight_bytes``) besides
everything else. Real routing is skewed (some experts hot), which touches fewer.

Batch and context come from the samples, over the steady decode window of
``service.analysis.metrics`` (the gaps while no request of the run waited for its first
token), both time-weighted: the batch is the number of requests streaming, averaged over the
time the window covers; a sequence's context during a gap is its prompt plus the tokens it
had generated when the gap began. Pure functions: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.analysis.steady_window import steady_masks, token_times
from service.core.sample import Sample


@dataclass(frozen=True)
class Occupancy:
    """What was decoding over a run's steady window (time-weighted means)."""

    batch: float  # requests streaming
    context_tokens: float  # prompt + tokens generated so far, per decoding sequence
    window_s: float  # how long the window is (the union of its gaps)


def occupancy(samples: Sequence[Sample]) -> Occupancy | None:
    """The mean batch and context over the steady decode window, or None when the window is
    empty (no request streamed two tokens outside another's wait for its first)."""
    ok = [s for s in samples if s.success]
    masks = steady_masks(ok)
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    busy = 0.0  # sum over requests of their steady gaps: the integral of the batch
    weighted = 0.0  # the same, each gap weighted by its sequence's context
    for s, keep in zip(ok, masks, strict=True):
        if not keep.any():
            continue
        times = token_times(s)
        lo, hi = times[:-1][keep], times[1:][keep]
        # During the gap after token k (0: the first), k + 1 tokens have been generated.
        context = s.prompt_len + 1 + np.flatnonzero(keep)
        length = hi - lo
        busy += float(length.sum())
        weighted += float((length * context).sum())
        starts.append(lo)
        ends.append(hi)
    if not starts:
        return None
    window = _union_length(np.concatenate(starts), np.concatenate(ends))
    if window <= 0 or busy <= 0:
        return None
    return Occupancy(batch=busy / window, context_tokens=weighted / busy, window_s=window)


def _union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """The total length of the union of the intervals ``[starts[i], ends[i]]``."""
    order = np.argsort(starts, kind="stable")
    lo, hi = starts[order], ends[order]
    # Each interval covers what lies past the furthest end of those before it.
    reach = np.maximum.accumulate(hi)
    before = np.concatenate(([-np.inf], reach[:-1]))
    covered = np.clip(hi - np.maximum(lo, before), 0.0, None)
    return float(covered.sum())


def min_step_s(weight_bytes: float, kv_bytes_per_token: float, batch: float,
               context_tokens: float, bandwidth_bytes_per_s: float) -> float:
    """The least time one decode step can take: its bytes over the bandwidth."""
    return step_bytes(weight_bytes, kv_bytes_per_token, batch, context_tokens) / bandwidth_bytes_per_s


def step_bytes(weight_bytes: float, kv_bytes_per_token: float, batch: float,
               context_tokens: float) -> float:
    """The bytes one decode step reads: every weight, and the KV of every decoding token."""
    return weight_bytes + batch * context_tokens * kv_bytes_per_token


def kv_read_per_sequence(facts: Mapping[str, Any], kv_bytes_per_token: float, context_tokens: float) -> float:
    """The KV and state bytes a step reads for one decoding sequence at ``context_tokens``:
    every token of the layers that attend to all of it, at most the window of a sliding
    window layer, the tokens of the current chunk of a chunked one, and its fixed state."""
    total = kv_bytes_per_token * context_tokens
    for part in facts.get("windowed_kv") or []:
        per_token, window = _positive(part.get("bytes_per_token")), _positive(part.get("window"))
        if per_token is None or window is None:
            continue
        if part.get("kind") == "chunked":
            reach = (context_tokens - 1) % window + 1 if context_tokens >= 1 else context_tokens
        else:
            reach = min(context_tokens, window)
        total -= per_token * (context_tokens - reach)
    return total + (_positive(facts.get("state_bytes_per_sequence")) or 0.0)


def experts_touched(num_experts: int, per_token: int, batch: float) -> float:
    """Distinct experts a layer's step reads, on average, when ``batch`` tokens each pick
    ``per_token`` of ``num_experts`` uniformly at random."""
    if num_experts <= 0:
        return 0.0
    share = min(1.0, per_token / num_experts)
    return float(num_experts * (1.0 - (1.0 - share) ** max(batch, 0.0)))


def streamed_weight_bytes(facts: Mapping[str, Any], batch: float) -> float | None:
    """Weight bytes a step reads: all of them, but for a mixture of experts only the share
    of the routed experts' bytes the batch touches."""
    weights = _positive(facts.get("weight_bytes"))
    experts = _positive(facts.get("expert_weight_bytes"))
    count, per_token = facts.get("num_experts"), facts.get("experts_per_token")
    if weights is None or experts is None or not isinstance(count, int) or not isinstance(per_token, int):
        return weights
    touched = experts_touched(count, per_token, batch)
    return weights - experts + experts * touched / count


def step_growth(facts: Mapping[str, Any] | None, context_tokens: float) -> Callable[[float], float] | None:
    """How a decode step's bytes grow with its batch at ``context_tokens`` tokens a sequence:
    ``batch -> step bytes at batch / step bytes at 1``, from the connector's facts (weights,
    the share of routed experts a batch touches, each sequence's KV and state read as
    ``kv_read_per_sequence`` counts it); None when the facts lack
    the weight or KV bytes. The capacity search's prior before it has a line of its own: a
    step that keeps the efficiency it has at one concurrency takes that much longer."""
    if not facts:
        return None
    weights = _positive(facts.get("weight_bytes"))
    kv_per_token = facts.get("kv_bytes_per_token")
    kv = 0.0 if kv_per_token == 0 and not isinstance(kv_per_token, bool) else _positive(kv_per_token)
    if weights is None or kv is None or context_tokens <= 0:
        return None

    per_sequence = kv_read_per_sequence(facts, kv, context_tokens)

    def bytes_at(batch: float) -> float:
        return (streamed_weight_bytes(facts, batch) or weights) + batch * per_sequence

    one = bytes_at(1.0)
    return lambda batch: bytes_at(batch) / one


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if np.isfinite(value) and value > 0 else None


def roofline(samples: Sequence[Sample], facts: Mapping[str, Any] | None,
             decode_median_itl_ms: float | None) -> dict[str, Any] | None:
    """The run against its roofline (see the module docstring), or None when the facts
    (``provenance["roofline"]``, as the connector reports them) lack the weight or KV bytes
    or a measured bandwidth, or the steady decode window is empty. Times in ms, sizes in
    bytes, rates in bytes per second; percentages are None without a positive ITL."""
    if not facts:
        return None
    weights = _positive(facts.get("weight_bytes"))
    kv_per_token = facts.get("kv_bytes_per_token")
    bandwidth = facts.get("bandwidth") or {}
    measured = _positive(bandwidth.get("measured_bytes_per_s")) if isinstance(bandwidth, Mapping) else None
    spec = _positive(bandwidth.get("spec_bytes_per_s")) if isinstance(bandwidth, Mapping) else None
    # A model without attention KV reports 0 bytes per token; anything else must be positive.
    kv = 0.0 if kv_per_token == 0 and not isinstance(kv_per_token, bool) else _positive(kv_per_token)
    if weights is None or measured is None or kv is None:
        return None
    seen = occupancy(samples)
    if seen is None:
        return None
    weights = streamed_weight_bytes(facts, seen.batch) or weights
    total = weights + seen.batch * kv_read_per_sequence(facts, kv, seen.context_tokens)
    floor_ms = total / measured * 1000
    itl_ms = _positive(decode_median_itl_ms)
    return {
        "batch": seen.batch,
        "context_tokens": seen.context_tokens,
        "bytes_per_step": total,
        "weight_bytes": weights,
        "kv_bytes": total - weights,
        "min_step_ms": floor_ms,
        "decode_median_itl_ms": itl_ms,
        "pct_of_roofline": floor_ms / itl_ms * 100 if itl_ms else None,
        "pct_of_spec_roofline": (total / spec * 1000 / itl_ms * 100) if spec and itl_ms else None,
        "bandwidth_bytes_per_s": measured,
        "spec_bandwidth_bytes_per_s": spec,
        "achieved_bytes_per_s": total / (itl_ms / 1000) if itl_ms else None,
    }
