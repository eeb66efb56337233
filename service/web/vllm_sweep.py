"""A sweep (or a capacity search's probes) as the directory ``vllm bench sweep serve``
writes, in a zip archive, so that ``vllm bench sweep plot DIR`` and ``plot_pareto DIR``
read it unchanged once unpacked.

The layout, as vLLM's ``benchmarks/sweep/serve.py`` makes it:

- one folder per point, named ``BENCH--k=v-k=v`` from the point's benchmark parameters
  (``SERVE--...-BENCH--...`` when server parameters vary too), with ``/`` and ``..``
  replaced as vLLM's ``sanitize_filename`` does;
- in it ``run=N.json`` per trial: the run's ``vllm bench serve --save-result`` JSON (the
  run export's) plus ``run_number`` and the point's parameters, which is what the plots
  group by; ``run=N.failure.json`` for a trial that ended without numbers (or whose
  numbers are held out, as a capacity probe the server capped: its concurrency is not
  what the server ran); and
  ``summary.json``, the list of its trials' records, for a point with a measured trial;
- ``summary.csv`` at the top: one row per measured trial, as pandas writes vLLM's (an
  unnamed index column first); per-request lists stay in the run files.

The grid's decodebench names become vLLM's parameter names (``input_len`` is
``random_input_len``). Entries are written one after another into a zip stream, each run's
per-request lists a slice of samples at a time: the archive is never held whole.

``plot_pareto``'s tokens/s/user is each record's ``output_throughput / max_concurrency``: a
capacity probe's ``output_tokens_per_s_per_user``, not the decode rate per user (1 / TPOT)
its page and the API's ``tokens_per_s_per_user`` give (``capacity_view``).
"""

from __future__ import annotations

import csv
import io
import json
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import Engine

from service.analysis.comparison import arms_of, spec_value
from service.core.status import FINISHED, MEASURED
from service.storage.tables import Run
from service.web.vllm_export import is_request_list, result_pieces, run_result

# The names ``vllm bench serve`` gives what a decodebench grid varies; other keys keep
# theirs, dots made underscores.
VLLM_PARAMS = {"input_len": "random_input_len", "output_len": "random_output_len",
               "max_concurrency": "max_concurrency", "request_rate": "request_rate",
               "mode": "decodebench_mode", "fill.mean": "fill_mean", "fill.std": "fill_std"}
# Grid keys that configure the server rather than the benchmark (a SERVE-- part).
SERVE_PREFIX = "engine."
# Bytes of archive gathered before they are sent.
CHUNK = 1 << 16


def _sanitize(name: str) -> str:
    """As vLLM's ``sanitize_filename``: no ``/``, no ``..``, no quotes at the ends."""
    return name.replace("/", "_").replace("..", "__").strip("'").strip('"')


def _param_value(key: str, value: Any) -> Any:
    # ``vllm bench serve`` without --request-rate sends at once: its file says "inf".
    return "inf" if key == "request_rate" and value is None else value


def parameters(grid_keys: Sequence[str], spec: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A point's server and benchmark parameters under vLLM's names."""
    serve: dict[str, Any] = {}
    bench: dict[str, Any] = {}
    for key in grid_keys:
        value = _param_value(key, spec_value(dict(spec), key))
        if key.startswith(SERVE_PREFIX):
            serve[key.removeprefix(SERVE_PREFIX).replace(".", "_")] = value
        else:
            bench[VLLM_PARAMS.get(key, key.replace(".", "_"))] = value
    return serve, bench


def folder_name(serve: Mapping[str, Any], bench: Mapping[str, Any]) -> str:
    """A point's folder, as ``vllm bench sweep serve`` names it."""
    parts: list[str] = []
    for prefix, params in (("SERVE-", serve), ("BENCH-", bench)):
        if params:
            parts += [prefix, "-".join(f"{k}={v}" for k, v in params.items())]
    return _sanitize("-".join(parts))


class _Sink(io.RawIOBase):
    """Where the zip writer puts its bytes until they are sent; not seekable, so the
    writer puts each entry's sizes after its data."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[bytes] = []
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.chunks.append(chunk)
        self.size += len(chunk)
        return len(chunk)

    def take(self) -> bytes:
        out = b"".join(self.chunks)
        self.chunks.clear()
        self.size = 0
        return out


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, dict) else value


def _summary_csv(records: Sequence[Mapping[str, Any]]) -> str:
    columns: dict[str, None] = {}
    for record in records:
        columns.update(dict.fromkeys(k for k, v in record.items() if not is_request_list(v)))
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["", *columns])
    for i, record in enumerate(records):
        writer.writerow([i, *(_csv_cell(record.get(k)) for k in columns)])
    return out.getvalue()


def archive(engine: Engine, grid_keys: Sequence[str], runs: Sequence[Run], detailed: bool,
            held_out: Mapping[str, str] | None = None) -> Iterator[bytes]:
    """The zip archive of runs in vLLM's layout, a folder per point of ``grid_keys`` (a
    sweep's grid), a chunk at a time; ``held_out``: runs (by id) written as failures with
    the reason given, whatever they measured."""
    sink = _Sink()
    held_out = held_out or {}
    every: list[dict[str, Any]] = []
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_DEFLATED) as archive:

        def write(name: str, pieces: Iterator[str]) -> Iterator[bytes]:
            with archive.open(name, "w") as entry:
                for piece in pieces:
                    entry.write(piece.encode())
                    if sink.size >= CHUNK:
                        yield sink.take()

        for arm in arms_of(runs):
            serve, bench = parameters(grid_keys, arm.spec)
            folder = folder_name(serve, bench)
            measured: list[tuple[Run, dict[str, Any]]] = []
            for run in arm.runs:
                number = run.trial or 0
                if run.id in held_out and run.status in FINISHED:
                    failure = {"run_number": number, "error_type": "held_out", "error": held_out[run.id],
                               "serve_overrides": serve, "bench_overrides": bench, "run_id": run.id}
                    yield from write(f"{folder}/run={number}.failure.json",
                                     iter([json.dumps(failure, indent=2)]))
                elif run.status in MEASURED and run.summary is not None:
                    record = {**run_result(engine, run, detailed), "run_number": number, **serve, **bench}
                    measured.append((run, record))
                    yield from write(f"{folder}/run={number}.json", result_pieces(engine, run.id, record))
                elif run.status in FINISHED:
                    failure = {"run_number": number, "error_type": run.status, "error": run.error or "",
                               "serve_overrides": serve, "bench_overrides": bench, "run_id": run.id}
                    yield from write(f"{folder}/run={number}.failure.json",
                                     iter([json.dumps(failure, indent=2)]))
            if not measured:
                continue  # as vLLM leaves a point without a measured trial: no summary.json

            def trials(measured: list[tuple[Run, dict[str, Any]]] = measured) -> Iterator[str]:
                yield "["
                for i, (run, record) in enumerate(measured):
                    yield "," if i else ""
                    yield from result_pieces(engine, run.id, record)
                yield "]"

            yield from write(f"{folder}/summary.json", trials())
            every += [record for _, record in measured]
        yield from write("summary.csv", iter([_summary_csv(every)]))
    yield sink.take()
