"""The status machine of a run: its states and the moves allowed between them."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """Where a run is in its life."""

    queued = "queued"
    starting = "starting"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    # Measured elsewhere (a ``vllm bench serve`` result file, ``POST /api/imports``): stored
    # finished, never queued or scheduled.
    imported = "imported"


TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.queued: frozenset({RunStatus.starting, RunStatus.cancelled}),
    RunStatus.starting: frozenset({RunStatus.running, RunStatus.failed, RunStatus.cancelled}),
    RunStatus.running: frozenset({RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled}),
    RunStatus.succeeded: frozenset(),
    RunStatus.failed: frozenset(),
    RunStatus.cancelled: frozenset(),
    RunStatus.imported: frozenset(),
}


FINISHED = frozenset({RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled, RunStatus.imported})
# Finished with numbers to read: measured here, or imported.
MEASURED = frozenset({RunStatus.succeeded, RunStatus.imported})


def sources_of(target: RunStatus) -> frozenset[RunStatus]:
    """The states a run may move to ``target`` from."""
    return frozenset(s for s, targets in TRANSITIONS.items() if target in targets)
