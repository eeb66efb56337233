"""Reads and writes of capacity searches and their probe runs.

A search is ``active`` until it ends ``succeeded``, ``failed`` or ``cancelled``. Its
probes are queued and its looks recorded by ``advance``, a write that happens only while
the search is still active (checked in the same transaction), so a cancel that ended the
search first sees every probe run there will ever be.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Engine, delete, func, update
from sqlmodel import Session, col, select

from service.core.capacity import (
    FIRST_PROBE_TRIALS,
    PROBE_FIELDS,
    CapacityCreate,
    prefill_spec,
    probe_spec,
)
from service.core.capacity_records import SearchPlan
from service.core.errors import Conflict, NotFound, shown
from service.core.ids import new_id, utcnow
from service.core.mode import Mode
from service.core.spec import RunSpec, point_key
from service.core.status import FINISHED, RunStatus
from service.storage.cascade import delete_runs
from service.storage.db import write_session
from service.storage.store import SEARCH_ACTIVE, queue_in_order, status_counts
from service.storage.tables import CapacitySearch, Run

ACTIVE = SEARCH_ACTIVE


def _probe_run(search: CapacitySearch, base: RunSpec | Mapping[str, Any], input_len: int,
               concurrency: int, earlier: Sequence[Run]) -> Run:
    """The next trial of the probe at (``input_len``, ``concurrency``), not yet stored;
    ``earlier``: the probe's runs so far (its group and trials)."""
    trial = max((r.trial or 0 for r in earlier), default=-1) + 1
    group = earlier[0].group_id if earlier and earlier[0].group_id else new_id("g")
    spec = probe_spec(base, input_len, concurrency, trial, stored=True)
    data = spec.model_dump()
    return Run(id=new_id("r"), spec=data, model=spec.model, total=spec.prompt_budget(),
               capacity_id=search.id, group_id=group, trial=trial, point=point_key(data))


def _prefill_run(search: CapacitySearch, base: RunSpec | Mapping[str, Any], input_len: int,
                 rate: float, earlier: Sequence[Run] = ()) -> Run:
    """The next real-prefill run at (``input_len``, ``rate`` requests/s), not yet stored;
    ``earlier``: the runs at that rate so far (its trials)."""
    prefill = search.read_plan().prefill
    if prefill is None:
        raise ValueError(f"capacity search {search.id} measures no prefill rate: it has no prefill plan")
    spec = prefill_spec(base, input_len, rate, prefill.prompts_at(rate), len(earlier), stored=True)
    data = spec.model_dump()
    return Run(id=new_id("r"), spec=data, model=spec.model, total=spec.prompt_budget(),
               capacity_id=search.id, point=point_key(data))


def create_search(engine: Engine, body: CapacityCreate, plan: Mapping[str, Any]) -> CapacitySearch:
    """Insert a search and the first probe of each input length (one request at a time, its
    ``FIRST_PROBE_TRIALS`` trials together), with, when it measures the prefill side, each
    one's first prefill run; all or nothing."""
    # The fields each probe sets are not kept with the base: they would read as the search's.
    base = body.base.model_dump(exclude=set(PROBE_FIELDS))
    plan = dict(plan)
    if body.prefill_tokens_per_s is not None:
        # Kept with the plan (fixed at the start, in JSON): no column for a sizing input.
        plan["prefill_tokens_per_s"] = body.prefill_tokens_per_s
    if body.prefill is not None:
        # The request as asked, with the looks the caller planned for it (``plan["prefill"]``).
        plan["prefill"] = {**body.prefill.model_dump(), **(plan.get("prefill") or {})}
    # Stored as it will be read back: a plan this version cannot read is never written.
    plan = SearchPlan.read(plan).stored()
    search = CapacitySearch(id=new_id("c"), base=base, input_lens=list(body.input_lens),
                            sla=body.sla.model_dump(), max_concurrency=body.max_concurrency,
                            max_runs=body.runs_budget(), plan=plan)
    # The first probe's trials up front, interleaved across input lengths: the drift
    # between runs is measured before the first verdict.
    first: dict[int, list[Run]] = {length: [] for length in body.input_lens}
    for _ in range(FIRST_PROBE_TRIALS):
        for length in body.input_lens:
            first[length].append(_probe_run(search, body.base, length, 1, first[length]))
    runs = [run for trial in zip(*first.values(), strict=True) for run in trial]
    if body.prefill is not None:
        runs += [_prefill_run(search, body.base, length, body.prefill.start_rate)
                 for length in body.input_lens]
    queue_in_order(runs)
    with write_session(engine) as session:
        session.add(search)
        session.add_all(runs)
    return search


def get_search(engine: Engine, search_id: str) -> tuple[CapacitySearch, list[Run]]:
    """A search and its runs, oldest first; or NotFound."""
    with Session(engine) as session:
        search = session.get(CapacitySearch, search_id)
        if search is None:
            raise NotFound(f"capacity search {shown(search_id)} not found")
        runs = session.exec(select(Run).where(Run.capacity_id == search_id)
                            .order_by(col(Run.created_at), col(Run.id))).all()
        return search, list(runs)


def advance(engine: Engine, search_id: str, looks: Mapping[str, Any], ended: Mapping[str, str],
            probes: Sequence[tuple[int, int]], status: str | None = None,
            error: str | None = None, rates: Sequence[tuple[int, float]] = ()) -> list[Run] | None:
    """While the search is active, in one transaction: record its ``looks`` and the input
    lengths that ``ended``, queue one trial of each probe (input length, concurrency) in
    ``probes`` in that order, then a prefill run at each (input length, rate) in ``rates``,
    and with ``status`` end it. The runs queued; None when the search was no longer active
    (nothing written)."""
    with write_session(engine) as session:
        search = session.get(CapacitySearch, search_id)
        if search is None or search.status != ACTIVE:
            return None
        runs = list(session.exec(select(Run).where(Run.capacity_id == search_id)).all())
        added: list[Run] = []
        for input_len, concurrency in probes:
            earlier = [r for r in [*runs, *added] if r.spec["input_len"] == input_len
                       and r.spec["max_concurrency"] == concurrency]
            earlier.sort(key=lambda r: r.trial or 0)
            added.append(_probe_run(search, search.base, input_len, concurrency, earlier))
        for input_len, rate in rates:
            earlier = [r for r in runs if Mode.of(r.spec).prefills_measured
                       and r.spec["input_len"] == input_len and r.spec.get("request_rate") == rate]
            added.append(_prefill_run(search, search.base, input_len, rate, earlier))
        queue_in_order(added)
        search.looks = dict(looks)
        search.ended = dict(ended)
        if status is not None:
            search.status, search.error, search.finished_at = status, error, utcnow()
        session.add(search)
        session.add_all(added)
        return added


def stop(engine: Engine, search_id: str, why: str) -> bool:
    """End an active search ``cancelled`` (guarded): it queues nothing more. False when it
    had ended already; NotFound for an unknown one."""
    with write_session(engine) as session:
        if session.get(CapacitySearch, search_id) is None:
            raise NotFound(f"capacity search {shown(search_id)} not found")
        result = session.exec(
            update(CapacitySearch).where(col(CapacitySearch.id) == search_id,
                                         col(CapacitySearch.status) == ACTIVE)
            .values(status="cancelled", error=why, finished_at=utcnow()))
        return bool(result.rowcount == 1)


def fail(engine: Engine, search_id: str, why: str) -> bool:
    """End an active search ``failed`` with ``why`` (guarded), and in the same transaction
    cancel its runs still queued: a search that ended runs nothing more (a run being
    measured finishes). False when it had ended already (or is gone)."""
    with write_session(engine) as session:
        result = session.exec(
            update(CapacitySearch).where(col(CapacitySearch.id) == search_id,
                                         col(CapacitySearch.status) == ACTIVE)
            .values(status="failed", error=why, finished_at=utcnow()))
        if result.rowcount != 1:
            return False
        # Guarded as ``store.cancel_queued`` is: a run its runner already moved on is its runner's.
        session.exec(
            update(Run).where(col(Run.capacity_id) == search_id, col(Run.status) == RunStatus.queued.value)
            .values(status=RunStatus.cancelled.value, finished_at=utcnow(),
                    error=f"not run: its capacity search failed ({why})"))
        return True


def active_ids(engine: Engine) -> list[str]:
    """The ids of the searches still active, oldest first."""
    with Session(engine) as session:
        found = session.exec(select(CapacitySearch.id).where(CapacitySearch.status == ACTIVE)
                             .order_by(col(CapacitySearch.created_at))).all()
        return list(found)


def search_page(engine: Engine, limit: int,
                offset: int) -> tuple[list[tuple[CapacitySearch, dict[str, int]]], int]:
    """A page of searches, newest first, each with the counts of its runs by status; and
    how many searches there are."""
    with Session(engine) as session:
        searches = list(session.exec(
            select(CapacitySearch).order_by(col(CapacitySearch.created_at).desc(),
                                            col(CapacitySearch.id).desc())
            .offset(offset).limit(limit)).all())
        counts = status_counts(session, Run.capacity_id, [s.id for s in searches])
        total = session.exec(select(func.count()).select_from(CapacitySearch)).one()
        return [(s, counts[s.id]) for s in searches], int(total)


def delete_search(engine: Engine, search_id: str) -> list[str]:
    """Delete an ended search whose runs have all finished, with its runs and everything
    stored for them (samples, server metric points, baselines of its runs and probes), all
    or nothing; the ids of the deleted runs. NotFound for an unknown search, Conflict while
    it is active or a run of it has not finished."""
    with write_session(engine) as session:
        search = session.get(CapacitySearch, search_id)
        if search is None:
            raise NotFound(f"capacity search {shown(search_id)} not found")
        runs = list(session.exec(select(Run).where(Run.capacity_id == search_id)).all())
        active = [r for r in runs if r.status not in FINISHED]
        if search.status == ACTIVE or active:
            what = (f"{len(active)} runs not finished (e.g. {active[0].id}, {active[0].status})"
                    if active else "is still searching")
            raise Conflict(f"capacity search {search_id} {'has ' if active else ''}{what}: cancel "
                           f"it first (POST /api/capacity/{search_id}/cancel), then delete it")
        ids = [r.id for r in runs]
        arms = ids + sorted({r.group_id for r in runs if r.group_id})
        delete_runs(session, ids, arms)
        session.exec(delete(CapacitySearch).where(col(CapacitySearch.id) == search_id))
        return ids
