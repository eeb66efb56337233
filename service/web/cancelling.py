"""Cancelling one run, as the run, sweep, comparison and capacity routes do: through its
runner when one has it, else by the guarded moves of the store."""

from __future__ import annotations

import time

from sqlalchemy import Engine

from service.control.queue import Scheduler
from service.core.status import FINISHED
from service.storage import store

# How long a cancel waits for the run's runner to end it (it stops its drivers and saves).
CANCEL_WAIT_S = 30.0


def cancel_one(engine: Engine, scheduler: Scheduler, run_id: str, reason: str) -> bool:
    """Cancel one unfinished run: its runner's, once one has it (waited for, up to
    ``CANCEL_WAIT_S``); else the guarded move from ``queued``; else, for a run whose runner
    has ended without recording its end (its writes failed), the guarded move from
    ``starting`` or ``running``. A runner still writing its end is waited for. False when
    the run had finished."""
    deadline = time.monotonic() + CANCEL_WAIT_S
    while True:
        try:
            if scheduler.cancel(run_id).result(timeout=CANCEL_WAIT_S):
                return True
        except TimeoutError:
            return True  # its runner is still winding down; it ends ``cancelled``
        if store.cancel_queued(engine, run_id, reason):
            return True
        if store.get_run(engine, run_id).status in FINISHED:
            return False
        if not scheduler.handling(run_id):
            # Started and no runner has it: one ended without recording how (placed between
            # the looks above, a runner would have it now and ``handling`` say so).
            if store.cancel_orphaned(engine, run_id, f"{reason} (its runner had ended without "
                                     "recording its end)"):
                return True
            # Moved on meanwhile: looked at again.
        elif time.monotonic() <= deadline:
            time.sleep(0.05)  # its runner is handing it back (writing its end): waited for
        if time.monotonic() > deadline:
            return False
