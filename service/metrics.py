"""Per-request samples and the run summary, with the definitions of ``vllm bench serve``.

Only successful requests enter the latency statistics and token counts. TPOT is
``(latency - ttft) / (output_tokens - 1)`` for requests with more than one output
token; ITL pools every gap between streamed chunks of every request. Statistics
are numpy's: population std, linear-interpolated percentiles, and an empty
metric is 0. Times are kept in seconds and reported in milliseconds under
vLLM's key names (``mean_ttft_ms``, ``p99_itl_ms``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class Sample:
    """One request's raw measurement (seconds, ``time.perf_counter`` clock of the client)."""

    index: int
    prompt_len: int
    output_tokens: int
    ttft: float
    itl: list[float]
    latency: float
    start_time: float
    success: bool
    error: str = ""
    due_time: float | None = None
    sent_time: float | None = None
    generated_text: str = field(default="", repr=False)

    def counted_output_tokens(self) -> int:
        """Output tokens as vLLM counts them: the server's usage, else one per streamed chunk."""
        if self.output_tokens:
            return self.output_tokens
        return len(self.itl) + 1 if self.success else 0

    def tpot(self) -> float | None:
        """Time per output token after the first, or None for a single-token output."""
        n = self.counted_output_tokens()
        if n <= 1:
            return None
        return (self.latency - self.ttft) / (n - 1)


def _percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _stats(name: str, values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    data = np.asarray(values if values else [0.0], dtype=np.float64)
    out = {
        f"mean_{name}_ms": float(np.mean(data)) * 1000,
        f"median_{name}_ms": float(np.median(data)) * 1000,
        f"std_{name}_ms": float(np.std(data)) * 1000,
    }
    for p in percentiles:
        out[f"{_percentile_key(p)}_{name}_ms"] = float(np.percentile(data, p)) * 1000
    return out


def _peaks(ok: Sequence[Sample]) -> tuple[float, int]:
    """Most output tokens in one wall-clock second, and most requests active in one second.

    Seconds are counted from the earliest start among successful requests; a
    token lands at start + ttft + the running sum of its request's ITLs.
    """
    if not ok:
        return 0.0, 0
    origin = min(s.start_time for s in ok)
    end = max(s.start_time + s.latency for s in ok)
    buckets = math.ceil(end - origin) + 1
    tokens = np.zeros(buckets)
    active = np.zeros(buckets)
    for s in ok:
        times = s.start_time + s.ttft + np.concatenate(([0.0], np.cumsum(s.itl)))
        idx = (times - origin).astype(np.int64)
        idx = idx[(idx >= 0) & (idx < buckets)]
        np.add.at(tokens, idx, 1)
        first = int(s.start_time - origin)
        last = int(s.start_time + s.latency - origin)
        active[first : last + 1] += 1
    return float(tokens.max()), int(active.max())


def summarize(
    samples: Sequence[Sample],
    duration: float,
    goodput: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> dict[str, Any]:
    """The run summary under vLLM's key names; ``goodput`` holds SLOs in ms (``ttft_ms``, ...)."""
    ok = [s for s in samples if s.success]
    out_tokens = [s.counted_output_tokens() for s in ok]
    total_input = sum(s.prompt_len for s in ok)
    total_output = sum(out_tokens)
    ttfts = [s.ttft for s in ok]
    e2els = [s.latency for s in ok]
    tpots = [t for s in ok if (t := s.tpot()) is not None]
    itls = [gap for s in ok for gap in s.itl]
    dur = duration if duration > 0 else float("nan")

    good = 0
    slos = {k: v for k, v in (goodput or {}).items() if v is not None}
    if slos:
        for s in ok:
            # A single-token request has TPOT 0 for goodput, as in vLLM.
            measured = {"ttft_ms": s.ttft, "tpot_ms": s.tpot() or 0.0, "e2el_ms": s.latency}
            if all(measured[k] * 1000 <= limit for k, limit in slos.items()):
                good += 1

    peak_tokens, peak_active = _peaks(ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": _ratio(len(ok), dur),
        "request_goodput": _ratio(good, dur) if slos else None,
        "output_throughput": _ratio(total_output, dur),
        "total_token_throughput": _ratio(total_input + total_output, dur),
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_active,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        summary.update(_stats(name, values, percentiles))
    return summary


def _ratio(count: float, duration: float) -> float:
    value = count / duration
    return 0.0 if math.isnan(value) else value


def export_vllm(
    summary: Mapping[str, Any], samples: Sequence[Sample], info: Mapping[str, Any]
) -> dict[str, Any]:
    """A result dict with the keys ``vllm bench serve --save-result --save-detailed`` writes.

    ``info`` describes the run: ``model``, ``num_prompts``, ``request_rate`` (None for
    all at once), ``burstiness``, ``max_concurrency``, ``date`` (``%Y%m%d-%H%M%S``),
    and ``label``.
    """
    ordered = sorted(samples, key=lambda s: s.index)
    rate = info.get("request_rate")
    result: dict[str, Any] = {
        "date": info.get("date"),
        # Our client speaks the OpenAI completions API, like vLLM's "openai" backend.
        "endpoint_type": "openai",
        "backend": "openai",
        "label": info.get("label"),
        "model_id": info.get("model"),
        "tokenizer_id": info.get("model"),
        "num_prompts": info.get("num_prompts"),
        "request_rate": "inf" if rate is None else rate,
        "burstiness": info.get("burstiness", 1.0),
        "max_concurrency": info.get("max_concurrency"),
        "duration": summary.get("duration"),
        "completed": summary.get("completed"),
        "failed": summary.get("failed"),
        "total_input_tokens": summary.get("total_input_tokens"),
        "total_output_tokens": summary.get("total_output_tokens"),
        "request_throughput": summary.get("request_throughput"),
        "request_goodput": summary.get("request_goodput"),
        "output_throughput": summary.get("output_throughput"),
        "total_token_throughput": summary.get("total_token_throughput"),
        "max_output_tokens_per_s": summary.get("max_output_tokens_per_s"),
        "max_concurrent_requests": summary.get("max_concurrent_requests"),
        "rtfx": 0.0,
        "input_lens": [s.prompt_len for s in ordered],
        "output_lens": [s.counted_output_tokens() if s.success else 0 for s in ordered],
        "ttfts": [s.ttft for s in ordered],
        "itls": [list(s.itl) for s in ordered],
        "latencies": [s.latency for s in ordered],
        "start_times": [s.start_time for s in ordered],
        # Time a request waited on the client for a concurrency slot.
        "queue_times": [
            s.start_time - s.due_time if s.due_time is not None else 0.0 for s in ordered
        ],
        "generated_texts": [s.generated_text for s in ordered],
        "errors": [s.error for s in ordered],
    }
    for key, value in summary.items():
        if key.endswith("_ms"):
            result[key] = value
    return result
