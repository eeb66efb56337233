"""A run's downloads: vLLM-bench-compatible JSON and the CSV of its samples, both streamed
from slices of the stored samples (a run can hold more than fits in memory at once)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from sqlalchemy import Engine

from service.analysis.bursts import is_bunched
from service.analysis.vllm_result import selected_stats
from service.core.errors import Conflict, Invalid
from service.core.sample import Sample
from service.storage import measurements, store
from service.storage.tables import Run
from service.web.deps import DB, READ
from service.web.downloads import csv_attachment
from service.web.errors import ERROR_RESPONSES
from service.web.vllm_export import result_pieces, run_result, vllm_info

router = APIRouter(responses=ERROR_RESPONSES)

CSV_FIELDS = [
    "index", "prompt_len", "output_tokens", "success", "ttft", "tpot", "latency",
    "start_time", "due_time", "sent_time", "itl_count", "itl", "bunched", "error",
    # Last, so that columns read by position keep theirs: "fill" or "prefill".
    "mode",
]


def csv_row(s: Sample, mode: str) -> dict[str, Any]:
    """One sample as a row of the run's CSV; ``tpot`` as the summary counts it (``Sample.tpot``)."""
    tpot = s.tpot()
    return {
        "index": s.index, "mode": mode, "prompt_len": s.prompt_len, "output_tokens": s.output_tokens,
        "success": s.success, "ttft": s.ttft, "tpot": "" if tpot is None else tpot,
        "latency": s.latency, "start_time": s.start_time, "due_time": s.due_time, "sent_time": s.sent_time,
        "itl_count": len(s.itl), "itl": " ".join(f"{x:.6f}" for x in s.itl),
        "bunched": is_bunched(s), "error": s.error,
    }


def _csv_rows(engine: Engine, run: Run) -> Iterator[dict[str, Any]]:
    mode = run.spec.get("mode", "fill")
    for found in measurements.sample_slices(engine, run.id):
        for s in found:
            yield csv_row(s, mode)


# What vllm bench serve writes without --percentile-metrics and --metric-percentiles (text models).
VLLM_DEFAULT_METRICS = "ttft,tpot,itl"
VLLM_DEFAULT_PERCENTILES = "99"
def _metadata(items: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` items as vLLM's --metadata reads them (split at the first ``=``)."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise Invalid(f"metadata {item!r} is not KEY=VALUE")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def _selected(engine: Engine, run: Run, metrics: str, percentiles: str) -> dict[str, float]:
    """``selected_stats`` of a run's samples, for options given as vLLM's flags take them."""
    try:
        chosen = [float(p) for p in percentiles.split(",")]
    except ValueError as error:
        raise Invalid(f"metric_percentiles {percentiles!r}: {error}") from None
    if any(not 0 <= p <= 100 for p in chosen):
        raise Invalid(f"metric_percentiles {percentiles!r}: each must be within 0-100")
    spec = run.spec
    try:
        samples = [x for found in measurements.sample_slices(engine, run.id) for x in found]
        return selected_stats(samples, metrics.split(","), chosen,
                              spec.get("max_concurrency"), spec.get("request_rate"))
    except ValueError as error:
        raise Invalid(f"percentile_metrics: {error}") from None


@router.get(
    "/api/runs/{run_id}/export", response_model=None, dependencies=READ,
    responses={200: {"description": "vLLM result JSON, or CSV of the samples",
                     "content": {"application/json": {}, "text/csv": {}}}},
)
def export_run(
    run_id: str,
    engine: DB,
    format: Literal["vllm", "csv"] = "vllm",
    percentile_metrics: Annotated[str | None, Query(max_length=200, description=(
        "As vllm bench serve's --percentile-metrics (e.g. `ttft,tpot,itl`): only these metrics' "
        "statistics, computed from the samples; decodebench's own decode figures then go to the "
        "`decodebench` block"))] = None,
    metric_percentiles: Annotated[str | None, Query(max_length=200, description=(
        "As --metric-percentiles (e.g. `50,99.9`); with either option unset, vLLM's default "
        "(`ttft,tpot,itl` and `99`) stands for it"))] = None,
    detailed: Annotated[bool, Query(description=(
        "As --save-detailed: keep the per-request lists (input_lens, itls, ...); without it, "
        "they are left out as vLLM leaves them out"))] = True,
    label: Annotated[str | None, Query(max_length=200, description="As --label")] = None,
    backend: Annotated[Literal["openai", "vllm"], Query(description=(
        "As --backend: the name written under `backend` (both drive /v1/completions, streamed)"))
    ] = "openai",
    metadata: Annotated[list[str] | None, Query(max_length=32, description=(
        "As --metadata KEY=VALUE, repeated"))] = None,
) -> StreamingResponse:
    """The run as vLLM-bench-compatible JSON, or its samples as CSV. With the options named
    like ``vllm bench serve``'s, the file has the keys that command writes for them."""
    run = store.get_run(engine, run_id)
    name = f"decodebench-{run.id}"
    if format == "csv":
        return csv_attachment(name, CSV_FIELDS, _csv_rows(engine, run))
    if run.summary is None:
        raise Conflict(f"run {run_id} has no summary yet (status {run.status})")
    info = vllm_info(engine, run)
    if label is not None:
        info["label"] = label
    info["backend"] = backend
    info["metadata"] = {**_metadata(metadata or []), **info["metadata"]}
    stats = None
    if percentile_metrics is not None or metric_percentiles is not None:
        stats = _selected(engine, run, percentile_metrics or VLLM_DEFAULT_METRICS,
                          metric_percentiles or VLLM_DEFAULT_PERCENTILES)
        info["metadata"]["decodebench"]["decode"] = {
            k: v for k, v in run.summary.items() if k.startswith("decode_")}
    result = run_result(engine, run, detailed, info, stats)
    return StreamingResponse(result_pieces(engine, run_id, result), media_type="application/json",
                             headers={"Content-Disposition": f'attachment; filename="{name}.json"'})


