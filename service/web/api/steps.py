"""A run's engine steps: the step model fitted to them (``service.analysis.step_model``)
and a bounded sample of them for a chart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query

from service.analysis.intervals import CONFIDENCE, Interval
from service.analysis.step_model import StepModel, fit
from service.core.steps import StepRow
from service.storage import steps, store
from service.storage.tables import Run
from service.web.deps import DB, READ
from service.web.errors import ERROR_RESPONSES
from service.web.schemas import StepModelPublic, StepPoint

router = APIRouter(responses=ERROR_RESPONSES)

# Decode steps, and first steps, a chart gets at most: evenly spaced in step order.
MAX_POINTS = 2000
MAX_FIRST_POINTS = 500


@router.get("/api/runs/{run_id}/steps", response_model=StepModelPublic, dependencies=READ)
def get_steps(
    run_id: str,
    engine: DB,
    confidence: Annotated[float, Query(ge=0.5, le=0.9999)] = CONFIDENCE,
) -> StepModelPublic:
    """The run's step model: forward time = fixed + per KV token + per request, fitted to its
    decode steps with HAC intervals (95%, or ``confidence``); first steps' ratio to it and
    prefill steps apart; up to 2,000 decode points (and 500 first steps) for a chart."""
    run = store.get_run(engine, run_id)
    rows = steps.run_steps(engine, run.id)
    return public(fit(rows, confidence), rows, run)


def why_none(run: Run) -> str:
    """Why a run has no steps stored."""
    if run.status == "imported":
        return "an imported run: measured elsewhere, without its engine's steps"
    if run.status in ("queued", "starting"):
        return "the run has not started measuring"
    return ("no engine steps were reported for this run: its server has no decodebench connector "
            "that times them (a registered server without it, a stub), or the run predates step timing")


def public(model: StepModel, rows: Sequence[StepRow], run: Run) -> StepModelPublic:
    """The model as the API answers it, with its points."""
    notes = list(model.notes)
    if not rows:
        notes = [why_none(run)]
    return StepModelPublic(
        steps=model.steps, first_steps=model.first_steps, prefill_steps=model.prefill_steps,
        fixed_ms=_triple(model.fixed_ms), ns_per_kv_token=_triple(model.ns_per_kv_token),
        ms_per_request=_triple(model.ms_per_request), first_step_ratio=_triple(model.first_step_ratio),
        batch=model.batch, prefill_ms=model.prefill_ms, scale_ms=model.scale_ms,
        method=model.method, notes=notes,
        points=points([r for r in rows if r.kind == "decode"], MAX_POINTS)
        + points([r for r in rows if r.kind == "first"], MAX_FIRST_POINTS),
    )


def _triple(interval: Interval | None) -> list[float] | None:
    return None if interval is None else [interval.value, interval.lo, interval.hi]


def points(rows: Sequence[StepRow], limit: int) -> list[StepPoint]:
    """At most ``limit`` of ``rows``, evenly spaced in their order."""
    if len(rows) > limit:
        rows = [rows[i] for i in np.linspace(0, len(rows) - 1, limit).round().astype(int)]
    return [StepPoint(step=r.step, kind=r.kind, decode_requests=r.decode_requests, kv_tokens=r.kv_tokens,
                      forward_ms=r.forward_ms, count=r.count) for r in rows]
