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

import httpx
from sqlalchemy import Engine, update
from sqlmodel import Session, col

from service import store
from service.launcher import Launcher, WorkerError, WorkerHandle, log_tail
from service.loadgen import LoadGenerator, make_plan
from service.metrics import Sample, summarize
from service.models import RunSpec, RunStatus, Worker, utcnow
from service.settings import Settings

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5
WATCH_EVERY_S = 0.5


class Scheduler:
    """Runs queued runs one after another (one worker at a time on a CPU machine)."""

    def __init__(self, settings: Settings, engine: Engine, launcher: Launcher) -> None:
        self.settings = settings
        self.engine = engine
        self.launcher = launcher
        self._wakeup = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()
        self.loop_task: asyncio.Task[None] | None = None

    def recover(self) -> None:
        """Fail runs interrupted by a previous crash and stop its orphaned workers."""
        failed = store.fail_interrupted(self.engine)
        orphans = self.launcher.reap_orphans()
        if failed or orphans:
            log.warning("recovered: %d interrupted runs failed, %d orphaned workers stopped",
                        failed, orphans)

    def start(self) -> None:
        """Recover, then start the loop as a task."""
        self.recover()
        self.loop_task = asyncio.create_task(self.run_forever(), name="decodebench-scheduler")

    async def shutdown(self) -> None:
        """Stop the loop (failing a run in progress) and every worker."""
        if self.loop_task is not None:
            self.loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.loop_task
        await self.launcher.stop_all()

    def alive(self) -> bool:
        """True while the loop task runs."""
        return self.loop_task is not None and not self.loop_task.done()

    def notify(self) -> None:
        """Wake the loop: a run was queued."""
        self._wakeup.set()

    def cancel(self, run_id: str) -> None:
        """Abort the run's in-flight work; the API already moved it to ``cancelled``."""
        task = self._tasks.get(run_id)
        if task is not None:
            self._cancelled.add(run_id)
            task.cancel()

    async def run_forever(self) -> None:
        """Take queued runs, oldest first, until cancelled."""
        while True:
            run = store.next_queued(self.engine)
            if run is None:
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self.settings.scheduler_poll_s)
                continue
            task = asyncio.create_task(self.execute(run.id, RunSpec.model_validate(run.spec)))
            self._tasks[run.id] = task
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.done():
                    continue  # the run was cancelled, not us
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise
            finally:
                self._tasks.pop(run.id, None)
                self._cancelled.discard(run.id)

    async def _worker_for(self, spec: RunSpec) -> WorkerHandle:
        key = spec.worker_key()
        for handle in list(self.launcher.workers.values()):
            if not handle.alive():
                self.launcher.mark_dead(
                    handle, f"exited with code {handle.process.returncode}; "
                    f"last log lines:\n{log_tail(handle.log_path)}"
                )
        reusable = self.launcher.find_reusable(key)
        if reusable is not None:
            return reusable
        # One worker at a time on this machine: make room for the new one.
        await self.launcher.stop_all()
        gpus = self.settings.gpu_ids()[: spec.engine.tensor_parallel_size]
        return await self.launcher.start(spec, gpus)

    async def execute(self, run_id: str, spec: RunSpec) -> None:
        """Run one queued run to its end state."""
        if not store.transition(self.engine, run_id, RunStatus.starting):
            return
        samples: list[Sample] = []
        try:
            handle = await self._worker_for(spec)
            with Session(self.engine) as session:
                session.exec(
                    update(Worker)
                    .where(col(Worker.id) == handle.id)
                    .values(runs_served=col(Worker.runs_served) + 1)
                )
                session.commit()
            # The worker id goes in before the first request: the connector's
            # pull is only answered for runs assigned to the asking worker.
            store.update_fields(self.engine, run_id, worker_id=handle.id)
            if not store.transition(
                self.engine, run_id, RunStatus.running, started_at=utcnow()
            ):
                return
            duration = await self._drive(run_id, spec, handle, samples)
            if not handle.alive():
                tail = log_tail(handle.log_path)
                self.launcher.mark_dead(handle, "exited during a run")
                raise WorkerError(f"vLLM server exited during the run; last log lines:\n{tail}")
            summary = summarize(samples, duration, spec.goodput.model_dump(exclude_none=True))
            store.save_samples(self.engine, run_id, samples)
            ok = [s for s in samples if s.success]
            if len(ok) < len(samples) and not await self._healthy(handle):
                # A server that stopped answering is not reused: the next run gets a new one.
                tail = log_tail(handle.log_path)
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
                    f"last log lines of the vLLM server:\n{log_tail(handle.log_path)}",
                )
                return
            store.transition(
                self.engine, run_id, RunStatus.succeeded, summary=summary,
                completed=len(ok), failed=len(samples) - len(ok),
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
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            if not handle.alive():
                tail = log_tail(handle.log_path)
                self.launcher.mark_dead(handle, "exited during a run")
                return WorkerError(f"vLLM server exited during the run; last log lines:\n{tail}")
            if failures[0] > checked:
                checked = failures[0]
                if not await self._healthy(handle):
                    tail = log_tail(handle.log_path)
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
