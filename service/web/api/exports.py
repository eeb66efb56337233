"""A run's downloads: vLLM-bench-compatible JSON and the CSV of its samples, both streamed
from slices of the stored samples (a run can hold more than fits in memory at once)."""

from __future__ import annotations

import csv
import functools
import io
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response, StreamingResponse
from sqlalchemy import Engine

from service.analysis import server_metrics
from service.analysis.bursts import is_bunched
from service.analysis.vllm_result import VLLM_REQUEST_LISTS, selected_stats, vllm_result
from service.core import provenance
from service.core.errors import Conflict, Invalid
from service.core.protocol import connector_totals
from service.core.sample import Sample
from service.core.spec import effective_load_format
from service.storage import measurements, store
from service.storage.tables import Run
from service.web.api.runs import server_points
from service.web.deps import DB, READ
from service.web.errors import ERROR_RESPONSES

router = APIRouter(responses=ERROR_RESPONSES)

CSV_FIELDS = [
    "index", "prompt_len", "output_tokens", "success", "ttft", "tpot", "latency",
    "start_time", "due_time", "sent_time", "itl_count", "itl", "bunched", "error",
    # Last, so that columns read by position keep theirs: "fill" or "prefill".
    "mode",
]
# Characters of CSV gathered before they are sent.
CSV_CHUNK = 1 << 16
# As JSONResponse writes JSON, so a streamed answer reads the same as one built whole.
_json = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":"))


def _csv_lines(columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
        if out.tell() >= CSV_CHUNK:
            yield out.getvalue()
            out.seek(0)
            out.truncate()
    yield out.getvalue()


def csv_attachment(name: str, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> StreamingResponse:
    """``rows`` as a CSV download named ``name.csv``, written as they come."""
    return StreamingResponse(_csv_lines(columns, rows), media_type="text/csv",
                             headers={"Content-Disposition": f'attachment; filename="{name}.csv"'})


# A sweep's or a search's export as Dynamo's decode profile measured in one mode only.
DynamoMode = Annotated[Literal["fill", "prefill", "seeded"] | None, Query(description=(
    "With format=dynamo: only the runs of this mode (a sweep over mode measured each point in each)"))]


def dynamo_response(name: str, zipped: bytes) -> Response:
    """A zip of Dynamo's decode profile (``service.web.dynamo_export``) as a download."""
    return Response(zipped, media_type="application/zip",
                    headers={"Content-Disposition": f'attachment; filename="{name}-dynamo.zip"'})


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


class _Streamed:
    """Stands in ``vllm_result`` for a per-request list written a slice at a time."""

    def __init__(self, key: str) -> None:
        self.key = key


def _request_list(engine: Engine, run_id: str, made: str | Callable[[Sample], object]) -> Iterator[str]:
    """One per-request list of the vLLM export as JSON, a slice of samples at a time: a field
    read alone, or a value made from each sample (read without its text)."""
    yield "["
    if isinstance(made, str):
        slices: Iterator[list[Any]] = (
            [row[0] for row in found] for found in measurements.sample_columns(engine, run_id, [made]))
    else:
        slices = ([made(s) for s in found] for found in measurements.sample_slices(engine, run_id))
    first = True
    for values in slices:
        yield ("" if first else ",") + ",".join(_json(v) for v in values)
        first = False
    yield "]"


def _vllm_json(engine: Engine, run_id: str, result: Mapping[str, object]) -> Iterator[str]:
    """``result`` as JSON, each per-request list read from the samples as it is written."""
    lists = dict(VLLM_REQUEST_LISTS)
    yield "{"
    for i, (key, value) in enumerate(result.items()):
        yield ("," if i else "") + _json(key) + ":"
        if isinstance(value, _Streamed):
            yield from _request_list(engine, run_id, lists[value.key])
        else:
            yield _json(value)
    yield "}"


def _ramp_up_keys(ramp_up: dict[str, Any] | None) -> dict[str, Any]:
    """The keys vLLM's result file has when its run ramped its request rate up."""
    if not ramp_up:
        return {}
    return {"ramp_up_strategy": ramp_up["strategy"], "ramp_up_start_rps": ramp_up["start_rps"],
            "ramp_up_end_rps": ramp_up["end_rps"]}


def _vllm_info(engine: Engine, run: Run) -> dict[str, Any]:
    """What ``vllm_result`` is told about a run."""
    spec = run.spec
    summary = run.summary or {}
    return {
        "model": spec["model"],
        # A run with a stop rule sent what its rule let it send.
        "num_prompts": (run.stopped_by or {}).get("requests", spec["num_prompts"]),
        "request_rate": spec["request_rate"],
        "burstiness": spec["burstiness"],
        "max_concurrency": spec["max_concurrency"],
        "date": (run.started_at or run.created_at).strftime("%Y%m%d-%H%M%S"),
        "label": run.id,
        # vLLM's result file keeps free keys (--metadata): the headline of the run's
        # provenance as strings, as --metadata writes them; the rest in one block.
        "metadata": {**_ramp_up_keys(spec.get("ramp_up")), **provenance.export_keys(run.provenance, spec),
                     "decodebench": {
            "mode": spec["mode"], "fill": spec["fill"], "warnings": run.warnings or [],
            "provenance": run.provenance,
            "load_format": effective_load_format(
                spec["model"], spec["engine"].get("load_format", "auto")),
            "cpu_binding": run.cpu_binding, "stopped_by": run.stopped_by,
            # 95% bootstrap intervals over requests, keyed like vLLM's statistics.
            "intervals": {k: v for k, v in summary.items() if k.endswith("_ci")},
            # The run against its memory-bandwidth floor, and what its server drew.
            "roofline": summary.get("roofline"),
            "energy": summary.get("energy"),
            "group_id": run.group_id, "trial": run.trial, "seed": spec.get("seed"),
            "server_metrics": server_metrics.summarize(server_points(engine, run.id)),
            "connector": {**connector_totals((run.connector or {}).get("ranks", {})),
                          "pulls": run.connector_pulls},
        }},
    }


# What vllm bench serve writes without --percentile-metrics and --metric-percentiles (text models).
VLLM_DEFAULT_METRICS = "ttft,tpot,itl"
VLLM_DEFAULT_PERCENTILES = "99"
# The per-request lists vllm bench serve leaves out of its file without --save-detailed.
VLLM_DETAILED_LISTS = ("input_lens", "output_lens", "start_times", "ttfts", "itls",
                       "generated_texts", "errors")


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
    info = _vllm_info(engine, run)
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
    return StreamingResponse(_vllm_json(engine, run_id, result), media_type="application/json",
                             headers={"Content-Disposition": f'attachment; filename="{name}.json"'})


def run_result(engine: Engine, run: Run, detailed: bool = True, info: dict[str, Any] | None = None,
               stats: dict[str, float] | None = None) -> dict[str, object]:
    """A run's vLLM result (it has a summary) with its per-request lists standing in for
    what ``result_pieces`` writes; without ``detailed``, as vLLM writes it without
    ``--save-detailed``. ``info``: what ``vllm_result`` is told (default ``_vllm_info``);
    ``stats``: the latency statistics chosen (default every one of the summary)."""
    assert run.summary is not None
    lists = {key: _Streamed(key) for key, _ in VLLM_REQUEST_LISTS}
    result = vllm_result(run.summary, info or _vllm_info(engine, run), lists,
                         measurements.count_samples(engine, run.id), stats)
    return result if detailed else {k: v for k, v in result.items() if k not in VLLM_DETAILED_LISTS}


def result_pieces(engine: Engine, run_id: str, result: Mapping[str, object]) -> Iterator[str]:
    """``run_result``'s dict (extra keys may be added) as JSON text, a piece at a time."""
    return _vllm_json(engine, run_id, result)


def is_request_list(value: object) -> bool:
    """Whether a value of ``run_result`` is a per-request list (written from the samples)."""
    return isinstance(value, _Streamed)
