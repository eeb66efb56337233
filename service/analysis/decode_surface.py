"""The decode surface of a sweep or a capacity search: per measured point (input length,
output length, concurrency), the decode ITL, the output tokens/s per GPU and the KV cache in
use, on the axes NVIDIA Dynamo's SLA planner interpolates over.

The axes are Dynamo's (its profiler's ``benchmarks/profiler/utils/profile_decode.py``,
``_profile_decode_helper``; its planner's ``DecodeInterpolator``):

- context length: the mean context a request decodes at, ``input_len + output_len / 2``;
- KV usage: the fraction (0..1) of the KV cache the running requests hold, as Dynamo
  computes it, ``concurrency x context length / max_kv_tokens``, with the file's own
  ``max_kv_tokens``: both of Dynamo's readers take the batch back from it
  (``round(x x max_kv_tokens / context)``), so any other value would give the planner a wrong
  batch. The server's own ``vllm:kv_cache_usage_perc``, where it was scraped while every one
  of the run's requests decoded, goes in the manifest beside it (it counts whole blocks);
- ITL in ms, throughput per GPU in output tokens/s divided by the server's GPUs.

A point pools its trials by their mean; each trial's own values are kept beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.analysis.steady_window import wait_windows

# The ITL a point is read at: the steady decode window's median, else vLLM's median.
ITL_KEYS = ("decode_median_itl_ms", "median_itl_ms")
MEASURED = "measured"
COMPUTED = "computed"


def context_length(input_len: int, output_len: int) -> float:
    """The mean context over a request's decode, as Dynamo's profiler defines it."""
    return input_len + output_len / 2


def computed_kv_usage(concurrency: int, input_len: int, output_len: int, kv_tokens: int) -> float:
    """The KV cache fraction ``concurrency`` requests hold at their mean context (Dynamo's
    formula; above 1 where they cannot all fit)."""
    return concurrency * context_length(input_len, output_len) / kv_tokens


def steady_kv_usage(points: Sequence[tuple[float, float]], start_times: Sequence[float],
                    ttfts: Sequence[float], latencies: Sequence[float],
                    concurrency: int) -> tuple[float, int] | None:
    """The mean of the server's KV usage scrapes (``(t, fraction)`` on the requests' clock)
    taken while ``concurrency`` requests were open and none waited for its first token, with
    how many scrapes that is; None when no scrape fell there."""
    if not points or not start_times:
        return None
    starts = np.asarray(start_times, dtype=np.float64)
    ends = np.sort(starts + np.asarray(latencies, dtype=np.float64))
    starts = np.sort(starts)
    w_start, w_end = wait_windows(list(start_times), list(ttfts))
    kept = []
    for t, usage in points:
        open_now = int(np.searchsorted(starts, t, side="right") - np.searchsorted(ends, t, side="right"))
        j = int(np.searchsorted(w_start, t, side="right")) - 1
        waiting = j >= 0 and float(w_end[j]) > t
        if open_now >= concurrency and not waiting:
            kept.append(usage)
    if not kept:
        return None
    return float(np.mean(kept)), len(kept)


@dataclass(frozen=True)
class TrialFacts:
    """What one measured run says about its point."""

    run_id: str
    input_len: int
    output_len: int
    concurrency: int
    gpus: int
    kv_tokens: int | None
    itl_ms: float
    itl_key: str
    output_tokens_per_s: float
    kv_usage_measured: float | None = None
    kv_scrapes: int = 0

    def kv_usage_computed(self, max_kv_tokens: int) -> float:
        """Its KV usage by Dynamo's formula, on the file's ``max_kv_tokens``."""
        return computed_kv_usage(self.concurrency, self.input_len, self.output_len, max_kv_tokens)

    def kv_usage(self, max_kv_tokens: int) -> tuple[float, str]:
        """Its KV usage as the file holds it, and where that comes from: always Dynamo's
        formula (see the module docstring); the measured value is the manifest's."""
        return self.kv_usage_computed(max_kv_tokens), COMPUTED


@dataclass(frozen=True)
class SurfacePoint:
    """One point of the surface: its trials pooled by their mean."""

    trials: tuple[TrialFacts, ...]
    max_kv_tokens: int

    @property
    def first(self) -> TrialFacts:
        return self.trials[0]

    @property
    def context_length(self) -> float:
        return context_length(self.first.input_len, self.first.output_len)

    @property
    def kv_usage(self) -> float:
        return float(np.mean([t.kv_usage(self.max_kv_tokens)[0] for t in self.trials]))

    @property
    def kv_usage_source(self) -> str:
        """``measured``, ``computed``, or ``mixed`` where its trials differ."""
        sources = {t.kv_usage(self.max_kv_tokens)[1] for t in self.trials}
        return sources.pop() if len(sources) == 1 else "mixed"

    @property
    def itl_ms(self) -> float:
        return float(np.mean([t.itl_ms for t in self.trials]))

    @property
    def thpt_per_gpu(self) -> float:
        return float(np.mean([t.output_tokens_per_s / t.gpus for t in self.trials]))


def itl_of(summary: dict[str, object]) -> tuple[float, str] | None:
    """The ITL a run's point is read at, with its summary key; None when it has none (an
    empty metric is stored as 0)."""
    for key in ITL_KEYS:
        value = summary.get(key)
        if isinstance(value, int | float) and value > 0:
            return float(value), key
    return None
