"""The scheduler loop: takes queued runs in order and hands each placed run to its runner.

Lifecycle of one run (each step a guarded status change, see ``store``):
queued -> starting (a worker is found or started) -> running (load is driven)
-> succeeded | failed. A cancel from the API moves the run to ``cancelled``
first and then cancels its task here; samples taken so far are kept. What happens
to a run once placed is ``service.control.runner``'s; where it goes is ``service.control.placement``'s.

On this service's start, runs a previous process left ``starting``/``running``
are failed and worker process groups it left behind are stopped before any new
work begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from pydantic import ValidationError
from sqlalchemy import Engine

from service.control.handles import WorkerHandle
from service.control.local import Launcher
from service.control.placement import QueuedRow, WorkerRow, place
from service.control.runner import Placement, Runner, ensure_ended
from service.core.spec import RunSpec, describe
from service.core.status import RunStatus
from service.load.shards import DriverPool
from service.settings import Settings
from service.storage import store

log = logging.getLogger(__name__)

# How many queued runs one pass of the loop looks at.
PLACE_AHEAD = 64
SHUTDOWN_WAIT_S = 10.0


class Scheduler:
    """Places queued runs on workers: side by side on disjoint GPUs, one at a time on a CPU."""

    def __init__(self, settings: Settings, engine: Engine, launcher: Launcher) -> None:
        self.settings = settings
        self.engine = engine
        self.launcher = launcher
        self._wakeup = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()
        self.loop_task: asyncio.Task[None] | None = None
        self.probe_task: asyncio.Task[None] | None = None
        self._probe_wakeup = asyncio.Event()
        # Runs placed but whose worker is not up yet, with the GPUs they hold.
        self._starting: dict[str, Placement] = {}
        # Workers set aside for eviction and not stopped yet: they hold their GPUs.
        self._stopping: dict[str, WorkerHandle] = {}
        self.drivers = DriverPool(settings.logs_dir)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def recover(self) -> None:
        """Fail runs interrupted by a previous crash, stop its orphaned workers, and take
        back the registered servers (unavailable until probed)."""
        failed = await asyncio.to_thread(store.fail_interrupted, self.engine)
        orphans = await asyncio.to_thread(self.launcher.reap_orphans)
        if failed or orphans:
            log.warning("recovered: %d interrupted runs failed, %d orphaned workers stopped",
                        failed, orphans)
        registered = await self.launcher.load_registered()
        if registered:
            log.info("%d registered workers to probe", registered)

    async def start(self) -> None:
        """Recover, then start the loop and the registered servers' prober as tasks."""
        await self.recover()
        self._loop = asyncio.get_running_loop()
        self.drivers.start()
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
            handles = [h for h in self.launcher.workers.values() if h.external]
            results = await asyncio.gather(
                *(self.launcher.probe(h) for h in handles), return_exceptions=True
            )
            for handle, result in zip(handles, results, strict=True):
                if isinstance(result, Exception):
                    log.error("probing worker %s failed: %r", handle.id, result)
            if any(r is True for r in results):
                self.notify()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._probe_wakeup.wait(), self.settings.worker_probe_s)

    async def shutdown(self) -> None:
        """Stop the loop, fail the runs in progress, and stop every worker."""
        try:
            await asyncio.wait_for(self._stop_tasks(), SHUTDOWN_WAIT_S)
        except TimeoutError:
            log.error("runs did not stop within %s s; stopping the workers anyway", SHUTDOWN_WAIT_S)
        await self.drivers.close()
        await self.launcher.stop_all()

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

    def cancel(self, run_id: str) -> None:
        """Abort the run's in-flight work; the API already moved it to ``cancelled``.
        From any thread."""

        def cancel() -> None:
            task = self._tasks.get(run_id)
            if task is not None:
                self._cancelled.add(run_id)
                task.cancel()

        self._on_loop(cancel)

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
        for run in await asyncio.to_thread(store.queued, self.engine, limit=PLACE_AHEAD):
            if run.id in self._tasks:
                continue  # placed already; its task has not moved it on yet
            try:
                spec = specs[run.id] = RunSpec.stored(run.spec)
            except ValidationError as exc:
                # One bad row must not hold up the queue: it fails, the others go on.
                await self._fail_queued(run.id, f"its stored spec no longer validates: {describe(exc)}")
                continue
            queued.append(QueuedRow(run.id, spec.worker_key(), spec.engine.tensor_parallel_size))
        workers = [self._row(h, stopping=False) for h in self.launcher.workers.values()]
        workers += [self._row(h, stopping=True) for h in self._stopping.values()]
        starting = [(p.key, p.gpus) for p in self._starting.values()]
        handles = {**self.launcher.workers, **self._stopping}
        failed: list[tuple[str, str]] = []
        for decision in place(queued, workers, starting, self.settings.gpu_ids()):
            if decision.fail is not None:
                failed.append((decision.run_id, decision.fail))
                continue
            placement = Placement(key=decision.key)
            if decision.reuse is not None:
                placement.reuse = handles[decision.reuse]
                placement.reuse.busy_run = decision.run_id
            else:
                placement.gpus = list(decision.gpus)
                placement.evict = [handles[w] for w in decision.evict]
                for handle in placement.evict:
                    # No longer placeable; its GPUs stay held until it has stopped.
                    self.launcher.workers.pop(handle.id, None)
                    self._stopping[handle.id] = handle
                self._starting[decision.run_id] = placement
            spec = specs[decision.run_id]
            task = asyncio.create_task(self._execute_placed(decision.run_id, spec, placement))
            self._tasks[decision.run_id] = task
        # After the placements: no await may come between a decision and its task, or the
        # state the decision was made on could change under it.
        for run_id, error in failed:
            await self._fail_queued(run_id, error)

    async def _fail_queued(self, run_id: str, error: str) -> None:
        def fail() -> None:
            # Through ``starting``: the status machine has no queued -> failed edge.
            store.transition(self.engine, run_id, RunStatus.starting)
            store.transition(self.engine, run_id, RunStatus.failed, error=error)

        await asyncio.to_thread(fail)

    @staticmethod
    def _row(handle: WorkerHandle, stopping: bool) -> WorkerRow:
        return WorkerRow(
            id=handle.id, key=handle.key, external=handle.external, ready=handle.ready,
            busy=handle.busy_run is not None, gpus=tuple(handle.gpus),
            last_used=handle.last_used, stopping=stopping,
        )

    async def _reap_dead_workers(self) -> None:
        for handle in list(self.launcher.workers.values()):
            if handle.process is not None and not handle.alive() and handle.busy_run is None:
                await self.launcher.mark_dead(
                    handle, f"exited with code {handle.process.returncode}; "
                    f"last log lines:\n{handle.tail()}"
                )

    async def _execute_placed(self, run_id: str, spec: RunSpec, placement: Placement) -> None:
        runner = Runner(self.settings, self.engine, self.launcher, self.drivers, run_id, spec, placement,
                        cancelled_by_user=lambda: run_id in self._cancelled)
        try:
            await runner.run()
        except Exception:
            log.exception("run %s: its runner failed", run_id)
        finally:
            # Workers set aside for eviction are stopped even if the run never got to it
            # (cancelled while queued): nothing else holds them any more.
            for handle in placement.evict:
                if handle.alive():
                    try:
                        await self.launcher.stop(handle, error=f"stopped to make room for run {run_id}")
                    except BaseException:
                        log.exception("stopping worker %s failed", handle.id)
                self._stopping.pop(handle.id, None)
            self._starting.pop(run_id, None)
            # Every worker this run used is idle again, and was used just now (least
            # recently used eviction reads it).
            used = [h for h in (placement.reuse, runner.handle) if h is not None]
            used += [h for h in self.launcher.workers.values() if h.busy_run == run_id]
            for handle in used:
                if handle.busy_run == run_id:
                    handle.busy_run = None
                    handle.last_used = time.monotonic()
            await asyncio.to_thread(ensure_ended, self.engine, run_id)
            self._tasks.pop(run_id, None)
            self._cancelled.discard(run_id)
            self.notify()
