"""A sweep's ``until_decided`` rule at work: when a point's pairs have all finished, look
at its fill/prefill verdict at a planned look and queue the pairs up to the next look
while it is undecided and the budget allows (the rule: ``service.analysis.pairs``).

Looks are taken one at a time (``_LOOKING``): the two runs of a point's last pair may end
together on two servers, and two looks at once would both see the point undecided and
both queue the next look's pairs. A look the service did not take because it stopped
between a run's end and the look is taken at the next start (``catch_up``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from service.analysis.comparison import arms_of, spec_value
from service.analysis.fill_verdict import fill_vs_prefill, finished_pairs, rule_stopped, sweep_rule
from service.analysis.looks import Looks
from service.core.sweep import TrialsCreate
from service.storage import store, sweeps
from service.storage.tables import Run, Sweep

log = logging.getLogger(__name__)

# The service is one process; this lock orders its looks (see the module docstring).
_LOOKING = threading.Lock()


def follow_up(engine: Engine, run_id: str) -> int:
    """After ``run_id`` ended: queue the next look's pairs of its point when its sweep has
    the rule and the point is undecided at its look. How many pairs were queued."""
    with _LOOKING:
        return _follow_up(engine, run_id)


def catch_up(engine: Engine) -> int:
    """Take the looks missed while the service was down: one look per point of every sweep
    whose rule still runs (a point with pairs still to run, or decided, queues nothing),
    over the sweep's runs read once. How many pairs were queued."""
    queued = 0
    for sweep_id in sweeps.ruled_sweep_ids(engine):
        sweep, runs = sweeps.get_sweep(engine, sweep_id)
        rule = sweep_rule(sweep.options, int(sweep.base.get("repeats", 1)))
        if rule is None or rule_stopped(sweep.options):
            continue
        keys = [k for k in sweep.grid if k != "mode"]
        seen: list[dict[str, Any]] = []
        for run in runs:
            point = {k: spec_value(run.spec, k) for k in keys}
            if point not in seen:
                seen.append(point)
                with _LOOKING:
                    queued += _look(engine, sweep, rule, runs, point)
    return queued


def _follow_up(engine: Engine, run_id: str) -> int:
    run = store.get_run(engine, run_id)
    if run.sweep_id is None:
        return 0
    # The sweep alone first: most sweeps have no rule, and their runs are many.
    sweep = sweeps.sweep_row(engine, run.sweep_id)
    rule = None if sweep is None else sweep_rule(sweep.options, int(sweep.base.get("repeats", 1)))
    if sweep is None or rule is None or rule_stopped(sweep.options):
        return 0
    _, runs = sweeps.get_sweep(engine, run.sweep_id)
    point = {k: spec_value(run.spec, k) for k in sweep.grid if k != "mode"}
    return _look(engine, sweep, rule, runs, point)


def _look(engine: Engine, sweep: Sweep, rule: Looks, runs: Sequence[Run], mine: dict[str, Any]) -> int:
    """The look at one point (``mine``: its grid values but mode) of a sweep with the rule,
    over the sweep's ``runs``: queue the pairs up to the next look when it is undecided."""
    same = [r for r in runs if all(spec_value(r.spec, k) == v for k, v in mine.items())]
    arms = arms_of(same)
    points = [{"point": {k: spec_value(a.spec, k) for k in sweep.grid}} for a in arms]
    found = fill_vs_prefill(engine, finished_pairs(list(sweep.grid), points, arms), rule)
    if not found or found[0]["verdict"] != "undecided":
        return 0
    # Pairs queued so far (a failed trial still used up its pair of the budget).
    queued = len({r.pair_id for r in same if r.pair_id})
    upcoming = next((c for c in rule.counts if c > queued), None)
    if upcoming is None:
        return 0
    # The rule may have been stopped (the sweep cancelled) since it was read: the write
    # checks again, and queues nothing then.
    added = sweeps.add_trials(engine, sweep.id, TrialsCreate(count=upcoming - queued, point=mine or None),
                              for_rule=True)
    if not added:
        log.info("sweep %s, point %s: undecided at %d pairs; its rule was stopped meanwhile, "
                 "nothing queued", sweep.id, mine, queued)
        return 0
    log.info("sweep %s, point %s: undecided at %d pairs; %d more queued", sweep.id, mine, queued,
             upcoming - queued)
    return upcoming - queued
