"""Per-request samples and the run summary, with the definitions of ``vllm bench serve``.

The numbers follow ``calculate_metrics`` in vLLM's ``benchmarks/serve.py`` and the
result JSON it saves:

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
  over the steady decode window only, the gaps during which no request of the run
  was waiting for its first token. At concurrency above one a real-prefill run's
  decode steps also carry other requests' prefills (chunked prefill); these keys
  compare decode with decode. A request's decode TPOT is the mean of its own
  steady gaps (its TPOT, had every step been a pure decode step).
- ``peak_in_flight`` (not a summary key; the run page shows it): the most requests open
  at one instant. ``max_concurrent_requests`` counts a request in every one-second
  bucket it touches, so it reads 12 for a concurrency-4 run of sub-second requests.
- ``run_warnings`` turns samples into warnings; ``bunched_streams`` is the one
  samples alone can show: streams whose tokens reached the client in bursts
  instead of one engine step at a time (a starved client), so their gaps are not
  the server's. ``prefill_stall`` (the summary's ``prefill_stall``) is the share of
  decode time paused by other requests' prefills: expected, not a warning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from service.analysis.intervals import pooled_quantile_ci
from service.core.sample import Sample

PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
SLO_KEYS: tuple[str, ...] = ("ttft_ms", "tpot_ms", "e2el_ms")
LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
# No engine step of vLLM takes under 0.1 ms: chunks closer than that arrived together.
TOGETHER_S = 1e-4
# Chunks closer than this share of a stream's own TPOT arrived together too.
TOGETHER_OF_TPOT = 0.1
# A run warns when at least this share of its streams arrived in bursts...
BUNCHED_SHARE = 0.1
# ...or when its pooled median ITL is below this share of its median TPOT.
ITL_OF_TPOT = 0.5

Summary = dict[str, float | int | list[float] | None]


def percentile_key(p: float) -> str:
    """vLLM's name for a percentile: ``p99`` for 99 or 99.0, ``p99.9`` for 99.9."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def _stats(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
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
        times = _token_times(s)
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


def _token_times(s: Sample) -> np.ndarray:
    # Same order of additions as _peaks and vLLM: first token, then each gap.
    return np.cumsum(np.array([s.start_time + s.ttft, *s.itl], dtype=np.float64))


Waits = tuple[np.ndarray, np.ndarray]


def wait_windows(start_times: Sequence[float], ttfts: Sequence[float]) -> Waits:
    """The times some request of a run waited for its first token (``start`` to ``start +
    ttft`` of each successful request), merged into disjoint, sorted intervals: their
    starts and ends."""
    windows = sorted((lo, lo + ttft) for lo, ttft in zip(start_times, ttfts, strict=True))
    starts: list[float] = []
    ends: list[float] = []
    for lo, hi in windows:
        if ends and lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return np.asarray(starts), np.asarray(ends)


def steady_masks(samples: Sequence[Sample], min_decoding: int = 0,
                 waits: Waits | None = None) -> list[np.ndarray]:
    """Per successful request (in order), which of its gaps (``itl``) lie in the steady
    decode window: a boolean mask per request; ``steady_gaps`` says which gaps those are."""
    ok = [s for s in samples if s.success]
    if not ok:
        return []
    if waits is None:
        waits = wait_windows([s.start_time for s in ok], [s.ttft for s in ok])
    w_start, w_end = waits
    all_times = [_token_times(s) for s in ok]
    first = np.array([t[0] for t in all_times])
    last = np.array([t[-1] for t in all_times])
    out = []
    for times in all_times:
        # The last wait that began before the gap ended; it overlaps if it ends after the gap began.
        j = np.searchsorted(w_start, times[1:], side="left") - 1
        keep = ~((j >= 0) & (w_end[np.maximum(j, 0)] > times[:-1]))
        if min_decoding > 1:
            decoding = (first[None, :] <= times[:-1, None]) & (last[None, :] >= times[1:, None])
            keep &= decoding.sum(axis=1) >= min_decoding
        out.append(keep)
    return out


def token_times(sample: Sample) -> np.ndarray:
    """When each token of a request reached the client (start + ttft, then each gap added)."""
    return _token_times(sample)


def steady_gaps(samples: Sequence[Sample], min_decoding: int = 0,
                waits: Waits | None = None) -> list[np.ndarray]:
    """Per successful request (in order), its gaps during which no request of the run was
    waiting for its first token (seconds). With ``min_decoding``, only gaps throughout which
    at least that many requests were decoding (first token seen, last not yet): the batch
    size a point asks for (costs requests x gaps; for analysis, not for every summary).

    ``waits``: the run's ``wait_windows``, when ``samples`` is a slice of the run (then
    without ``min_decoding``, which needs every request)."""
    ok = [s for s in samples if s.success]
    masks = steady_masks(ok, min_decoding, waits)
    return [np.asarray(s.itl, dtype=np.float64)[keep] for s, keep in zip(ok, masks, strict=True)]


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


def is_bunched(sample: Sample) -> bool:
    """True when a stream's tokens reached the client in bursts, not one engine step at a
    time: more than half its gaps are under 0.1 ms or under a tenth of its own TPOT."""
    if not sample.success or len(sample.itl) < 2:
        return False
    limit = max(TOGETHER_S, TOGETHER_OF_TPOT * (sample.tpot() or 0.0))
    return float(np.median(sample.itl)) < limit


def run_warnings(samples: Sequence[Sample], summary: Mapping[str, object]) -> list[dict[str, object]]:
    """Warnings the samples themselves show, as ``{code, message, figure}``.

    ``bunched_streams`` fires for streams whose tokens reached the client in bursts, or a
    median gap far below the TPOT inside the steady decode window. Outside that window a
    low median ITL against the TPOT is what real prefill does at concurrency above one
    (another request's prefill pauses decode: one long gap among short ones); that is
    ``prefill_stall``, a figure of the summary, not a warning.
    """
    streams = [s for s in samples if s.success and len(s.itl) >= 2]
    if not streams:
        return []
    bunched = sum(is_bunched(s) for s in streams)
    share = bunched / len(streams)
    itl = summary.get("decode_median_itl_ms")
    tpot = summary.get("decode_median_tpot_ms")
    pooled_low = (
        isinstance(itl, float) and isinstance(tpot, float) and tpot > 0 and itl < ITL_OF_TPOT * tpot
    )
    if share < BUNCHED_SHARE and not pooled_low:
        return []
    message = (
        f"{bunched} of {len(streams)} streams reached the client in bursts instead of one token "
        f"per engine step (median gap under {TOGETHER_OF_TPOT:.0%} of the stream's TPOT)"
    )
    if pooled_low:
        message += (f"; in the steady decode window the median ITL {itl:.3f} ms is below half "
                    f"the median TPOT {tpot:.3f} ms")
    message += (
        ": the client did not see tokens when the server sent them (a starved client or a "
        "buffering proxy), so this run's ITL, and TPOT of those streams, are not meaningful"
    )
    return [{"code": "bunched_streams", "message": message, "figure": round(share, 4)}]


def prefill_stall(samples: Sequence[Sample], mode: str = "prefill") -> dict[str, object]:
    """Decode paused by other requests' prefills (``mode`` fill: by their fills): the share
    of the streams' decode time (sum of their gaps) spent in gaps outside the steady decode
    window, that is while another request of the run waited for its first token; with what
    it means. Expected of real prefill at concurrency above one, and the reason ``decode_*``
    keys exist."""
    ok = [s for s in samples if s.success]
    masks = steady_masks(ok)
    total = stalled = 0.0
    gaps = 0
    for sample, keep in zip(ok, masks, strict=True):
        itl = np.asarray(sample.itl, dtype=np.float64)
        total += float(itl.sum())
        stalled += float(itl[~keep].sum())
        gaps += int((~keep).sum())
    share = stalled / total if total > 0 else 0.0
    if mode == "fill":
        why = ("while another request's KV cache was being filled (the connector's fill step, "
               "in place of its prefill): decode waits for that step as it would for a prefill")
    else:
        why = ("while another request was being prefilled (decode paused by its prefill): expected "
               "of real prefill at concurrency above one")
    return {"share": round(share, 4), "gaps": gaps, "message": (
        f"{share:.0%} of decode time was in {gaps} gaps {why}; median ITL and TPOT include those "
        "pauses, the decode_* figures leave them out")}


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
        summary.update(_stats(name, values[name], percentiles))
    summary.update(decode_stats(ok))
    return summary


def _request_rate(value: object) -> object:
    if value is None or (isinstance(value, float) and math.isinf(value)):
        return "inf"
    return value


def _queue_time(s: Sample) -> float:
    return s.start_time - s.due_time if s.due_time is not None else 0.0


# The per-request lists of vLLM's result file, in its order: each a field of every sample,
# or a value made from every sample.
VLLM_REQUEST_LISTS: tuple[tuple[str, str | Callable[[Sample], object]], ...] = (
    ("input_lens", "prompt_len"),
    ("output_lens", Sample.counted_output_tokens),
    ("ttfts", "ttft"),
    ("itls", "itl"),
    ("latencies", "latency"),
    ("start_times", "start_time"),
    ("queue_times", _queue_time),
    ("generated_texts", "generated_text"),
    ("errors", "error"),
)


def request_value(sample: Sample, made: str | Callable[[Sample], object]) -> object:
    """One sample's entry in a list of ``VLLM_REQUEST_LISTS``."""
    value = getattr(sample, made) if isinstance(made, str) else made(sample)
    return list(value) if isinstance(value, list) else value


def export_vllm(
    summary: Mapping[str, object], samples: Sequence[Sample], spec_info: Mapping[str, object]
) -> dict[str, object]:
    """The dict ``vllm bench serve --save-result --save-detailed`` would write for this run.

    ``spec_info`` describes the run: ``model`` (model_id), ``tokenizer`` (default: the
    model), ``backend`` (default ``"openai"``, vLLM's name for a completions client),
    ``label``, ``num_prompts``, ``request_rate`` (None or inf: ``"inf"``),
    ``burstiness`` (default 1.0), ``max_concurrency``, ``date`` (``%Y%m%d-%H%M%S``,
    default now) and ``metadata`` (a mapping merged in, like ``--metadata KEY=VALUE``).
    Per-request lists are in request index order; ``queue_times`` is the wait between
    the scheduled time and the POST (0 where no schedule time was kept).
    """
    ordered = sorted(samples, key=lambda s: s.index)
    lists = {key: [request_value(s, made) for s in ordered] for key, made in VLLM_REQUEST_LISTS}
    return vllm_result(summary, spec_info, lists, len(ordered))


def vllm_result(summary: Mapping[str, object], spec_info: Mapping[str, object],
                lists: Mapping[str, object], requests: int,
                stats: Mapping[str, float] | None = None) -> dict[str, object]:
    """``export_vllm``'s dict with ``lists`` under the keys of ``VLLM_REQUEST_LISTS``
    (the lists, or what stands for them in a writer that streams them); ``requests``: how
    many samples the run has; ``stats``: the latency statistics to write (``selected_stats``),
    by default every ``*_ms`` figure of the summary."""
    backend = spec_info.get("backend", "openai")
    result: dict[str, object] = {
        "date": spec_info.get("date") or datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": spec_info.get("label"),
        "model_id": spec_info.get("model"),
        "tokenizer_id": spec_info.get("tokenizer", spec_info.get("model")),
        "num_prompts": spec_info.get("num_prompts", requests),
    }
    metadata = spec_info.get("metadata")
    if isinstance(metadata, Mapping):
        result.update({str(k): v for k, v in metadata.items()})
    result.update({
        "request_rate": _request_rate(spec_info.get("request_rate")),
        "burstiness": spec_info.get("burstiness", 1.0),
        "max_concurrency": spec_info.get("max_concurrency"),
    })
    for key in (
        "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
        "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    ):
        result[key] = summary.get(key)
    result.update({key: lists[key] for key, _ in VLLM_REQUEST_LISTS})
    result.update({
        "max_output_tokens_per_s": summary.get("max_output_tokens_per_s"),
        "max_concurrent_requests": summary.get("max_concurrent_requests"),
        # Real-time factor of audio benchmarks; always 0 for text, as in vLLM.
        "rtfx": 0.0,
    })
    if stats is None:
        stats = {k: v for k, v in summary.items() if k.endswith("_ms")}  # type: ignore[misc]
    result.update(stats)
    return result


# What ``--percentile-metrics`` of ``vllm bench serve`` may name for a text model, in the
# order vLLM writes them; the last two exist only for a run with a concurrency limit (and,
# for the last, a finite request rate), as in vLLM.
VLLM_PERCENTILE_METRICS: tuple[str, ...] = (
    "ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")


def selected_stats(samples: Sequence[Sample], metrics: Sequence[str], percentiles: Sequence[float],
                   max_concurrency: int | None, request_rate: float | None) -> dict[str, float]:
    """The latency statistics ``vllm bench serve --percentile-metrics M --metric-percentiles P``
    writes (mean, median, std and each percentile of each metric named, in ms), from the samples.
    Unknown names raise ``ValueError``."""
    unknown = [m for m in metrics if m not in VLLM_PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"unknown percentile metrics {unknown}; known: {list(VLLM_PERCENTILE_METRICS)}")
    ok = [s for s in samples if s.success]
    values: dict[str, list[float]] = {
        "ttft": [s.ttft for s in ok],
        "tpot": [t for s in ok if (t := s.tpot()) is not None],
        "itl": [gap for s in ok for gap in s.itl],
        "e2el": [s.latency for s in ok],
    }
    if max_concurrency is not None:
        values["client_queue_time"] = [_queue_time(s) for s in ok]
        if request_rate is not None and not math.isinf(request_rate):
            values["e2el_including_client_queue"] = [s.latency + _queue_time(s) for s in ok]
    out: dict[str, float] = {}
    for name in VLLM_PERCENTILE_METRICS:
        if name in metrics and name in values:
            out.update(_stats(name, values[name], percentiles))
    return out


# Statistics that get a 95% interval in a run's summary, as ``<key>_ci: [lo, hi]`` (ms).
# ITL statistics pool the gaps of every request and resample whole requests; the others
# resample requests' own values (see ``service.analysis.intervals``).
INTERVAL_QUANTILES: tuple[tuple[str, float], ...] = (("median", 0.5), ("p99", 0.99))


def request_values(samples: Sequence[Sample], waits: Waits | None = None) -> dict[str, list[np.ndarray]]:
    """Per successful request, in seconds, the values each latency statistic pools:
    ``ttft``, ``tpot``, ``e2el`` (one value per request), ``itl`` (its gaps) and
    ``decode_itl`` / ``decode_tpot`` (its steady-window gaps, and their mean). ``waits``:
    the run's ``wait_windows`` when ``samples`` is a slice of it."""
    ok = [s for s in samples if s.success]
    steady = steady_gaps(ok, waits=waits)
    return {
        "ttft": [np.array([s.ttft]) for s in ok],
        "tpot": [np.array([t]) for s in ok if (t := s.tpot()) is not None],
        "e2el": [np.array([s.latency]) for s in ok],
        "itl": [np.asarray(s.itl, dtype=np.float64) for s in ok],
        "decode_itl": steady,
        "decode_tpot": [np.array([g.mean()]) for g in steady if g.size],
    }


def summary_intervals(samples: Sequence[Sample], seed: int = 0) -> dict[str, list[float]]:
    """``median_ttft_ms_ci``, ``p99_itl_ms_ci``, ... ``decode_median_itl_ms_ci``: the 95%
    bootstrap interval (ms) of each latency statistic of the summary, over requests; a
    statistic with under two requests has none."""
    values = request_values(samples)
    out: dict[str, list[float]] = {}
    for name in LATENCY_METRICS:
        for stat, q in INTERVAL_QUANTILES:
            interval = pooled_quantile_ci(values[name], q, seed=seed)
            if interval is not None:
                out[f"{stat}_{name}_ms_ci"] = interval.scaled(1000).pair()
    for name in ("itl", "tpot"):
        interval = pooled_quantile_ci(values[f"decode_{name}"], 0.5, seed=seed)
        if interval is not None:
            out[f"decode_median_{name}_ms_ci"] = interval.scaled(1000).pair()
    return out


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
