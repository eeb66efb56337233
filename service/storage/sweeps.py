"""Reads and writes of sweeps: a grid of runs over one base spec."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, delete, func
from sqlmodel import Session, col, select

from service.core.errors import Conflict, Invalid, NotFound, shown
from service.core.ids import new_id
from service.core.spec import MAX_REPEATS, RunSpec, point_key
from service.core.status import FINISHED
from service.core.sweep import MAX_SWEEP_RUNS, SweepCreate, TrialsCreate
from service.storage.cascade import delete_runs
from service.storage.db import write_session
from service.storage.store import queue_in_order, status_counts, trial_runs
from service.storage.tables import Run, Sweep


def _spec_value(spec: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        spec = spec[part]
    return spec


def _interleave(grid_keys: Sequence[str], per_point: Sequence[Sequence[Run]],
                rng: random.Random) -> list[Run]:
    """The runs of every point (``per_point[i][k]``: trial ``k`` of point ``i``) in queue
    order: trial by trial across the points (A B C A B C), so drift over time spreads over
    every point instead of landing on one. In a sweep over ``mode`` the fill and the
    prefill trial ``k`` of one point are a pair, queued back to back in an order drawn per
    pair; both get the pair's id and their place in it."""
    others = [k for k in grid_keys if k != "mode"]
    bases: dict[tuple[Any, ...], list[Sequence[Run]]] = {}
    for trials in per_point:
        spec = trials[0].spec
        key = tuple(_spec_value(spec, k) for k in others) if "mode" in grid_keys else (id(trials),)
        bases.setdefault(key, []).append(trials)
    out: list[Run] = []
    for k in range(max(len(t) for t in per_point)):
        for arms in bases.values():
            now = [trials[k] for trials in arms if k < len(trials)]
            if len(now) == 2:
                if rng.random() < 0.5:
                    now.reverse()
                pair = new_id("p")
                for order, run in enumerate(now):
                    run.pair_id, run.pair_order = pair, order
            out.extend(now)
    return out


def create_sweep(engine: Engine, body: SweepCreate, rng: random.Random | None = None) -> Sweep:
    """Insert a sweep and one queued run per grid point and trial, all or nothing."""
    try:
        points = body.points()
    except ValueError as exc:
        raise Invalid(str(exc)) from exc
    sweep = Sweep(id=new_id("s"), base=body.base.model_dump(), grid=body.grid.axes(),
                  options=body.options())
    per_point = [trial_runs(spec, sweep.id) for _, spec in points]
    runs = _interleave(list(sweep.grid), per_point, rng or random.Random())
    queue_in_order(runs)
    with write_session(engine) as session:
        session.add(sweep)
        session.add_all(runs)
    return sweep


def _selected(grid: dict[str, list[Any]], point: dict[str, Any] | None) -> dict[str, Any]:
    """The grid values ``point`` selects by, checked against the grid."""
    if not point:
        return {}
    unknown = [k for k in point if k not in grid]
    if unknown:
        raise Invalid(f"point names {', '.join(map(shown, unknown))}, which the grid does not "
                      f"sweep; it sweeps {', '.join(grid)}")
    if "mode" in point and "mode" in grid and len(grid["mode"]) > 1:
        raise Invalid("trials of a sweep over mode are added as fill/prefill pairs: leave mode "
                      "out of the point")
    return point


def add_trials(engine: Engine, sweep_id: str, body: TrialsCreate,
               rng: random.Random | None = None, *, for_rule: bool = False) -> list[Run]:
    """Queue ``body.count`` more trials of every point ``body.point`` selects (pairs of a
    sweep over mode), after what is queued; trial ``k`` runs with seed ``seed + k`` like
    the first ones. A point that had one run becomes a group of trials. The new runs.
    ``for_rule``: a look of the sweep's until_decided rule, which adds nothing once the rule
    was stopped (checked in the write, so a cancel's stop before it wins)."""
    sweep, runs = get_sweep(engine, sweep_id)
    grid: dict[str, list[Any]] = sweep.grid
    wanted = _selected(grid, body.point)
    arms: dict[str, list[Run]] = {}
    for run in runs:
        arms.setdefault(run.group_id or run.id, []).append(run)
    chosen = [trials for trials in arms.values()
              if all(_spec_value(trials[0].spec, k) == v for k, v in wanted.items())]
    if not chosen:
        raise Invalid(f"no point of sweep {shown(sweep_id)} has {wanted}")
    total = len(runs) + body.count * len(chosen)
    if total > MAX_SWEEP_RUNS:
        raise Conflict(f"{body.count} more trials of {len(chosen)} runs' points make {total} runs, "
                       f"more than a sweep's cap of {MAX_SWEEP_RUNS}")
    regrouped: list[Run] = []
    per_point: list[list[Run]] = []
    for trials in chosen:
        trials.sort(key=lambda r: r.trial or 0)
        first = trials[0]
        if len(trials) + body.count > MAX_REPEATS:
            raise Conflict(f"a point of {len(trials)} trials with {body.count} more has more than "
                           f"{MAX_REPEATS} trials")
        group = first.group_id
        if group is None:
            group = first.group_id = new_id("g")
            first.trial = 0
            regrouped.append(first)
        start = max(r.trial or 0 for r in trials) + 1
        seed = int(first.spec["seed"]) - (first.trial or 0)
        new = []
        for k in range(start, start + body.count):
            spec = RunSpec.stored({**first.spec, "seed": (seed + k) % 2**32}).model_dump()
            new.append(Run(id=new_id("r"), spec=spec, model=first.model, total=first.total,
                           sweep_id=sweep.id, group_id=group, trial=k, point=point_key(spec)))
        per_point.append(new)
    added = _interleave(list(grid), per_point, rng or random.Random())
    queue_in_order(added)
    with write_session(engine) as session:
        # BEGIN IMMEDIATE, like ``stop_rule``'s: one of the two writes comes first. After
        # the stop, nothing; before it, the cancel that stopped it finds these runs.
        stored_sweep = session.get(Sweep, sweep_id)
        if for_rule and (stored_sweep is None
                         or ((stored_sweep.options or {}).get("until_decided") or {}).get("stopped")):
            return []
        for run in regrouped:
            stored = session.get(Run, run.id)
            assert stored is not None
            stored.group_id, stored.trial = run.group_id, run.trial
            session.add(stored)
        session.add_all(added)
    return added


def get_sweep(engine: Engine, sweep_id: str) -> tuple[Sweep, list[Run]]:
    """A sweep and its runs, in grid order; or NotFound."""
    with Session(engine) as session:
        sweep = session.get(Sweep, sweep_id)
        if sweep is None:
            raise NotFound(f"sweep {shown(sweep_id)} not found")
        runs = session.exec(
            select(Run).where(Run.sweep_id == sweep_id).order_by(col(Run.created_at), col(Run.id))
        ).all()
        return sweep, list(runs)


def sweep_row(engine: Engine, sweep_id: str) -> Sweep | None:
    """A sweep without its runs (its base, grid and options), or None."""
    with Session(engine) as session:
        return session.get(Sweep, sweep_id)


def stop_rule(engine: Engine, sweep_id: str, why: str) -> bool:
    """Stop a sweep's ``until_decided`` rule: it queues no more pairs. False when the sweep
    has no rule (or it was stopped already)."""
    with write_session(engine) as session:
        sweep = session.get(Sweep, sweep_id)
        if sweep is None:
            raise NotFound(f"sweep {shown(sweep_id)} not found")
        until = (sweep.options or {}).get("until_decided")
        if not until or until.get("stopped"):
            return False
        sweep.options = {**(sweep.options or {}), "until_decided": {**until, "stopped": why}}
        session.add(sweep)
        return True


def ruled_sweep_ids(engine: Engine) -> list[str]:
    """The ids of the sweeps with an ``until_decided`` rule, oldest first."""
    with Session(engine) as session:
        rule = func.json_extract(col(Sweep.options), "$.until_decided")
        found = session.exec(select(Sweep.id).where(rule.is_not(None))
                             .order_by(col(Sweep.created_at))).all()
        return list(found)


def list_sweeps(engine: Engine, limit: int) -> list[tuple[Sweep, dict[str, int]]]:
    """The newest sweeps with counts of their runs by status."""
    with Session(engine) as session:
        sweeps = session.exec(
            select(Sweep).order_by(col(Sweep.created_at).desc()).limit(limit)
        ).all()
        out = []
        for sweep in sweeps:
            rows = session.exec(
                select(Run.status, func.count()).where(Run.sweep_id == sweep.id).group_by(Run.status)
            ).all()
            counts = {status: int(n) for status, n in rows}
            counts["total"] = sum(counts.values())
            out.append((sweep, counts))
        return out


def sweep_page(engine: Engine, limit: int, offset: int) -> tuple[list[tuple[Sweep, dict[str, int]]], int]:
    """A page of sweeps, newest first, each with the counts of its runs by status; and how
    many sweeps there are."""
    with Session(engine) as session:
        sweeps = list(session.exec(
            select(Sweep).order_by(col(Sweep.created_at).desc(), col(Sweep.id).desc())
            .offset(offset).limit(limit)
        ).all())
        counts = status_counts(session, Run.sweep_id, [sweep.id for sweep in sweeps])
        total = session.exec(select(func.count()).select_from(Sweep)).one()
        return [(sweep, counts[sweep.id]) for sweep in sweeps], int(total)


def delete_sweep(engine: Engine, sweep_id: str) -> list[str]:
    """Delete a sweep whose runs have all finished, with its runs and everything stored for
    them (samples, server metric points, the baselines its runs and groups are), all or
    nothing; the ids of the deleted runs. NotFound for an unknown sweep, Conflict while a
    run of it has not finished."""
    with write_session(engine) as session:
        if session.get(Sweep, sweep_id) is None:
            raise NotFound(f"sweep {shown(sweep_id)} not found")
        runs = list(session.exec(select(Run).where(Run.sweep_id == sweep_id)).all())
        active = [r for r in runs if r.status not in FINISHED]
        if active:
            raise Conflict(f"sweep {sweep_id} has {len(active)} runs not finished "
                           f"(e.g. {active[0].id}, {active[0].status}): cancel it first "
                           f"(POST /api/sweeps/{sweep_id}/cancel), then delete it")
        ids = [r.id for r in runs]
        arms = ids + sorted({r.group_id for r in runs if r.group_id})
        delete_runs(session, ids, arms)
        session.exec(delete(Sweep).where(col(Sweep.id) == sweep_id))
        return ids
