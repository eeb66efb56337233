"""Capacity searches at work: after each probe run ends, look at the probes whose trials
have all ended and queue the next probes the planner asks for
(``service.analysis.capacity.next_step``), until every input length is decided, stopped
or the search's run budget is spent. A search that measures the prefill side also queues
each input length's next real-prefill run (``service.analysis.prefill_rate.next_rate``),
after pooling the runs of a rate that got several (``prefill_rate.take_look``), until its
rate is bracketed; those runs have their own cap, not the budget.

Looks are taken one at a time (``_LOOKING``), as ``until_decided``'s are: two probe runs
ending together must not both see the search wanting a probe and both queue it. A look
the service did not take because it stopped between a run's end and the look is taken at
the next start (``catch_up``). Called in worker threads: the looks bootstrap intervals.

A look that raises (a stored spec or look this version cannot read) ends its search
``failed`` with the error (``storage.capacity.fail``, guarded), never leaving it active
with nothing to advance it; a database error leaves it active for the next look.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from pydantic import ValidationError
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from service.analysis import prefill_rate
from service.analysis.capacity_runs import LookDue, assess, ceiling_bound, probe_runs, take_looks
from service.core.capacity_records import PrefillPlan, SearchLooks, probe_key, rate_key
from service.core.errors import NotFound
from service.core.spec import describe
from service.storage import capacity, measurements, store
from service.storage.tables import Run

log = logging.getLogger(__name__)

# The service is one process; this lock orders its looks (see the module docstring).
_LOOKING = threading.Lock()


def follow_up(engine: Engine, run_id: str) -> int:
    """After ``run_id`` ended: when it is a probe of an active search, take the looks due
    and queue the probes that come next. How many runs were queued."""
    with _LOOKING:
        try:
            run = store.get_run(engine, run_id)
        except NotFound:
            return 0  # deleted meanwhile
        if run.capacity_id is None:
            return 0
        return _look(engine, run.capacity_id)


def catch_up(engine: Engine) -> int:
    """Take the looks missed while the service was down, for every active search. How
    many runs were queued."""
    queued = 0
    for search_id in capacity.active_ids(engine):
        with _LOOKING:
            queued += _look(engine, search_id)
    return queued


def _look(engine: Engine, search_id: str) -> int:
    """``advance``, ending the search ``failed`` with the error when the look raises: nothing
    else would ever advance it. A database error (locked, I/O) is raised: the failing write
    would meet it too, and the next look may succeed."""
    try:
        return advance(engine, search_id)
    except OperationalError:
        raise
    except Exception as exc:
        log.exception("capacity search %s: its look failed; the search ends failed", search_id)
        what = describe(exc) if isinstance(exc, ValidationError) else f"{type(exc).__name__}: {exc}"
        capacity.fail(engine, search_id, f"its look failed, so it cannot go on: {what}")
        return 0


def advance(engine: Engine, search_id: str) -> int:
    """One look at a search: bootstrap the probes whose trials all ended since their last
    look, ask the planner per input length, queue what it asks for within the run budget,
    and end the search once every input length is decided or stopped. How many runs were
    queued. Call it holding ``_LOOKING`` (``follow_up`` and ``catch_up`` do)."""
    search, runs = capacity.get_search(engine, search_id)
    if search.status != capacity.ACTIVE:
        return 0
    sla, plan, looks = search.read_sla(), search.read_plan(), search.read_looks()
    due = []
    for probes in probe_runs(runs).values():
        for probe in probes.values():
            if probe.needs_look(looks):
                trials = probe.succeeded()
                due.append(LookDue(probe_key(probe.input_len, probe.concurrency), probe.concurrency,
                                   [measurements.get_samples(engine, r.id) for r in trials],
                                   [r.id for r in trials]))
    # Drift between runs, pooled over the search's other probes (every input length: runs
    # drift as a whole), widens each probe's interval.
    looks = take_looks(due, looks, sla.metric, plan.per_look_confidence, sla.max_ms)
    prefill = plan.prefill
    if prefill is not None:
        for length in search.input_lens:
            for rate, ids in prefill_rate.looks_due(runs, length, looks):
                samples = [measurements.get_samples(engine, run_id) for run_id in ids]
                looks.rates[rate_key(length, rate)] = prefill_rate.take_look(
                    samples, ids, prefill.ttft_p99_max_ms, prefill_rate.per_look(prefill))
    bound = ceiling_bound(search.max_concurrency, plan.ceiling)
    contexts = assess(search.input_lens, sla.max_ms, bound, runs, looks, search.ended,
                      trial_cap=plan.trial_cap)
    ended = dict(search.ended)
    wanted: list[tuple[int, int]] = []
    left = search.max_runs - sum(not prefill_rate.is_prefill_run(r) for r in runs)
    for context in contexts:
        step, key = context.step, str(context.input_len)
        if key in ended or step.done or step.wait:
            continue
        if step.error is not None:
            ended[key] = step.error
        elif len(step.queue) > left:
            ended[key] = (f"max_runs ({search.max_runs}) spent before the boundary was decided "
                          f"(it asked for {len(step.queue)} more at {', '.join(map(str, step.queue))})")
        else:
            wanted += [(context.input_len, c) for c in step.queue]
            left -= len(step.queue)
    rates, measuring = _prefill_steps(prefill, search.input_lens, runs, looks, ended)
    over = (all(c.step.done or str(c.input_len) in ended for c in contexts) and not wanted
            and not measuring)
    status = error = None
    if over:
        status = "failed" if ended else "succeeded"
        error = "; ".join(_why(k, why) for k, why in ended.items()) or None
    added = capacity.advance(engine, search_id, looks.stored(), ended, wanted, status, error, rates)
    if added is None:
        return 0  # cancelled while this look was taken
    if added:
        log.info("capacity search %s: queued %s", search_id,
                 ", ".join([f"{length}@{c}" for length, c in wanted]
                           + [f"prefill {length}@{rate:g}/s" for length, rate in rates]))
    if status is not None:
        log.info("capacity search %s %s%s", search_id, status, f": {error}" if error else "")
    return len(added)


def _prefill_steps(prefill: PrefillPlan | None, input_lens: Sequence[int], runs: Sequence[Run],
                   looks: SearchLooks, ended: dict[str, str]) -> tuple[list[tuple[int, float]], bool]:
    """The prefill runs the search asks for next, as (input length, rate), and whether a
    prefill search is still under way; records in ``ended`` the ones that stopped."""
    if prefill is None:
        return [], False
    rates: list[tuple[int, float]] = []
    measuring = False
    for length in input_lens:
        key = prefill_rate.PREFILL_KEY.format(length)
        if key in ended:
            continue
        _, step = prefill_rate.step_of(runs, length, prefill, looks)
        if step.error is not None:
            ended[key] = step.error
        elif step.queue is not None:
            rates.append((length, step.queue))
            measuring = True
        elif step.wait:
            measuring = True
    return rates, measuring


def _why(key: str, why: str) -> str:
    if key.startswith("prefill "):
        return f"prefill at input_len {key.removeprefix('prefill ')}: {why}"
    return f"input_len {key}: {why}"
