"""Groups (the trials of a point), comparisons of runs or groups, baselines and regressions."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from service.analysis import comparison
from service.core.errors import Conflict, Invalid, NotFound, shown
from service.core.status import FINISHED
from service.storage import baselines, store
from service.web.cancelling import cancel_one
from service.web.deps import ADMIN, DB, READ, Sched
from service.web.errors import ERROR_RESPONSES
from service.web.schemas import GroupPublic, RunPublic

router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/api/groups/{group_id}", response_model=GroupPublic, dependencies=READ)
def get_group(group_id: str, engine: DB) -> GroupPublic:
    """The trials of a run with ``repeats`` and each figure over them: mean, Student-t
    95% interval and coefficient of variation."""
    view = comparison.group_view(engine, group_id)
    return GroupPublic(id=view["id"], spec=view["spec"], runs=[RunPublic.of(r) for r in view["runs"]],
                       succeeded=view["succeeded"], figures=view["figures"])


@router.post("/api/groups/{group_id}/cancel", response_model=GroupPublic, dependencies=ADMIN)
def cancel_group(group_id: str, engine: DB, scheduler: Sched) -> GroupPublic:
    """Cancel every trial of a point that has not finished; 409 when all have."""
    if not group_id.startswith("g-"):
        raise NotFound(f"group {shown(group_id)} not found")
    runs = store.arm_runs(engine, group_id)
    cancelled = 0
    for run in runs:
        if run.status not in FINISHED and cancel_one(engine, scheduler, run.id,
                                                      "cancelled by the user (its group)"):
            cancelled += 1
    if not cancelled:
        raise Conflict(f"every trial of {group_id} already finished; nothing to cancel")
    return get_group(group_id, engine)


@router.get("/api/compare", dependencies=READ)
def compare(
    engine: DB, ids: Annotated[list[str], Query(max_length=comparison.MAX_COMPARED)],
) -> dict[str, Any]:
    """Runs or groups against the first: per metric each one's value with its 95% interval,
    the ratio to the first with its interval, and a verdict (different / not
    distinguishable at 95%; better / worse)."""
    chosen = comparison.split_ids(ids)
    if len(chosen) < 2 or len(chosen) > comparison.MAX_COMPARED:
        raise Invalid(f"give 2 to {comparison.MAX_COMPARED} run or group ids in ids (comma-separated or "
                      f"repeated); got {len(chosen)}")
    return comparison.compare(engine, chosen)


@router.post("/api/runs/{run_id}/baseline", dependencies=ADMIN)
def mark_baseline(run_id: str, engine: DB) -> dict[str, Any]:
    """Make a run (a trial: its whole group) the baseline of its point (model, engine and
    load); 409 until it has succeeded."""
    return comparison.mark_baseline(engine, run_id)


@router.delete("/api/runs/{run_id}/baseline", status_code=204, dependencies=ADMIN)
def unmark_baseline(run_id: str, engine: DB) -> Response:
    """Stop a run (or its group) being its point's baseline; 409 when it is none."""
    comparison.unmark_baseline(engine, run_id)
    return Response(status_code=204)


@router.get("/api/runs/{run_id}/baseline", dependencies=READ)
def against_baseline(run_id: str, engine: DB) -> dict[str, Any]:
    """A run's point against its baseline: per regression metric the ratio with its 95%
    interval and verdict; ``baseline`` null when its point has none."""
    found = comparison.against_baseline(engine, store.get_run(engine, run_id))
    return found or {"baseline": None, "is_baseline": False, "changes": []}


@router.get("/api/baselines", dependencies=READ)
def list_baselines(engine: DB) -> list[dict[str, Any]]:
    """Every baseline: its point key, arm and model, newest first."""
    return [{"point": b.point, "arm": b.arm, "model": b.model, "created_at": b.created_at.isoformat()}
            for b in baselines.list_baselines(engine)]


@router.get("/api/regressions", dependencies=READ)
def regressions(engine: DB) -> list[dict[str, Any]]:
    """Points whose newest run (or group) is significantly worse than the point's baseline
    on median or p99 TPOT, decode median ITL or median TTFT."""
    return comparison.regressions(engine)
