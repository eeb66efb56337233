"""The run summary: per-request samples summed up with the definitions of ``vllm bench serve``.

The numbers follow ``calculate_metrics`` in vLLM's ``benchmarks/serve.py`` and the
result JSON it saves (written by ``service.analysis.vllm_result``):

- Only successful requests enter the token counts, the latency statistics and the
  peaks; failed ones are only counted in ``failed``.
- TPOT is ``(latency - ttft) / (output_tokens - 1)``, for requests with more than
  one output token. ITL pools every gap between streamed chunks of every request.
- Statistics are numpy's over seconds, reported in milliseconds: mean, median,
  population std, linear-interpolated percentiles; a metric with no values is 0.
- Goodput counts requests meeting every given SLO (``value <= slo``), with the
  TPOT of a single-token request taken as 0; without SLOs it is None, as in the
  result file of vLLM.
- ``max_output_tokens_per_s`` and ``max_concurrent_requests`` come from one-second
  buckets counted from the earliest start of a successful request: a token lands at
  ``start + ttft + itl[0] + ... + itl[k]``, a request is active in every bucket from
  the one holding its start to the one holding ``start + latency``. Each is the
  maximum over the buckets on its own (not the concurrency at the token peak).

Beyond vLLM's keys:

- ``decode_{mean,median,p99}_{itl,tpot}_ms`` and ``decode_gaps``: the same statistics
  over the steady decode window only (``service.analysis.steady_window``). A request's
  decode TPOT is the mean of its own steady gaps (its TPOT, had every step been a pure
  decode step).
- ``peak_in_flight`` (not a summary key; the run page shows it): the most requests open
  at one instant. ``max_concurrent_requests`` counts a request in every one-second
  bucket it touches, so it reads 12 for a concurrency-4 run of sub-second requests.
- ``measured``: the summary as the API and pages show it, None for a figure over no values.

The 95% intervals next to medians and p99s are ``service.analysis.summary_intervals``';
the warnings the samples show, ``service.analysis.bursts``'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from service.analysis.steady_window import steady_gaps, token_times
from service.core.sample import Sample

PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
SLO_KEYS: tuple[str, ...] = ("ttft_ms", "tpot_ms", "e2el_ms")
LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
Summary = dict[str, float | int | list[float] | None]


def percentile_key(p: float) -> str:
    """vLLM's name for a percentile: ``p99`` for 99 or 99.0, ``p99.9`` for 99.9."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def latency_stats(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """Mean, median, population std and each percentile of ``values`` (s) as vLLM names them, in ms."""
    data = np.asarray(values, dtype=np.float64) if values else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(np.mean(data)) * 1000,
        f"median_{name}_ms": float(np.median(data)) * 1000,
        f"std_{name}_ms": float(np.std(data)) * 1000,
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(data, p)) * 1000
    return out


def _is_good(sample: Sample, slos_s: Mapping[str, float]) -> bool:
    measured = {
        "ttft_ms": sample.ttft,
        "tpot_ms": sample.tpot() or 0.0,
        "e2el_ms": sample.latency,
    }
    return all(measured[key] <= limit for key, limit in slos_s.items())


def _peaks(ok: Sequence[Sample]) -> tuple[float, int]:
    if not ok:
        return 0.0, 0
    origin = min(s.start_time for s in ok)
    buckets = math.ceil(max(s.start_time + s.latency for s in ok) - origin) + 1
    tokens = np.zeros(buckets)
    active = np.zeros(buckets, dtype=np.int64)
    for s in ok:
        # Add the gaps one by one from the first token's time, in vLLM's order, so
        # that a token right on a second boundary falls into the same bucket.
        times = token_times(s)
        seconds = (times - origin).astype(np.int64)
        np.add.at(tokens, seconds[(seconds >= 0) & (seconds < buckets)], 1)
        first = int(s.start_time - origin)
        last = int(s.start_time + s.latency - origin)
        active[first : last + 1] += 1
    return float(tokens.max()), int(active.max())


def peak_in_flight(samples: Sequence[Sample]) -> int:
    """The most successful requests open at one instant (start to start + latency; a request
    ending as another starts is not two): what ``max_concurrent_requests`` is often taken for."""
    ok = [s for s in samples if s.success]
    if not ok:
        return 0
    starts = np.array([s.start_time for s in ok], dtype=np.float64)
    ends = starts + np.array([s.latency for s in ok], dtype=np.float64)
    times = np.concatenate([starts, ends])
    steps = np.concatenate([np.ones(starts.size), -np.ones(ends.size)])
    order = np.lexsort((steps, times))
    return int(np.cumsum(steps[order]).max())


def decode_stats(samples: Sequence[Sample], min_decoding: int = 0) -> Summary:
    """ITL and TPOT over the steady decode window (see the module docstring), in ms;
    ``min_decoding`` as for ``steady_gaps``."""
    per_request = steady_gaps(samples, min_decoding)
    itl = np.concatenate(per_request) if per_request else np.zeros(0)
    tpot = np.array([g.mean() for g in per_request if g.size], dtype=np.float64)
    out: Summary = {"decode_gaps": int(itl.size)}
    for name, values in (("itl", itl), ("tpot", tpot)):
        data = values if values.size else np.zeros(1)
        out[f"decode_mean_{name}_ms"] = float(np.mean(data)) * 1000
        out[f"decode_median_{name}_ms"] = float(np.median(data)) * 1000
        out[f"decode_p99_{name}_ms"] = float(np.percentile(data, 99)) * 1000
    return out


def _per_second(count: float, duration: float) -> float:
    return count / duration if duration > 0 else 0.0


def summarize(
    samples: Sequence[Sample],
    duration: float,
    goodput: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> Summary:
    """The run summary under vLLM's key names; ``goodput`` holds SLOs in ms (``ttft_ms``, ...)."""
    slos = dict(goodput or {})
    unknown = set(slos) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"unknown SLO keys {sorted(unknown)}; known: {list(SLO_KEYS)}")
    # vLLM compares in seconds against the SLO divided by 1000; so do we, to agree on ties.
    slos_s = {key: limit / 1000 for key, limit in slos.items()}

    ok = [s for s in samples if s.success]
    total_input = sum(s.prompt_len for s in ok)
    total_output = sum(s.counted_output_tokens() for s in ok)
    good = sum(_is_good(s, slos_s) for s in ok)
    peak_tokens, peak_active = _peaks(ok)

    summary: Summary = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": _per_second(len(ok), duration),
        "request_goodput": _per_second(good, duration) if slos else None,
        "output_throughput": _per_second(total_output, duration),
        "total_token_throughput": _per_second(total_input + total_output, duration),
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_active,
    }
    values: dict[str, list[float]] = {
        "ttft": [s.ttft for s in ok],
        "tpot": [t for s in ok if (t := s.tpot()) is not None],
        "itl": [gap for s in ok for gap in s.itl],
        "e2el": [s.latency for s in ok],
    }
    for name in LATENCY_METRICS:
        summary.update(latency_stats(name, values[name], percentiles))
    summary.update(decode_stats(ok))
    return summary


# Summary keys that count or time the run rather than measure answered requests: true
# whatever came back.
COUNTED_KEYS = frozenset({"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                          "decode_gaps", "roofline", "energy"})


def measured(summary: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A summary as the API and pages show it: a figure over no values is None, not the 0
    that vLLM's keys hold for it (every figure when no request was answered, the ``decode_``
    ones when the steady window holds no gap). The stored summary keeps vLLM's zeros."""
    if summary is None:
        return None
    shown = dict(summary)
    if summary.get("completed") == 0:
        empty = [k for k in shown if k not in COUNTED_KEYS]
    elif summary.get("decode_gaps") == 0:
        empty = [k for k in shown if k.startswith("decode_") and k != "decode_gaps"]
    else:
        return shown
    shown.update(dict.fromkeys(empty))
    return shown
