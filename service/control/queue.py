"""The scheduler loop: takes queued runs in order and hands each placed run to its runner.

Lifecycle of one run (each step a guarded status change, see ``store``):
queued -> starting (a worker is found or started) -> running (load is driven)
-> succeeded | failed | cancelled. A queued run nobody placed yet is cancelled by the
API's guarded write; a placed one by a message to its runner, which ends it (samples
taken so far are kept). What happens to a run once placed is
``service.control.runner``'s; where it goes is ``service.control.placement``'s; the
servers and drivers it gets are ``service.control.fleet``'s.

On this service's start, runs a previous process left ``starting``/``running``
are failed and worker process groups it left behind are stopped before any new
work begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from pydantic import ValidationError
from sqlalchemy import Engine

from service.control import capacity
from service.control.fleet import Fleet
from service.control.placement import QueuedRow, place
from service.control.runner import Runner, ensure_ended
from service.control.until_decided import catch_up, follow_up
from service.core.spec import RunSpec, describe
from service.settings import Settings
from service.storage import store
from service.storage.tables import Run

log = logging.getLogger(__name__)

# How many queued runs one pass of the loop reads first; it reads on (twice as many each
# time) while every run it read was placed or waits holding nothing.
PLACE_AHEAD = 64
# How many pairs' servers are remembered for their second run (a pair's runs are queued
# next to each other, so its partner is placed soon after).
PAIRS_REMEMBERED = 1024


class Scheduler:
    """Places queued runs on workers: side by side on disjoint GPUs, one at a time on a CPU."""

    def __init__(self, settings: Settings, engine: Engine, fleet: Fleet) -> None:
        self.settings = settings
        self.engine = engine
        self.fleet = fleet
        self._wakeup = asyncio.Event()
        # The runner of every placed run until it has ended, and its task.
        self._runners: dict[str, Runner] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Pairs (fill/prefill trials run back to back): the server the last ended run of a
        # pair ran on, for its partner (newest kept).
        self._pair_servers: OrderedDict[str, str] = OrderedDict()
        self.loop_task: asyncio.Task[None] | None = None
        self.probe_task: asyncio.Task[None] | None = None
        self._probe_wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Tasks of the loop's own that nothing else holds (asyncio keeps weak references).
        self._waiters: set[asyncio.Future[None]] = set()
        # The looks of capacity searches after a probe failed unplaced, taken off the pass
        # (``_fail_queued``); awaited at shutdown.
        self._looks: set[asyncio.Task[None]] = set()

    async def recover(self) -> None:
        """Fail runs interrupted by a previous crash, stop its orphaned workers, take back
        the registered servers (unavailable until probed) and take the until_decided and
        capacity search looks it missed."""
        failed = await asyncio.to_thread(store.fail_interrupted, self.engine)
        orphans = await self.fleet.recover()
        if failed or orphans:
            log.warning("recovered: %d interrupted runs failed, %d orphaned workers stopped",
                        failed, orphans)
        # The looks of until_decided sweeps whose last pair ended (or was just failed above)
        # while the service was down.
        try:
            pairs = await asyncio.to_thread(catch_up, self.engine)
        except Exception:
            log.exception("until_decided: catching up on the looks missed while down failed")
        else:
            if pairs:
                log.warning("recovered: %d pairs queued by until_decided looks missed while down",
                            pairs)
        try:
            probes = await asyncio.to_thread(capacity.catch_up, self.engine)
        except Exception:
            log.exception("capacity: catching up on the looks missed while down failed")
        else:
            if probes:
                log.warning("recovered: %d probe runs queued by capacity looks missed while down",
                            probes)

    async def start(self) -> None:
        """Recover, then start the loop and the registered servers' prober as tasks."""
        await self.recover()
        self._loop = asyncio.get_running_loop()
        self.fleet.start()
        self.loop_task = asyncio.create_task(self.run_forever(), name="decodebench-scheduler")
        self.probe_task = asyncio.create_task(self.probe_forever(), name="decodebench-prober")

    def probe_now(self) -> None:
        """Probe the registered servers at once (one was just registered). From any thread."""
        self._on_loop(self._probe_wakeup.set)

    async def probe_forever(self) -> None:
        """Probe every registered server every ``worker_probe_s``; wake the loop when one
        becomes ready. Until cancelled."""
        while True:
            self._probe_wakeup.clear()
            handles = [h for h in self.fleet.workers.values() if h.external]
            results = await asyncio.gather(
                *(self.fleet.registered.probe(h) for h in handles), return_exceptions=True
            )
            for handle, result in zip(handles, results, strict=True):
                if isinstance(result, Exception):
                    log.error("probing worker %s failed: %r", handle.id, result)
            if any(r is True for r in results):
                self.notify()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._probe_wakeup.wait(), self.settings.worker_probe_s)

    async def shutdown(self) -> None:
        """Stop the loop, fail the runs in progress, and stop every worker (the fleet's, not
        the runners' job: a runner cancelled while its server starts leaves it stopping)."""
        wait_s = self.settings.shutdown_wait_s
        try:
            await asyncio.wait_for(self._stop_tasks(), wait_s)
        except TimeoutError:
            log.error("runs did not stop within %s s; stopping the workers anyway", wait_s)
        await self.fleet.shutdown()

    async def _stop_tasks(self) -> None:
        for loop in (self.loop_task, self.probe_task):
            if loop is not None:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Not cancelled: a look runs in a thread, which a cancel would leave running.
        await asyncio.gather(*list(self._looks), return_exceptions=True)

    def alive(self) -> bool:
        """True while the loop task runs."""
        return self.loop_task is not None and not self.loop_task.done()

    def _on_loop(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the scheduler's event loop: asyncio objects are not thread-safe,
        and the API's sync routes call in from the threadpool."""
        loop = self._loop
        if loop is None or loop.is_closed():
            call()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            call()
        else:
            loop.call_soon_threadsafe(call)

    def notify(self) -> None:
        """Wake the loop: a run was queued or a slot was freed. From any thread."""
        self._on_loop(self._wakeup.set)

    def cancel(self, run_id: str) -> Future[bool]:
        """Ask the run's runner to cancel it. The future says True once the runner has
        written the run's end; or False at once when no runner has the run (it is queued,
        or over). From any thread; call it again after a False if the run may have been
        placed since."""
        answer: Future[bool] = Future()

        def cancel() -> None:
            runner = self._runners.get(run_id)
            if runner is None:
                answer.set_result(False)
                return
            runner.cancel()

            async def wait_end() -> None:
                await runner.settled.wait()
                answer.set_result(True)

            waiter = asyncio.ensure_future(wait_end())
            self._waiters.add(waiter)
            waiter.add_done_callback(self._waiters.discard)

        self._on_loop(cancel)
        return answer

    def reported(self, run_id: str) -> None:
        """The connector reported on the run: its runner hears of it. From any thread."""

        def tell() -> None:
            runner = self._runners.get(run_id)
            if runner is not None:
                runner.reported()

        self._on_loop(tell)

    def decode_so_far(self, run_id: str) -> tuple[float | None, int] | None:
        """The decode median ITL (ms) and steady gaps of the requests a run being measured
        has saved, as its runner keeps them; None when no runner has the run. From any thread."""
        runner = self._runners.get(run_id)
        return None if runner is None else runner.decode_so_far.figure()

    def handling(self, run_id: str) -> bool:
        """Whether a runner still works on the run (a cancelled run's runner winds down
        after the API moved it to ``cancelled``: it saves the samples it has). From any thread."""
        return run_id in self._tasks

    async def run_forever(self) -> None:
        """Place queued runs, oldest first, as long as they fit; until cancelled."""
        while True:
            self._wakeup.clear()
            try:
                await self._place_queued()
            except Exception:
                # The loop must outlive any one bad pass (a database hiccup, a bad row).
                log.exception("scheduler pass failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), self.settings.scheduler_poll_s)

    async def _place_queued(self) -> None:
        """One pass: start every queued run that fits, oldest first."""
        await self._reap_dead_workers()
        queued: list[QueuedRow] = []
        specs: dict[str, RunSpec] = {}
        in_sweep: set[str] = set()
        in_capacity: set[str] = set()
        last: Run | None = None
        ahead = PLACE_AHEAD
        memory = self.fleet.cpu_memory_bytes()
        while True:
            page = await asyncio.to_thread(store.queued, self.engine, limit=ahead, after=last)
            for run in page:
                if run.sweep_id is not None:
                    in_sweep.add(run.id)
                if run.capacity_id is not None:
                    in_capacity.add(run.id)
                if run.id in self._tasks:
                    continue  # placed already; its task has not moved it on yet
                try:
                    spec = specs[run.id] = RunSpec.stored(run.spec)
                except ValidationError as exc:
                    # One bad row must not hold up the queue: it fails, the others go on.
                    await self._fail_queued(run.id, f"its stored spec no longer validates: {describe(exc)}",
                                            run.id in in_capacity)
                    continue
                queued.append(QueuedRow(run.id, spec.worker_key(), spec.engine.tensor_parallel_size,
                                        run.pair_id, spec.longest_request(), spec.cpu_problem(memory)))
            workers, starting = self.fleet.rows()
            busy_pairs = {r.pair_id for r in self._runners.values() if r.pair_id}
            stopped: list[str] = []
            decisions = place(queued, workers, starting, self.fleet.gpu_ids(),
                              busy_pairs=busy_pairs, pair_servers=self._pair_servers, stopped=stopped)
            if stopped or len(page) < ahead:
                break
            # Every run read waits holding nothing (for a registered server, for its pair) or
            # was placed: the queue is read on, in growing pages, so that no number of such
            # runs starves the runs behind them.
            last = page[-1]
            ahead *= 2
        pair_of = {row.id: row.pair_id for row in queued if row.pair_id}
        failed: list[tuple[str, str]] = []
        for decision in decisions:
            if decision.fail is not None:
                failed.append((decision.run_id, decision.fail))
                continue
            placement = self.fleet.reserve(decision)
            run_id = decision.run_id
            runner = Runner(self.settings, self.engine, self.fleet, run_id, specs[run_id], placement,
                            in_sweep=run_id in in_sweep, pair_id=pair_of.get(run_id),
                            in_capacity=run_id in in_capacity)
            self._runners[run_id] = runner
            task = asyncio.create_task(self._execute_placed(runner), name=f"runner-{run_id}")
            self._tasks[run_id] = task
            # A task cancelled before its first step never runs its body (nor its
            # ``finally``): what the run holds is given back from here then.
            task.add_done_callback(functools.partial(self._ended_unrun, runner))
        # After the placements: no await may come between a decision and its task, or the
        # state the decision was made on could change under it.
        for run_id, error in failed:
            await self._fail_queued(run_id, error, run_id in in_capacity)

    async def _fail_queued(self, run_id: str, error: str, in_capacity: bool = False) -> None:
        """Fail a queued run this pass cannot place, in one guarded write; for a capacity
        probe, start its search's look in a task of its own."""
        await asyncio.to_thread(store.fail_queued, self.engine, run_id, error)
        if in_capacity:
            # No runner follows this run up: its search looks now, or it would wait forever.
            # Off the pass: a look (a bootstrap, or a wait for another search's look) would
            # hold up every run queued behind this one.
            look = asyncio.create_task(self._look_after(run_id), name=f"capacity-look-{run_id}")
            self._looks.add(look)
            look.add_done_callback(self._looks.discard)

    async def _look_after(self, run_id: str) -> None:
        await self._follow_capacity(run_id)
        self.notify()  # the probes it queued

    async def _follow_capacity(self, run_id: str) -> None:
        """The look of the capacity search ``run_id`` is a probe of, after it ended."""
        try:
            await asyncio.to_thread(capacity.follow_up, self.engine, run_id)
        except Exception:
            log.exception("run %s: its capacity search's look failed", run_id)

    async def _reap_dead_workers(self) -> None:
        await self.fleet.reap_dead()

    async def _execute_placed(self, runner: Runner) -> None:
        try:
            await runner.run()
        except Exception:
            log.exception("run %s: its runner failed", runner.run_id)
        finally:
            await self._give_back(runner)

    async def _give_back(self, runner: Runner) -> None:
        """After a runner: what its run held goes back to the fleet, a run it left
        unended is failed, and the loop looks for work. Once per runner."""
        run_id = runner.run_id
        if self._runners.get(run_id) is not runner:
            return
        try:
            await self.fleet.release_evicted(run_id, runner.placement)
            used = [h for h in (runner.placement.reuse, runner.handle) if h is not None]
            self.fleet.release(run_id, used)
            if runner.pair_id is not None and used:
                self._pair_servers[runner.pair_id] = used[-1].id
                while len(self._pair_servers) > PAIRS_REMEMBERED:
                    self._pair_servers.popitem(last=False)
            # Its server is idle from here, and its pair no longer busy: no await between
            # the two, or a pass in between gives the server to the next pair's run, ahead
            # of this pair's second (the waits below take seconds on a busy machine).
            self._runners.pop(run_id, None)
            if not runner.end_written:
                await asyncio.to_thread(ensure_ended, self.engine, run_id)
            if runner.in_sweep:  # only a sweep's run may have pairs to queue after it
                try:
                    await asyncio.to_thread(follow_up, self.engine, run_id)
                except Exception:
                    log.exception("run %s: its sweep's until_decided rule failed", run_id)
            if runner.in_capacity:  # the next probes of its search
                await self._follow_capacity(run_id)
        finally:
            self._runners.pop(run_id, None)
            self._tasks.pop(run_id, None)
            runner.settled.set()
            runner.ended.set()
            self.notify()

    def _ended_unrun(self, runner: Runner, _task: asyncio.Task[None]) -> None:
        """A runner's task is done; if it never ran (cancelled before its first step),
        give back what its run holds now."""
        if self._runners.get(runner.run_id) is not runner:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        cleanup = asyncio.ensure_future(self._give_back(runner))
        self._waiters.add(cleanup)
        cleanup.add_done_callback(self._waiters.discard)
