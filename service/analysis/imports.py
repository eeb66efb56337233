"""A result file of ``vllm bench serve --save-result`` read as a run measured elsewhere.

``read_result`` turns the file's JSON into what an imported run stores: a spec (the load
the file describes, ``mode`` ``prefill``: vLLM computed every prefill), a summary (the
file's own figures, completed with the keys only decodebench has when the file has its
requests), its samples (from the per-request lists ``--save-detailed`` adds) and its
provenance (the file's header and free ``--metadata`` keys). The keys are those
``benchmark`` and ``main`` in vLLM's ``benchmarks/serve.py`` write. Pure: no I/O.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from pydantic import ValidationError

from service.analysis.metrics import summarize
from service.analysis.summary_intervals import summary_intervals
from service.core import provenance
from service.core.errors import Invalid
from service.core.sample import Sample
from service.core.spec import RunSpec, describe

# Keys every text-generation result file of ``vllm bench serve`` has.
REQUIRED_KEYS = ("date", "backend", "model_id", "num_prompts", "duration", "completed", "failed",
                 "total_input_tokens", "total_output_tokens", "request_throughput",
                 "output_throughput")
# Whole-run figures of the file kept as the run's summary (with every ``*_ms`` statistic).
SUMMARY_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests")
# The lists a detailed file (``--save-detailed``) has, one entry per request; a file without
# them keeps only ``latencies`` and ``queue_times``, which alone make no samples.
DETAILED_LISTS = ("input_lens", "output_lens", "ttfts", "itls", "start_times")
SAMPLE_LISTS = (*DETAILED_LISTS, "latencies")
OPTIONAL_LISTS = ("errors", "generated_texts", "queue_times")
HEADER_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
               "num_prompts", "request_rate", "burstiness", "max_concurrency",
               "ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps")
OTHER_KNOWN = ("rtfx", "e2els_including_queue")
# Figures of the file that are counts (vLLM writes them as integers).
INTEGER_KEYS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "max_concurrent_requests")
# Counts (requests, tokens) the database holds as they are.
MAX_COUNT = 2**53
COUNT_KEYS = ("num_prompts", "completed", "failed", "total_input_tokens", "total_output_tokens")
# How long the requests of one file may span (start_times are seconds on one clock).
MAX_SPAN_S = 7 * 24 * 3600
DATE_FORMAT = "%Y%m%d-%H%M%S"
PREFILLED_ELSEWHERE = ("real: vLLM computed every prompt's prefill (vllm bench serve, measured "
                       "elsewhere and imported)")


@dataclass
class Imported:
    """What an imported run stores."""

    spec: dict[str, Any]
    summary: dict[str, Any]
    samples: list[Sample]
    provenance: dict[str, Any]
    finished_at: datetime
    duration: float


def _number(body: Mapping[str, Any], key: str) -> float:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Invalid(f"key {key!r} of the result file is not a finite number: {str(value)[:60]!r}")
    return float(value)


def _count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0 <= value <= MAX_COUNT and value == int(value)):
        raise Invalid(f"{key} of the result file is not a count (a whole number from 0 to "
                      f"{MAX_COUNT}): {str(value)[:60]!r}")
    return int(value)


def _list(body: Mapping[str, Any], key: str, n: int | None) -> list[Any]:
    value = body[key]
    if not isinstance(value, list):
        raise Invalid(f"key {key!r} of the result file is not a list (one entry per request)")
    if n is not None and len(value) != n:
        raise Invalid(f"key {key!r} of the result file has {len(value)} entries where "
                      f"{SAMPLE_LISTS[0]!r} has {n}: one per request in each")
    return value


def _numbers(key: str, values: Sequence[Any], least: float = -math.inf) -> None:
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < least:
            more = f" of at least {least:g}" if math.isfinite(least) else ""
            raise Invalid(f"entry {i} of {key!r} is not a finite number{more}: {str(v)[:60]!r}")


def _samples(body: Mapping[str, Any]) -> list[Sample]:
    """One sample per request of a detailed file; none for a file without its lists."""
    if not any(key in body for key in DETAILED_LISTS):
        return []
    for key in SAMPLE_LISTS:
        if key not in body:
            raise Invalid(f"the result file has per-request lists but no {key!r}: a file "
                          f"written with --save-detailed has all of {', '.join(SAMPLE_LISTS)}")
    n = len(_list(body, SAMPLE_LISTS[0], None))
    lists = {key: _list(body, key, n) for key in SAMPLE_LISTS}
    lists |= {key: _list(body, key, n) for key in OPTIONAL_LISTS if body.get(key) is not None}
    for key in ("ttfts", "latencies"):
        _numbers(key, lists[key], least=0.0)
    for key in ("start_times", "queue_times"):
        if key in lists:
            _numbers(key, lists[key])
    for key in ("input_lens", "output_lens"):
        for i, v in enumerate(lists[key]):
            _count(f"entry {i} of {key!r}", v)
    for i, gaps in enumerate(lists["itls"]):
        if not isinstance(gaps, list):
            raise Invalid(f"entry {i} of 'itls' is not a list of gaps")
        _numbers(f"itls[{i}]", gaps, least=0.0)
    ends = [s + t for s, t in zip(lists["start_times"], lists["latencies"], strict=True)]
    if n and max(ends) - min(lists["start_times"]) > MAX_SPAN_S:
        raise Invalid(f"the requests of the result file span {max(ends) - min(lists['start_times']):.3g} s "
                      f"from the first start to the last end; at most {MAX_SPAN_S} s is taken")
    errors = lists.get("errors")
    texts = lists.get("generated_texts")
    queued = lists.get("queue_times")
    out = []
    for i in range(n):
        error = str(errors[i] or "") if errors is not None else ""
        start = float(lists["start_times"][i])
        out.append(Sample(
            index=i, prompt_len=int(lists["input_lens"][i]), output_tokens=int(lists["output_lens"][i]),
            ttft=float(lists["ttfts"][i]), itl=[float(g) for g in lists["itls"][i]],
            latency=float(lists["latencies"][i]), start_time=start,
            # vLLM's result has no success flag: a failed request has its error, or no output.
            success=not error if errors is not None else int(lists["output_lens"][i]) > 0,
            error=error,
            due_time=start - float(queued[i]) if queued is not None else None,
            generated_text=str(texts[i] or "") if texts is not None else "",
        ))
    return out


def _spec(body: Mapping[str, Any], samples: Sequence[Sample]) -> dict[str, Any]:
    """The load the file describes, as a spec of ``mode`` ``prefill``."""
    completed = _number(body, "completed")
    ok = [s for s in samples if s.success]
    if ok:
        input_len = sum(s.prompt_len for s in ok) / len(ok)
        output_len = sum(s.counted_output_tokens() for s in ok) / len(ok)
    else:
        input_len = _number(body, "total_input_tokens") / completed if completed else 1
        output_len = _number(body, "total_output_tokens") / completed if completed else 1
    rate = body.get("request_rate")
    block = body.get("decodebench")
    ours: Mapping[str, Any] = block if isinstance(block, Mapping) else {}
    data: dict[str, Any] = {
        "input_len": max(1, round(input_len)), "output_len": max(1, round(output_len)),
        "num_prompts": int(_number(body, "num_prompts")),
        "max_concurrency": body.get("max_concurrency"),
        "request_rate": None if rate in (None, "inf") or rate == math.inf else rate,
        "burstiness": body.get("burstiness", 1.0),
        # A decodebench export read back keeps its mode and fill values.
        "mode": ours.get("mode", "prefill"),
    }
    if isinstance(ours.get("fill"), Mapping):
        data["fill"] = ours["fill"]
    if body.get("ramp_up_strategy") is not None:
        data["ramp_up"] = {"strategy": body["ramp_up_strategy"], "start_rps": body.get("ramp_up_start_rps"),
                           "end_rps": body.get("ramp_up_end_rps")}
    try:
        # The model is a name from elsewhere: kept as written, never looked up here.
        spec = RunSpec.model_validate(data).model_dump()
    except ValidationError as exc:
        raise Invalid(f"the result file describes no load decodebench can hold: {describe(exc)}") from exc
    spec["model"] = str(body["model_id"])
    return spec


def _summary(body: Mapping[str, Any], samples: Sequence[Sample], duration: float) -> dict[str, Any]:
    """The file's figures, with the keys only decodebench computes added from its requests."""
    summary: dict[str, Any] = {}
    for key, value in body.items():
        if key in SUMMARY_KEYS or key.endswith("_ms"):
            summary[key] = None if value is None else _number(body, key)
            if key in INTEGER_KEYS and summary[key] is not None and summary[key] == int(summary[key]):
                summary[key] = int(summary[key])  # counts stay counts: "8 requests", not "8.00"
    if samples:
        ours: dict[str, Any] = {**summarize(samples, duration), **summary_intervals(samples)}
        summary |= {k: v for k, v in ours.items() if k not in summary}
    return summary


def _provenance(body: Mapping[str, Any], spec: Mapping[str, Any], detailed: bool) -> dict[str, Any]:
    known = {*HEADER_KEYS, *SUMMARY_KEYS, *SAMPLE_LISTS, *OPTIONAL_LISTS, *OTHER_KNOWN}
    metadata = {k: v for k, v in body.items() if k not in known and not k.endswith("_ms")}
    record = provenance.snapshot(None, spec, "auto", None, {})
    versions = {name: str(metadata[key])
                for name, key in (("vllm", "vllm_version"), ("torch", "torch_version")) if key in metadata}
    record |= {
        "prefill": PREFILLED_ELSEWHERE if spec["mode"] == "prefill" else record["prefill"],
        "load_format": None, "weights": None, "versions": versions or None,
        "imported": {
            "from": "vllm bench serve --save-result" + (" --save-detailed" if detailed else ""),
            **{k: body[k] for k in HEADER_KEYS if k in body},
            # --metadata KEY=VALUE pairs and any other key the file had.
            "metadata": metadata,
        },
    }
    try:
        json.dumps(record, allow_nan=False)
    except ValueError as exc:
        raise Invalid("the result file holds NaN or Infinity in a key that is no figure") from exc
    return record


def utc_offset(text: str) -> timedelta:
    """``+HH:MM``/``-HH:MM`` (or ``Z``) as a timedelta; Invalid otherwise."""
    text = text.strip()
    if text == "Z":
        return timedelta(0)
    found = re.fullmatch(r"([+-])(\d{2}):?(\d{2})", text)
    if found is None or int(found[2]) > 14 or int(found[3]) > 59:
        raise Invalid(f"utc_offset {text[:20]!r} is not an offset from UTC as +HH:MM or -HH:MM "
                      "(between -14:00 and +14:00)")
    offset = timedelta(hours=int(found[2]), minutes=int(found[3]))
    return -offset if found[1] == "-" else offset


def read_result(body: Any, offset: timedelta = timedelta(0)) -> Imported:
    """An imported run from the JSON of one ``vllm bench serve --save-result`` file;
    Invalid naming the first missing or unreadable key. ``offset``: from UTC, of the clock
    that wrote the file's ``date`` (vLLM writes the local time of the host that ran it,
    without its offset)."""
    if not isinstance(body, Mapping):
        raise Invalid("a vllm bench serve result file is one JSON object; got "
                      f"{type(body).__name__}")
    for key in REQUIRED_KEYS:
        if key not in body:
            raise Invalid(f"not a vllm bench serve result: key {key!r} is missing "
                          f"(a result file has {', '.join(REQUIRED_KEYS)})")
    if not isinstance(body["model_id"], str) or not 0 < len(body["model_id"].strip()) <= 512:
        raise Invalid("key 'model_id' of the result file is not a model name (1 to 512 characters)")
    for key in SUMMARY_KEYS:
        if body.get(key) is not None:
            _number(body, key)
    for key in COUNT_KEYS:
        _count(f"key {key!r}", body[key])
    try:
        finished = (datetime.strptime(str(body["date"]), DATE_FORMAT)
                    .replace(tzinfo=timezone(offset)).astimezone(UTC))
    except ValueError as exc:
        raise Invalid(f"key 'date' of the result file is not {DATE_FORMAT}: "
                      f"{str(body['date'])[:40]!r}") from exc
    duration = _number(body, "duration")
    samples = _samples(body)
    if int(body["completed"]) == 0 or (samples and not any(s.success for s in samples)):
        raise Invalid(f"every request of the result file failed (completed {int(body['completed'])}, "
                      f"failed {int(body['failed'])}): it measured nothing to import")
    spec = _spec(body, samples)
    provenance = _provenance(body, spec, bool(samples))
    provenance["imported"]["date_utc_offset"] = _offset_text(offset)
    return Imported(spec=spec, summary=_summary(body, samples, duration), samples=samples,
                    provenance=provenance, finished_at=finished, duration=duration)


def _offset_text(offset: timedelta) -> str:
    minutes = int(offset.total_seconds() // 60)
    sign = "-" if minutes < 0 else "+"
    return f"{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"


def started_at(found: Imported) -> datetime:
    """When the imported run began: its file's date (written at its end) less its duration."""
    return found.finished_at - timedelta(seconds=found.duration)
