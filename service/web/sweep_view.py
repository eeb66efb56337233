"""A sweep as the API and its page show it: runs, progress, points, fill against prefill,
and its points as one flat table for the export."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from service.analysis.comparison import POINT_FIGURES, spec_value
from service.analysis.fill_verdict import rule_stopped, sweep_points, sweep_rule
from service.core.status import FINISHED, RunStatus
from service.storage import sweeps
from service.web.schemas import RunPublic, SweepPublic

# Spec fields every row of a sweep's exported table carries, grid or not.
TABLE_SPEC_KEYS = ("model", "mode", "input_len", "output_len", "max_concurrency", "request_rate",
                   "num_prompts")


def sweep_public(engine: Engine, sweep_id: str) -> SweepPublic:
    """A sweep with its runs, how far they got, its points and fill against prefill."""
    sweep, runs = sweeps.get_sweep(engine, sweep_id)
    progress = {status.value: 0 for status in RunStatus}
    for run in runs:
        progress[run.status] += 1
    progress["total"] = len(runs)
    progress["finished"] = sum(progress[s.value] for s in FINISHED)
    progress["infeasible"] = sum(bool(r.error and r.error.startswith("infeasible")) for r in runs)
    repeats = int(sweep.base.get("repeats", 1))
    public = SweepPublic(id=sweep.id, base=sweep.base, grid=sweep.grid, created_at=sweep.created_at,
                         progress=progress, runs=[RunPublic.of(r) for r in runs],
                         repeats=repeats, options=sweep.options)
    public.points, public.fill_vs_prefill = sweep_points(
        engine, list(sweep.grid), runs, sweep_rule(sweep.options, repeats), rule_stopped(sweep.options))
    return public


def sweep_table(public: SweepPublic) -> tuple[list[str], list[dict[str, Any]]]:
    """A sweep's points as one flat table (``GET /api/sweeps/{id}/export``): the columns and
    one row per point, each figure with its 95% interval, spread and number of trials, and
    how many of its trials ran in fill/prefill pairs."""
    runs = {r.id: r for r in public.runs}
    keys = [*TABLE_SPEC_KEYS, *(k for k in public.grid if k not in TABLE_SPEC_KEYS)]
    columns = ["sweep", "point", *keys, "trials", "succeeded", "pairs", "runs"]
    for name in POINT_FIGURES:
        columns += [name, f"{name}_ci_lo", f"{name}_ci_hi", f"{name}_cv", f"{name}_n"]
    rows = []
    for p in public.points:
        spec = runs[p["runs"][0]].spec
        row: dict[str, Any] = {"sweep": public.id, "point": p["arm"],
                               **{k: spec_value(spec, k) for k in keys},
                               "trials": len(p["runs"]), "succeeded": p["succeeded"],
                               "pairs": len({runs[r].pair_id for r in p["runs"] if runs[r].pair_id}),
                               "runs": " ".join(p["runs"])}
        for name in POINT_FIGURES:
            fig = p["figures"].get(name) or {}
            ci = fig.get("ci") or [None, None]
            row |= {name: fig.get("value"), f"{name}_ci_lo": ci[0], f"{name}_ci_hi": ci[1],
                    f"{name}_cv": fig.get("cv"), f"{name}_n": fig.get("n")}
        rows.append(row)
    return columns, rows
