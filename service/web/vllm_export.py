"""A run as vLLM's benchmark result file (``vllm bench serve --save-result``), its
per-request lists written from slices of the stored samples: for a run's export and for the
files of a sweep's or search's ``vllm bench sweep`` folder."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from sqlalchemy import Engine

from service.analysis import server_metrics
from service.analysis.vllm_result import VLLM_REQUEST_LISTS, vllm_result
from service.core import provenance
from service.core.protocol import connector_totals
from service.core.sample import Sample
from service.core.spec import effective_load_format
from service.storage import measurements
from service.storage.tables import Run

# As JSONResponse writes JSON, so a streamed answer reads the same as one built whole.
_json = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":"))
# The per-request lists vllm bench serve leaves out of its file without --save-detailed.
VLLM_DETAILED_LISTS = ("input_lens", "output_lens", "start_times", "ttfts", "itls",
                       "generated_texts", "errors")


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


def vllm_info(engine: Engine, run: Run) -> dict[str, Any]:
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


def run_result(engine: Engine, run: Run, detailed: bool = True, info: dict[str, Any] | None = None,
               stats: dict[str, float] | None = None) -> dict[str, object]:
    """A run's vLLM result (it has a summary) with its per-request lists standing in for
    what ``result_pieces`` writes; without ``detailed``, as vLLM writes it without
    ``--save-detailed``. ``info``: what ``vllm_result`` is told (default ``vllm_info``);
    ``stats``: the latency statistics chosen (default every one of the summary)."""
    assert run.summary is not None
    lists = {key: _Streamed(key) for key, _ in VLLM_REQUEST_LISTS}
    result = vllm_result(run.summary, info or vllm_info(engine, run), lists,
                         measurements.count_samples(engine, run.id), stats)
    return result if detailed else {k: v for k, v in result.items() if k not in VLLM_DETAILED_LISTS}


def result_pieces(engine: Engine, run_id: str, result: Mapping[str, object]) -> Iterator[str]:
    """``run_result``'s dict (extra keys may be added) as JSON text, a piece at a time."""
    return _vllm_json(engine, run_id, result)


def is_request_list(value: object) -> bool:
    """Whether a value of ``run_result`` is a per-request list (written from the samples)."""
    return isinstance(value, _Streamed)


def server_points(engine: Engine, run_id: str) -> list[server_metrics.Point]:
    """A run's stored scrapes as ``server_metrics`` reads them."""
    return [server_metrics.Point(**row) for row in measurements.server_points(engine, run_id)]
