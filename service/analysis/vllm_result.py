"""A run as the result file ``vllm bench serve --save-result --save-detailed`` writes.

``export_vllm`` makes the whole dict from a summary and samples; ``vllm_result`` the same
with the per-request lists given (a writer that streams them); ``selected_stats`` the
latency statistics ``--percentile-metrics`` and ``--metric-percentiles`` ask for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

from service.analysis.metrics import latency_stats
from service.core.sample import Sample


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
            out.update(latency_stats(name, values[name], percentiles))
    return out
