"""The scheduler loop: takes queued runs in order, gets them a worker, drives their load.

Lifecycle of one run (each step a guarded status change, see ``store``):
queued -> starting (a worker is found or started) -> running (load is driven)
-> succeeded | failed. A cancel from the API moves the run to ``cancelled``
first and then cancels its task here; samples taken so far are kept.

On this service's start, runs a previous process left ``starting``/``running``
are failed and worker process groups it left behind are stopped before any new
work begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import httpx
from sqlalchemy import Engine, update
from sqlmodel import Session, col

from service import store
from service.launcher import Launcher, WorkerError, WorkerHandle
from service.loadgen import LoadGenerator, make_plan
from service.metrics import Sample, run_warnings, summarize
from service.models import RunSpec, RunStatus, Worker, utcnow
from service.settings import Settings

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5
# How many queued runs one pass of the loop looks at.
PLACE_AHEAD = 64


@dataclass
class Placement:
    """Where a run goes: an idle worker of its kind, or GPUs for a new worker (after
    stopping the idle workers in ``evict``)."""

    key: str
    reuse: WorkerHandle | None = None
    gpus: list[str] = field(default_factory=list)
    evict: list[WorkerHandle] = field(default_factory=list)
WATCH_EVERY_S = 0.5
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

    def recover(self) -> None:
        """Fail runs interrupted by a previous crash, stop its orphaned workers, and take
        back the registered servers (unavailable until probed)."""
        failed = store.fail_interrupted(self.engine)
        orphans = self.launcher.reap_orphans()
        if failed or orphans:
            log.warning("recovered: %d interrupted runs failed, %d orphaned workers stopped",
                        failed, orphans)
        registered = self.launcher.load_registered()
        if registered:
            log.info("%d registered workers to probe", registered)

    def start(self) -> None:
        """Recover, then start the loop and the registered servers' prober as tasks."""
        self.recover()
        self.loop_task = asyncio.create_task(self.run_forever(), name="decodebench-scheduler")
        self.probe_task = asyncio.create_task(self.probe_forever(), name="decodebench-prober")

    def probe_now(self) -> None:
        """Probe the registered servers at once (one was just registered)."""
        self._probe_wakeup.set()

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

    def notify(self) -> None:
        """Wake the loop: a run was queued or a slot was freed."""
        self._wakeup.set()

    def cancel(self, run_id: str) -> None:
        """Abort the run's in-flight work; the API already moved it to ``cancelled``."""
        task = self._tasks.get(run_id)
        if task is not None:
            self._cancelled.add(run_id)
            task.cancel()

    async def run_forever(self) -> None:
        """Place queued runs, oldest first, as long as they fit; until cancelled."""
        while True:
            self._wakeup.clear()
            try:
                self._place_queued()
            except Exception:
                # The loop must outlive any one bad pass (a database hiccup, a bad row).
                log.exception("scheduler pass failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), self.settings.scheduler_poll_s)

    def _place_queued(self) -> None:
        """One pass: start every queued run that fits, oldest first."""
        gpus = self.settings.gpu_ids()
        for run in store.queued(self.engine, limit=PLACE_AHEAD):
            if run.id in self._tasks:
                continue  # placed already; its task has not moved it on yet
            spec = RunSpec.model_validate(run.spec)
            if gpus and spec.engine.tensor_parallel_size > len(gpus):
                # Through ``starting``: the status machine has no queued -> failed edge.
                store.transition(self.engine, run.id, RunStatus.starting)
                store.transition(
                    self.engine, run.id, RunStatus.failed,
                    error=f"tensor_parallel_size {spec.engine.tensor_parallel_size} needs more "
                    f"GPUs than this service may use ({len(gpus)}: {','.join(gpus)})",
                )
                continue
            placement = self._place(run.id, spec)
            if placement is None:
                if self._waits_on_registered(spec):
                    continue
                break  # first come, first served: later runs wait behind this one
            task = asyncio.create_task(self._execute_placed(run.id, spec, placement))
            self._tasks[run.id] = task

    def _reap_dead_workers(self) -> None:
        for handle in list(self.launcher.workers.values()):
            if handle.process is not None and not handle.alive() and handle.busy_run is None:
                self.launcher.mark_dead(
                    handle, f"exited with code {handle.process.returncode}; "
                    f"last log lines:\n{handle.tail()}"
                )

    def _waits_on_registered(self, spec: RunSpec) -> bool:
        """True if the run waits for registered servers only (busy or unavailable): it holds
        nothing of this machine's, so later runs of other kinds need not wait behind it."""
        key = spec.worker_key()
        same = [h for h in self.launcher.workers.values() if h.key == key]
        starting = any(p.key == key for p in self._starting.values())
        return bool(same) and all(h.external for h in same) and not starting

    def _place(self, run_id: str, spec: RunSpec) -> Placement | None:
        """Where the run can go now: a free worker of its kind, or GPUs for a new one
        (stopping idle workers of other kinds to free them); None if it must wait."""
        self._reap_dead_workers()
        every = list(self.launcher.workers.values())
        same = [h for h in every if h.key == spec.worker_key()]
        if same or any(p.key == spec.worker_key() for p in self._starting.values()):
            idle = [h for h in same if h.busy_run is None and h.ready]
            if not idle:
                return None  # runs of one kind share one server, one run at a time
            idle[0].busy_run = run_id
            return Placement(key=spec.worker_key(), reuse=idle[0])
        # Registered servers hold none of this machine's GPUs and are never evicted.
        workers = [h for h in every if not h.external]
        all_gpus = self.settings.gpu_ids()
        if not all_gpus:
            # A CPU machine: one worker at a time, and only when nothing is running.
            if self._starting or any(h.busy_run or not h.ready for h in workers):
                return None
            placement = Placement(key=spec.worker_key(), evict=workers)
        else:
            need = spec.engine.tensor_parallel_size
            held = {g for h in workers for g in h.gpus}
            held |= {g for p in self._starting.values() for g in p.gpus}
            free = [g for g in all_gpus if g not in held]
            evict: list[WorkerHandle] = []
            for handle in sorted(workers, key=lambda h: h.last_used):
                if len(free) >= need:
                    break
                if handle.ready and handle.busy_run is None:  # idle, not still starting
                    evict.append(handle)
                    free += handle.gpus
            if len(free) < need:
                return None
            placement = Placement(key=spec.worker_key(), gpus=sorted(free[:need]), evict=evict)
        for handle in placement.evict:
            self.launcher.workers.pop(handle.id, None)  # no longer placeable
        self._starting[run_id] = placement
        return placement

    async def _execute_placed(self, run_id: str, spec: RunSpec, placement: Placement) -> None:
        try:
            await self.execute(run_id, spec, placement)
        finally:
            # Workers set aside for eviction are stopped even if the run never got to it
            # (cancelled while queued): nothing else holds them any more.
            for handle in placement.evict:
                if handle.alive():
                    await self.launcher.stop(handle)
            self._starting.pop(run_id, None)
            if placement.reuse is not None:
                placement.reuse.busy_run = None
            for handle in self.launcher.workers.values():
                if handle.busy_run == run_id:
                    handle.busy_run = None
                    handle.last_used = time.monotonic()
            self._tasks.pop(run_id, None)
            self._cancelled.discard(run_id)
            self.notify()

    async def _worker_for(self, run_id: str, spec: RunSpec, placement: Placement) -> WorkerHandle:
        if placement.reuse is not None:
            return placement.reuse
        for handle in placement.evict:
            await self.launcher.stop(handle)
        handle = await self.launcher.start(spec, placement.gpus)
        handle.busy_run = run_id
        return handle

    async def execute(self, run_id: str, spec: RunSpec, placement: Placement) -> None:
        """Run one placed run to its end state."""
        reuse = placement.reuse
        if reuse is not None and reuse.external and not await self._healthy(reuse):
            # A registered server can go away between two probes: the run stays queued
            # for the next server that answers instead of failing on this one.
            self.launcher.set_unavailable(reuse, "did not answer /health as a run was about to start")
            return
        if not store.transition(self.engine, run_id, RunStatus.starting):
            return
        samples: list[Sample] = []
        try:
            handle = await self._worker_for(run_id, spec, placement)
            with Session(self.engine) as session:
                session.exec(
                    update(Worker)
                    .where(col(Worker.id) == handle.id)
                    .values(runs_served=col(Worker.runs_served) + 1)
                )
                session.commit()
            # The worker id goes in before the first request: the connector's
            # pull is only answered for runs assigned to the asking worker.
            store.update_fields(self.engine, run_id, worker_id=handle.id, cpu_binding=handle.cpu_binding)
            needed = spec.longest_request_tokens()
            if handle.kv_tokens is not None and needed > handle.kv_tokens:
                store.transition(
                    self.engine, run_id, RunStatus.failed,
                    error=f"infeasible: one request needs {needed} tokens of KV cache and this "
                    f"server holds {handle.kv_tokens}; not run",
                )
                return
            if not store.transition(
                self.engine, run_id, RunStatus.running, started_at=utcnow()
            ):
                return
            duration = await self._drive(run_id, spec, handle, samples)
            if not handle.alive():
                tail = handle.tail()
                self.launcher.mark_dead(handle, "exited during a run")
                raise WorkerError(f"vLLM server exited during the run; last log lines:\n{tail}")
            summary = summarize(samples, duration, spec.goodput.model_dump(exclude_none=True))
            store.save_samples(self.engine, run_id, samples)
            ok = [s for s in samples if s.success]
            if len(ok) < len(samples) and not await self._healthy(handle):
                # A server that stopped answering is not reused: the next run gets a new one.
                tail = handle.tail()
                await self.launcher.stop(handle, status="failed", error="stopped answering")
                raise WorkerError(
                    f"vLLM server stopped answering during the run ({len(samples) - len(ok)} "
                    f"requests failed); last log lines:\n{tail}"
                )
            if not ok:
                first_error = next((s.error for s in samples if s.error), "no request succeeded")
                store.transition(
                    self.engine, run_id, RunStatus.failed, summary=summary,
                    completed=0, failed=len(samples),
                    error=f"every request failed; first error: {first_error}\n"
                    f"last log lines of the vLLM server:\n{handle.tail()}",
                )
                return
            store.transition(
                self.engine, run_id, RunStatus.succeeded, summary=summary,
                completed=len(ok), failed=len(samples) - len(ok),
                warnings=run_warnings(samples, summary),
            )
        except asyncio.CancelledError:
            store.save_samples(self.engine, run_id, samples)
            done = sum(s.success for s in samples)
            store.update_fields(self.engine, run_id, completed=done, failed=len(samples) - done)
            if run_id in self._cancelled:
                return  # cancelled by the user; the status is already ``cancelled``
            store.transition(
                self.engine, run_id, RunStatus.failed,
                error="the service stopped while this run was in progress",
            )
            raise
        except WorkerError as exc:
            store.save_samples(self.engine, run_id, samples)
            store.transition(self.engine, run_id, RunStatus.failed, error=str(exc))
        except Exception as exc:
            log.exception("run %s failed", run_id)
            store.save_samples(self.engine, run_id, samples)
            store.transition(
                self.engine, run_id, RunStatus.failed,
                error=f"internal error: {type(exc).__name__}: {exc}",
            )

    async def _healthy(self, handle: WorkerHandle) -> bool:
        """True if the worker is alive and answers /health within a few seconds."""
        if not handle.alive():
            return False
        try:
            response = await self.launcher.client.get(f"{handle.url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _watch(self, handle: WorkerHandle, failures: list[int]) -> WorkerError:
        """Return (never raise) once the worker has died, or stopped answering after a failed
        request; until then, watch."""
        checked = 0

        def exited() -> WorkerError:
            tail = handle.tail()
            self.launcher.mark_dead(handle, "exited during a run")
            return WorkerError(f"vLLM server exited during the run; last log lines:\n{tail}")

        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            if not handle.alive():
                return exited()
            if failures[0] > checked:
                checked = failures[0]
                if not await self._healthy(handle):
                    # A dying server refuses connections a moment before it is reaped.
                    await asyncio.sleep(WATCH_EVERY_S)
                    if not handle.alive():
                        return exited()
                    tail = handle.tail()
                    await self.launcher.stop(handle, status="failed", error="stopped answering")
                    return WorkerError(
                        f"vLLM server stopped answering during the run ({checked} requests "
                        f"failed); last log lines:\n{tail}"
                    )

    async def _drive(
        self, run_id: str, spec: RunSpec, handle: WorkerHandle, samples: list[Sample]
    ) -> float:
        plan = make_plan(spec, handle.vocab_size)
        generator = LoadGenerator(
            handle.url, handle.served_model, run_id, spec.max_concurrency,
            self.settings.request_timeout_s,
        )
        last_flush = time.monotonic()
        failures = [0]

        def on_done(sample: Sample) -> None:
            nonlocal last_flush
            samples.append(sample)
            if not sample.success:
                failures[0] += 1
            now = time.monotonic()
            if now - last_flush >= PROGRESS_EVERY_S or len(samples) == spec.num_prompts:
                last_flush = now
                ok = len(samples) - failures[0]
                store.update_fields(self.engine, run_id, completed=ok, failed=failures[0])

        async def load() -> float:
            await generator.warmup(plan)
            return await generator.measure(plan, on_done)

        measure = asyncio.create_task(load())
        watchdog = asyncio.create_task(self._watch(handle, failures))
        try:
            await asyncio.wait({measure, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if not measure.done():
                # The worker died or hung: stop sending, keep what was measured.
                measure.cancel()
                await asyncio.gather(measure, return_exceptions=True)
                raise watchdog.result()
            return measure.result()
        finally:
            for task in (measure, watchdog):
                task.cancel()
            await asyncio.gather(measure, watchdog, return_exceptions=True)
            await generator.aclose()
