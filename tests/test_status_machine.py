"""The run status machine and its guarded transitions in SQLite."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from service.core.spec import RunSpec
from service.core.status import FINISHED, TRANSITIONS, RunStatus
from service.storage import store
from service.storage.db import make_engine
from service.storage.tables import Worker
from service.storage.workers import add_worker, get_worker
from service.web.cancelling import cancel_one

pytestmark = pytest.mark.unit


@pytest.fixture
def engine(tmp_path: Path):  # type: ignore[no-untyped-def]
    engine = make_engine(tmp_path / "db.sqlite3")
    yield engine
    engine.dispose()


def _new_run(engine) -> str:  # type: ignore[no-untyped-def]
    run, created = store.create_run(engine, RunSpec(num_prompts=2))
    assert created
    return run.id


def test_machine_has_exactly_the_designed_edges() -> None:
    edges = {(a.value, b.value) for a, targets in TRANSITIONS.items() for b in targets}
    assert edges == {
        ("queued", "starting"), ("queued", "cancelled"),
        ("starting", "running"), ("starting", "failed"), ("starting", "cancelled"),
        ("running", "succeeded"), ("running", "failed"), ("running", "cancelled"),
    }


def test_new_run_is_queued(engine) -> None:  # type: ignore[no-untyped-def]
    run_id = _new_run(engine)
    assert store.get_run(engine, run_id).status == "queued"


def test_happy_path_moves_through_every_state(engine) -> None:  # type: ignore[no-untyped-def]
    run_id = _new_run(engine)
    for status in (RunStatus.starting, RunStatus.running, RunStatus.succeeded):
        assert store.transition(engine, run_id, status)
        assert store.get_run(engine, run_id).status == status.value
    assert store.get_run(engine, run_id).finished_at is not None


@pytest.mark.parametrize("end", sorted(FINISHED - {RunStatus.imported}))
def test_finished_run_never_moves_again(engine, end: RunStatus) -> None:  # type: ignore[no-untyped-def]
    run_id = _new_run(engine)
    store.transition(engine, run_id, RunStatus.starting)
    store.transition(engine, run_id, RunStatus.running)
    assert store.transition(engine, run_id, end)
    for target in RunStatus:
        assert not store.transition(engine, run_id, target)
    assert store.get_run(engine, run_id).status == end.value


def test_imported_is_an_end_no_run_reaches_or_leaves() -> None:
    assert RunStatus.imported in FINISHED
    assert not TRANSITIONS[RunStatus.imported]
    assert all(RunStatus.imported not in targets for targets in TRANSITIONS.values())


def test_queued_run_cannot_skip_to_running_or_succeeded(engine) -> None:  # type: ignore[no-untyped-def]
    run_id = _new_run(engine)
    assert not store.transition(engine, run_id, RunStatus.running)
    assert not store.transition(engine, run_id, RunStatus.succeeded)
    assert store.get_run(engine, run_id).status == "queued"


def test_cancel_and_finish_race_has_one_winner(engine) -> None:  # type: ignore[no-untyped-def]
    run_id = _new_run(engine)
    store.transition(engine, run_id, RunStatus.starting)
    store.transition(engine, run_id, RunStatus.running)
    assert store.transition(engine, run_id, RunStatus.cancelled)
    assert not store.transition(engine, run_id, RunStatus.succeeded)
    assert store.get_run(engine, run_id).status == "cancelled"


def test_restart_fails_interrupted_runs_and_keeps_queued(engine) -> None:  # type: ignore[no-untyped-def]
    queued, starting, running = _new_run(engine), _new_run(engine), _new_run(engine)
    store.transition(engine, starting, RunStatus.starting)
    store.transition(engine, running, RunStatus.starting)
    store.transition(engine, running, RunStatus.running)
    assert store.fail_interrupted(engine) == 2
    assert store.get_run(engine, queued).status == "queued"
    for run_id, was in ((starting, "starting"), (running, "running")):
        run = store.get_run(engine, run_id)
        assert run.status == "failed"
        assert run.error is not None and f"while this run was {was}" in run.error


def test_the_fallback_cancel_moves_only_a_queued_run(engine) -> None:  # type: ignore[no-untyped-def]
    queued, starting = _new_run(engine), _new_run(engine)
    store.transition(engine, starting, RunStatus.starting)
    assert store.cancel_queued(engine, queued, "cancelled by the user")
    assert not store.cancel_queued(engine, starting, "cancelled by the user")
    assert store.get_run(engine, queued).status == "cancelled"
    assert store.get_run(engine, starting).status == "starting"


class _PlacedMeanwhile:
    """A scheduler that had no runner for the run at the first cancel, then placed it (its
    runner moved it to ``starting``) before the API's own move: the second cancel reaches
    the runner, which ends the run."""

    def __init__(self, engine, run_id: str) -> None:  # type: ignore[no-untyped-def]
        self.engine, self.run_id, self.asked = engine, run_id, 0

    def cancel(self, run_id: str) -> Future[bool]:
        answer: Future[bool] = Future()
        self.asked += 1
        if self.asked == 1:
            store.transition(self.engine, self.run_id, RunStatus.starting)
            answer.set_result(False)
        else:
            store.transition(self.engine, self.run_id, RunStatus.cancelled, error="by its runner")
            answer.set_result(True)
        return answer

    def handling(self, run_id: str) -> bool:
        return self.asked >= 1  # placed at the first cancel: its runner has it from then on


def test_a_run_placed_while_the_api_cancels_it_is_cancelled_by_its_runner(engine) -> None:  # type: ignore[no-untyped-def]
    run_id = _new_run(engine)
    scheduler = _PlacedMeanwhile(engine, run_id)
    assert cancel_one(engine, scheduler, run_id, "cancelled by the user")  # type: ignore[arg-type]
    # The API did not cancel a starting run behind its runner's back (which would have gone
    # on to start a server for it): the runner was asked, and ended it.
    assert scheduler.asked == 2
    assert store.get_run(engine, run_id).error == "by its runner"


def test_a_server_counts_only_the_runs_that_ran_on_it(engine) -> None:  # type: ignore[no-untyped-def]
    add_worker(engine, Worker(id="w-1", key="k", model="m", engine={}, url="http://127.0.0.1:9",
                              port=9, token_hash="x", log_path="w.log"))
    ran, infeasible, cancelled = _new_run(engine), _new_run(engine), _new_run(engine)
    for run_id in (ran, infeasible, cancelled):
        store.transition(engine, run_id, RunStatus.starting)
    store.transition(engine, cancelled, RunStatus.cancelled)
    assert store.begin_measuring(engine, ran, "w-1", None, "auto", None, {}, go=True)
    # One that could not fit the server's KV cache (failed before its first request), and
    # one cancelled while its server was being had: neither ran there.
    assert not store.begin_measuring(engine, infeasible, "w-1", None, "auto", None, {}, go=False)
    assert not store.begin_measuring(engine, cancelled, "w-1", None, "auto", None, {}, go=True)
    served = get_worker(engine, "w-1")
    assert served is not None and served.runs_served == 1
