"""A sweep, or a capacity search's probes, as the decode profile NVIDIA Dynamo's SLA planner
loads: a zip that, unpacked, is a profile results directory for its ``--profile-results-dir``.

The format, as Dynamo defines it (profiler: ``benchmarks/profiler/utils/profile_decode.py``,
``_profile_decode_helper``, which ``np.savez``-es it; planner:
``components/src/dynamo/planner/core/throughput/interpolation.py`` (earlier
``components/planner/src/dynamo/planner/utils/perf_interpolation.py``), ``DecodeInterpolator``,
which loads it; described in its profiler guide's "Output Format of Interpolation Data"):

- ``selected_decode_interpolation/raw_data.npz``, an ``np.savez`` archive of five arrays:
  ``x_kv_usage``, ``y_context_length``, ``z_itl``, ``z_thpt_per_gpu``: flat 1-D float64
  arrays of equal length, one entry per measured point (KV usage as a fraction 0..1,
  context length ``ISL + OSL / 2`` in tokens, ITL in ms, output tokens/s per GPU); and
  ``max_kv_tokens``, a 1-D int64 array of one element, the decode engine's KV cache in
  tokens (the planner reads ``max_kv_tokens[0]``).

Beside it, decodebench's own ``manifest.json`` (each point's runs, lengths, concurrency and
where its KV usage came from; the runs left out and why) and, when a step model is given,
``step_regression.json``. The prefill half of a profile (``selected_prefill_interpolation``)
is not written: these runs measure decode.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from sqlalchemy import Engine

from service.analysis.comparison import Arm, arms_of
from service.analysis.decode_surface import (
    ITL_KEYS,
    SurfacePoint,
    TrialFacts,
    itl_of,
    steady_kv_usage,
)
from service.analysis.intervals import Interval
from service.analysis.server_metrics import KV_USAGE
from service.analysis.step_model import fit
from service.core.errors import Conflict
from service.core.mode import Mode
from service.core.status import MEASURED
from service.storage import measurements, workers
from service.storage.steps import run_steps
from service.storage.tables import Run

NPZ_PATH = "selected_decode_interpolation/raw_data.npz"
MANIFEST_PATH = "manifest.json"
STEP_REGRESSION_PATH = "step_regression.json"

# Given the runs of the surface, the per-run step model (``sum_decode_kv_tokens -> wall_time``:
# coefficients as ``[value, lo, hi]``) to add as ``step_regression.json``; None: nothing to add.
StepRegression = Callable[[Sequence[Run]], Mapping[str, Any] | None]

# A measured KV usage this far from Dynamo's formula is said in the manifest.
KV_APART = 0.10
# Spec keys that say which point a run measures, not how: left out of a collision's reasons.
_TRIAL_KEYS = frozenset({"seed", "repeats", "stop", "num_prompts", "warmup_prompts"})


def _kv_tokens(engine: Engine, run: Run, known: dict[str, int | None]) -> int | None:
    """The run's server's KV cache in tokens: its provenance's, else its worker row's."""
    value = (run.provenance or {}).get("kv_cache_tokens")
    if isinstance(value, int) and value > 0:
        return value
    if run.worker_id is None:
        return None
    if run.worker_id not in known:
        worker = workers.get_worker(engine, run.worker_id)
        known[run.worker_id] = worker.kv_tokens if worker is not None else None
    return known[run.worker_id]


def _measured_usage(engine: Engine, run: Run, concurrency: int) -> tuple[float, int] | None:
    """The server's KV usage while all the run's requests decoded, from its stored scrapes."""
    points = [(float(p["t"]), float(p["values"][KV_USAGE]))
              for p in measurements.server_points(engine, run.id) if KV_USAGE in p["values"]]
    if not points:
        return None
    starts: list[float] = []
    ttfts: list[float] = []
    latencies: list[float] = []
    for rows in measurements.sample_columns(engine, run.id, ["start_time", "ttft", "latency", "success"]):
        for start, ttft, latency, success in rows:
            if success:
                starts.append(start)
                ttfts.append(ttft)
                latencies.append(latency)
    return steady_kv_usage(points, starts, ttfts, latencies, concurrency)


def _left_out(run: Run, mode: str | None, held_out: Mapping[str, str]) -> str | None:
    """Why a measured run is no point of the surface; None when it is one."""
    spec = run.spec
    if run.id in held_out:
        return held_out[run.id]
    if mode is not None and Mode.of(spec) != mode:
        return f"mode {spec.get('mode', 'fill')}, not the {mode} asked"
    if spec.get("max_concurrency") is None:
        return "no max_concurrency: the number of requests decoding together was not held"
    if spec.get("request_rate") is not None or spec.get("ramp_up"):
        return "a request rate was set: arrivals paced, not a fixed number of requests decoding together"
    if int(spec.get("output_len", 0)) < 2:
        return "one output token: no decode to measure"
    summary = run.summary or {}
    if itl_of(summary) is None:
        return f"no ITL in its summary ({' or '.join(ITL_KEYS)})"
    if not isinstance(summary.get("output_throughput"), int | float) or summary["output_throughput"] <= 0:
        return "no output_throughput in its summary"
    return None


def _concurrency(spec: Mapping[str, Any]) -> int:
    """The requests that decoded together: ``max_concurrency``, or fewer where fewer were sent."""
    return min(int(spec["max_concurrency"]), int(spec.get("num_prompts") or spec["max_concurrency"]))


def _trial(engine: Engine, run: Run, kv_tokens: int | None) -> TrialFacts:
    spec = run.spec
    summary = run.summary or {}
    concurrency = _concurrency(spec)
    itl = itl_of(summary)
    assert itl is not None
    measured = _measured_usage(engine, run, concurrency)
    return TrialFacts(
        run_id=run.id, input_len=int(spec["input_len"]), output_len=int(spec["output_len"]),
        concurrency=concurrency, gpus=int((spec.get("engine") or {}).get("tensor_parallel_size") or 1),
        kv_tokens=kv_tokens, itl_ms=itl[0], itl_key=itl[1],
        output_tokens_per_s=float(summary["output_throughput"]),
        kv_usage_measured=None if measured is None else measured[0],
        kv_scrapes=0 if measured is None else measured[1])


def _differing(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if k not in _TRIAL_KEYS and a.get(k) != b.get(k))


def surface(engine: Engine, what: str, runs: Sequence[Run], *, mode: str | None = None,
            held_out: Mapping[str, str] | None = None) -> tuple[list[SurfacePoint], dict[str, Any]]:
    """The surface of ``runs`` (``what``: the sweep or search, for messages): its points, one
    per probe or sweep point, and the manifest. 409 when no run measured, when the runs mix
    engines (one surface is one engine's), or mix points Dynamo's axes cannot tell apart
    (a sweep over mode: ``mode`` picks one)."""
    held_out = held_out or {}
    measured = [r for r in runs if r.status in MEASURED and r.summary is not None]
    if not measured:
        raise Conflict(f"no run of {what} has finished with numbers yet: nothing to export")
    skipped = [{"run_id": r.id, "reason": reason} for r in measured
               if (reason := _left_out(r, mode, held_out)) is not None]
    left = {s["run_id"] for s in skipped}
    kept = [r for r in measured if r.id not in left]
    if not kept:
        reasons = "; ".join(f"{s['run_id']}: {s['reason']}" for s in skipped[:5])
        raise Conflict(f"no run of {what} measured a decode point Dynamo's surface can hold ({reasons})")
    engines = {json.dumps(r.spec.get("engine") or {}, sort_keys=True) for r in kept}
    if len(engines) > 1:
        raise Conflict(f"the runs of {what} ran on {len(engines)} engine configurations "
                       f"({'; '.join(sorted(engines))}): Dynamo's decode profile describes one engine")
    arms = arms_of(kept)
    by_axes: dict[tuple[int, int, int], Arm] = {}
    for arm in arms:
        spec = arm.spec
        axes = (int(spec["input_len"]), int(spec["output_len"]), _concurrency(spec))
        other = by_axes.setdefault(axes, arm)
        if other is arm:
            continue
        keys = _differing(other.spec, spec)
        if "mode" in keys and mode is None:
            modes = sorted({str(Mode.of(r.spec)) for r in kept})
            raise Conflict(f"{what} measured each point in modes {', '.join(modes)}: Dynamo's surface "
                           "holds one value per point; export one mode (mode=...)")
        raise Conflict(f"{what} has several points at input_len {axes[0]}, output_len {axes[1]}, "
                       f"concurrency {axes[2]} that differ in {', '.join(keys) or 'their grid'}: "
                       "Dynamo's surface holds one value per point")
    known: dict[str, int | None] = {}
    kv = {r.id: _kv_tokens(engine, r, known) for r in kept}
    sizes = [v for v in kv.values() if v is not None]
    if not sizes:
        raise Conflict(f"the KV cache size of the servers {what} ran on is unknown (their /metrics "
                       "gave no vllm:cache_config_info): Dynamo's profile needs max_kv_tokens")
    # The smallest cache of the runs' servers: the planner's computed KV usage errs high, never low.
    max_kv_tokens = min(sizes)
    points = [SurfacePoint(tuple(_trial(engine, r, kv[r.id]) for r in arm.runs), max_kv_tokens)
              for arm in arms]
    points.sort(key=lambda p: (p.context_length, p.first.concurrency))
    return points, _manifest(what, points, max_kv_tokens, skipped, mode)


def spans_a_plane(points: Sequence[SurfacePoint]) -> bool:
    """Whether the points' (KV usage, context length) are not all on one line: what a
    Delaunay triangulation, and so Dynamo's interpolation, needs."""
    if len(points) < 3:
        return False
    at = np.array([(p.kv_usage, p.context_length) for p in points], dtype=np.float64)
    span = at.max(axis=0) - at.min(axis=0)
    if not np.all(span > 0):
        return False
    # Each axis scaled to its range: KV usage and tokens differ by orders of magnitude.
    scaled = (at - at.mean(axis=0)) / span
    return bool(np.linalg.matrix_rank(scaled, tol=1e-9) == 2)


def _manifest(what: str, points: Sequence[SurfacePoint], max_kv_tokens: int,
              skipped: list[dict[str, str]], mode: str | None) -> dict[str, Any]:
    warnings = []
    if not spans_a_plane(points):
        warnings.append(
            "the points lie on one line (fewer than three, one context length, or one concurrency "
            "over two context lengths): Dynamo's DecodeInterpolator interpolates with scipy's griddata "
            "(cubic), which needs points spanning a plane; measure two input lengths and two "
            "concurrencies at least")
    apart = [p for p in points for t in p.trials if t.kv_usage_measured is not None
             and abs(t.kv_usage_measured / t.kv_usage_computed(max_kv_tokens) - 1) > KV_APART]
    if apart:
        warnings.append(
            f"for {len(apart)} run(s) the measured KV usage is more than {KV_APART:.0%} off "
            "concurrency x context length / max_kv_tokens (whole blocks, a sliding window, another "
            "load); x_kv_usage holds the formula's value, as Dynamo's planner reads it back by that "
            "formula (its DecodeInterpolator looks points up by it; its profile-to-forward-pass "
            "conversion takes the batch size as x_kv_usage x max_kv_tokens / y_context_length); "
            "each trial's measured value is in this manifest")
    return {
        "format": "dynamo",
        "source": what,
        "mode": mode,
        "files": {NPZ_PATH: "NVIDIA Dynamo's decode interpolation data, as its profiler writes it "
                            "and its SLA planner's DecodeInterpolator loads it"},
        "max_kv_tokens": max_kv_tokens,
        "definitions": {
            "x_kv_usage": "fraction (0..1) of the KV cache held: the server's vllm:kv_cache_usage_perc "
                          "averaged over the scrapes taken while every request of the run decoded "
                          "(measured), else concurrency x (input_len + output_len / 2) / the server's "
                          "KV cache tokens (computed, Dynamo's own formula)",
            "y_context_length": "input_len + output_len / 2, tokens",
            "z_itl": "ms: the run's decode_median_itl_ms (steady decode window), else median_itl_ms; "
                     "Dynamo's profiler records the mean ITL",
            "z_thpt_per_gpu": "output_throughput / tensor_parallel_size, output tokens/s per GPU",
            "max_kv_tokens": "the smallest KV cache, in tokens, of the servers the runs ran on",
            "pooling": "a point's trials pooled by their mean",
        },
        "points": [
            {"index": i, "run_ids": [t.run_id for t in p.trials], "input_len": p.first.input_len,
             "output_len": p.first.output_len, "concurrency": p.first.concurrency,
             "context_length": p.context_length, "kv_usage": p.kv_usage,
             "kv_usage_source": p.kv_usage_source, "itl_ms": p.itl_ms, "thpt_per_gpu": p.thpt_per_gpu,
             "gpus": p.first.gpus,
             "trials": [{"run_id": t.run_id, "itl_ms": t.itl_ms, "itl_key": t.itl_key,
                         "output_throughput": t.output_tokens_per_s, "kv_tokens": t.kv_tokens,
                         "kv_usage_measured": t.kv_usage_measured, "kv_scrapes": t.kv_scrapes,
                         "kv_usage_computed": t.kv_usage_computed(max_kv_tokens)}
                        for t in p.trials]}
            for i, p in enumerate(points)],
        "skipped": skipped,
        "warnings": warnings,
    }


def npz_bytes(points: Sequence[SurfacePoint], max_kv_tokens: int) -> bytes:
    """The points as Dynamo's ``raw_data.npz``."""
    out = io.BytesIO()
    np.savez(
        out,
        x_kv_usage=np.array([p.kv_usage for p in points], dtype=np.float64),
        y_context_length=np.array([p.context_length for p in points], dtype=np.float64),
        z_itl=np.array([p.itl_ms for p in points], dtype=np.float64),
        z_thpt_per_gpu=np.array([p.thpt_per_gpu for p in points], dtype=np.float64),
        max_kv_tokens=np.array([max_kv_tokens], dtype=np.int64),
    )
    return out.getvalue()


def _listed(interval: Interval | None) -> list[float] | None:
    return None if interval is None else [interval.value, interval.lo, interval.hi]


def stored_step_models(engine: Engine) -> StepRegression:
    """The step regression of runs as stored: each run's step model
    (``service.analysis.step_model``) fitted on the steps its connector timed; None when no
    run has a model."""

    def regression(runs: Sequence[Run]) -> dict[str, Any] | None:
        models: dict[str, Any] = {}
        for run in runs:
            model = fit(run_steps(engine, run.id))
            if model.fixed_ms is None:
                continue
            spec = run.spec or {}
            models[run.id] = {
                "input_len": spec.get("input_len"), "max_concurrency": spec.get("max_concurrency"),
                "decode_steps": model.steps, "batch": model.batch,
                "fixed_ms": _listed(model.fixed_ms), "ns_per_kv_token": _listed(model.ns_per_kv_token),
                "ms_per_request": _listed(model.ms_per_request),
                "first_step_ratio": _listed(model.first_step_ratio),
                "method": model.method, "notes": list(model.notes)}
        if not models:
            return None
        return {"model": "wall_time_ms = fixed_ms + ns_per_kv_token * 1e-6 * sum_decode_kv_tokens "
                         "+ ms_per_request * decode_requests (fixed_ms alone holds the per-request "
                         "cost at `batch` where ms_per_request is null)", "runs": models}

    return regression


def archive(engine: Engine, what: str, runs: Sequence[Run], *, mode: str | None = None,
            held_out: Mapping[str, str] | None = None,
            step_regression: StepRegression | None = None) -> bytes:
    """The zip of Dynamo's decode profile of ``runs`` with its manifest; with
    ``step_regression``, the step model it returns for the surface's runs as well (by
    default each run's fitted on its stored steps, ``stored_step_models``)."""
    if step_regression is None:
        step_regression = stored_step_models(engine)
    try:
        points, manifest = surface(engine, what, runs, mode=mode, held_out=held_out)
    except (LookupError, TypeError, ValueError) as exc:
        # A stored run this version cannot read (a spec that no longer validates): said, never a 500.
        raise Conflict(f"the runs of {what} cannot be read: {type(exc).__name__}: {exc}") from None
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zipped:
        zipped.writestr(NPZ_PATH, npz_bytes(points, int(manifest["max_kv_tokens"])))
        used = {t.run_id for p in points for t in p.trials}
        model = step_regression([r for r in runs if r.id in used])
        if model is not None:
            zipped.writestr(STEP_REGRESSION_PATH, json.dumps(model, indent=2))
            manifest["files"][STEP_REGRESSION_PATH] = (
                "per run, the engine step model sum_decode_kv_tokens -> wall_time, each "
                "coefficient as [value, lo, hi]")
        zipped.writestr(MANIFEST_PATH, json.dumps(manifest, indent=2))
    return out.getvalue()
