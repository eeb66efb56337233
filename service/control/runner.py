"""One run, one owner: from its placement to its final status.

The runner is the only writer of a placed run's state. It gets the run's server and
load drivers from the fleet (``service.control.fleet``), keeps its samples as they
arrive (persisted in batches, each sample exactly once), watches the server,
summarises, and writes the final status. Others talk to it by message: a user's cancel
(``cancel``) and the connector's reports (``reported``) reach it in-process. Every way a
run can end goes through ``_end`` (one exit); if even that write fails, ``ensure_ended``
(called by the scheduler after the runner returns) tries again, so no run stays
``running``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Engine

from service.analysis.bursts import run_warnings
from service.analysis.checks import (
    Point,
    asked_concurrency,
    client_warnings,
    connector_verdict,
    dummy_moe,
    infeasible,
    server_warnings,
)
from service.analysis.intervals import Interval
from service.analysis.metrics import summarize
from service.analysis.neutrality import fill_neutrality, fill_not_neutral
from service.analysis.roofline import roofline
from service.analysis.running_decode import RunningDecode
from service.analysis.server_metrics import Point as ScrapedPoint
from service.analysis.server_metrics import Scraper
from service.analysis.steady_window import prefill_stall
from service.analysis.stopping import ITL_CI, MAX_PROMPTS, NUM_PROMPTS, itl_interval, itl_rule_met
from service.analysis.stopping import record as stop_record
from service.analysis.summary_intervals import summary_intervals
from service.control import hub, provenance
from service.control.energy import EnergyMeter, energy_warnings
from service.control.fleet import Fleet, LoadDrivers, Placement
from service.control.handles import WorkerError, WorkerHandle
from service.control.seeded_pass import SeededPass
from service.control.vllm_cli import local_model_config
from service.control.watchdog import Watchdog, blind_limit, still_serves
from service.core.protocol import connector_totals
from service.core.sample import Sample
from service.core.spec import RunSpec, describe, effective_load_format
from service.core.status import RunStatus
from service.load.shards import DriverError
from service.settings import Settings
from service.storage import measurements, store

log = logging.getLogger(__name__)

# Samples reach the database at least this often while a run is measured, so a crash of
# the service loses at most this much of a run; progress is read from them.
PERSIST_EVERY_S = 0.5
# Tries (with a growing pause) for the write that ends a run.
END_TRIES = 5
# After the last response, the connector's counters for the run are awaited this long.
REPORT_WAIT_S = 3.0
# Once they do, the worker's timed steps for the run are awaited this much longer (at most):
# they come in their own reports, and a busy machine can hold one back for seconds.
STEPS_WAIT_S = 15.0
# A stop rule's interval is checked this often at most, and never more often than every
# STOP_CHECK_SHARE-th of the time (the check's own cost makes it wait longer on a big
# run, so it never takes more than a few percent of a core from the measurement). The cost
# is the CPU time the check took: on a busy machine its wall time also counts the waits for
# a core (twice its CPU time in a CI run), which would space the checks out for nothing.
STOP_CHECK_S = 1.0
STOP_CHECK_SHARE = 20


def _rule_and_cost(spec: RunSpec, samples: list[Sample]) -> tuple[Interval | None, float]:
    """``itl_rule_met`` and the CPU time it took this thread (seconds)."""
    began = time.thread_time()
    interval = itl_rule_met(spec, samples)
    return interval, time.thread_time() - began


def too_long(spec: RunSpec, handle: WorkerHandle) -> str | None:
    """Why the run's longest request is longer than its server's ``max_model_len``, if it is."""
    if handle.max_model_len is None:
        return None
    return spec.longest_request().over(handle.max_model_len, handle.max_len_why())


class RunFailed(Exception):
    """The run cannot succeed; the message is its error as the user reads it."""


class Runner:
    """Owns one placed run until it is succeeded, failed or cancelled."""

    def __init__(self, settings: Settings, engine: Engine, fleet: Fleet, run_id: str, spec: RunSpec,
                 placement: Placement, in_sweep: bool = False, pair_id: str | None = None,
                 in_capacity: bool = False) -> None:
        self.settings = settings
        self.engine = engine
        self.fleet = fleet
        self.run_id = run_id
        self.spec = spec
        # A run of a sweep (whose until_decided rule may follow it up when it ends).
        self.in_sweep = in_sweep
        # A probe of a capacity search (which queues its next probes when it ends).
        self.in_capacity = in_capacity
        # The fill/prefill pair the run is half of: its partner waits while it runs.
        self.pair_id = pair_id
        self.placement = placement
        # Messages to the runner (see ``cancel`` and ``reported``).
        self._cancel_asked = asyncio.Event()
        self._report_came = asyncio.Event()
        # Set once the run's end state is written (or it went back to the queue): what a
        # cancel waits for. ``ended``: once the runner is done with it (after a cancel, the
        # check that its server still serves comes between the two).
        self.settled = asyncio.Event()
        self.ended = asyncio.Event()
        # True once ``_end`` has moved the run to its final status: nothing left to check.
        self.end_written = False
        self.samples: list[Sample] = []
        # Answered and failed requests among ``samples``, counted as they come: progress is
        # saved every half second, and a count over every sample would grow with the run.
        self.answered = 0
        self.failed = 0
        self._saved = 0
        # The decode median of the samples saved so far, for progress displays (``GET
        # /api/runs/{id}/live``): kept as they are saved, never recomputed from all of them.
        self.decode_so_far = RunningDecode()
        self._tallied = 0
        # The progress counts (completed, failed) last saved; None: none yet.
        self._saved_counts: tuple[int, int] | None = None
        # The worker's /metrics during the run, ``t`` on the samples' clock (perf_counter).
        self.points: list[Point] = []
        self._saved_points = 0
        self._persisting = asyncio.Lock()
        self.beats: list[dict[str, float]] = []
        self.handle: WorkerHandle | None = None
        # ``Run.stopped_by`` once the sending stopped (see ``service.analysis.stopping``).
        self.stopped_by: dict[str, Any] | None = None
        self.watchdog: Watchdog | None = None
        # The server's energy and clocks while the run is measured (``service.control.energy``).
        self.meter: EnergyMeter | None = None
        # A seeded run's seeding pass (``service.control.seeded_pass``).
        self.seeded = SeededPass(settings, fleet, run_id, spec) if spec.mode.seeds else None

    # ------------------------------------------------------------ messages

    def cancel(self) -> None:
        """A user cancelled the run: it stops sending, keeps what it measured and ends
        ``cancelled``. On the runner's event loop."""
        self._cancel_asked.set()

    def reported(self) -> None:
        """The connector reported counters for this run (stored already). On the runner's
        event loop."""
        self._report_came.set()

    # ------------------------------------------------------------ samples

    def took(self, sample: Sample) -> None:
        """A request of the run ended: its sample is kept and counted. On the event loop."""
        self.samples.append(sample)
        if sample.success:
            self.answered += 1
        else:
            self.failed += 1

    async def persist(self) -> None:
        """Save the samples not saved yet and the progress counts (in a thread: database
        work never runs on the event loop). One save at a time."""
        async with self._persisting:
            new = self.samples[self._saved:]
            points = self.points[self._saved_points:]
            ok, failed = self.answered, self.failed
            if not new and not points and self._saved_counts == (ok, failed):
                return  # all of it is in the database already

            def save() -> None:
                if new:
                    measurements.save_samples(self.engine, self.run_id, new)
                    # Each sample once, though a save that fails later comes again with it.
                    upto = self._saved + len(new)
                    self.decode_so_far.add(self.samples[self._tallied:upto])
                    self._tallied = upto
                if points:
                    measurements.save_server_points(self.engine, self.run_id, points)
                store.update_fields(self.engine, self.run_id, completed=ok, failed=failed)

            await asyncio.to_thread(save)
            self._saved += len(new)
            self._saved_points += len(points)
            self._saved_counts = (ok, failed)

    async def _persist_every(self) -> None:
        while True:
            await asyncio.sleep(PERSIST_EVERY_S)
            try:
                await self.persist()
            except Exception:
                # A locked or full database must not end the measurement; the next
                # batch (or the run's end) tries again.
                log.exception("run %s: saving samples failed; will retry", self.run_id)

    # ------------------------------------------------------------ the run

    async def run(self) -> None:
        """Run to an end state. A user's cancel ends it ``cancelled`` with the samples it
        has; cancellation by the service (shutdown) fails it and propagates."""
        try:
            await self._run_to_end()
        finally:
            if self._cancel_asked.is_set():
                # Whatever way the run went, a cancelled one that is not over ends so (a
                # guarded move: a finished run stays as it is).
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(store.transition, self.engine, self.run_id,
                                            RunStatus.cancelled, error="cancelled by the user")
            self.settled.set()
            self.ended.set()

    async def _run_to_end(self) -> None:
        reuse = self.placement.reuse
        if self._cancel_asked.is_set():
            await self._cancelled_before_start()
            return
        if reuse is not None and reuse.external and not await self.fleet.healthy(reuse):
            # A registered server can go away between two probes: the run stays queued
            # for the next server that answers instead of failing on this one.
            await self.fleet.registered.set_unavailable(
                reuse, "did not answer /health as a run was about to start")
            return
        if not await asyncio.to_thread(store.transition, self.engine, self.run_id, RunStatus.starting):
            return
        work = asyncio.create_task(self._run(), name=f"run-{self.run_id}")
        cancel = asyncio.create_task(self._cancel_asked.wait())
        try:
            await asyncio.wait({work, cancel}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                await self._end(RunStatus.cancelled, "cancelled by the user")
                self.settled.set()
                await self._check_server_after_cancel()
                return
            work.result()
        except asyncio.CancelledError:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            await self._end(RunStatus.failed, "the service stopped while this run was in progress")
            raise
        except (WorkerError, DriverError, RunFailed) as exc:
            await self._end(RunStatus.failed, str(exc))
        except Exception as exc:
            log.exception("run %s failed", self.run_id)
            await self._end(RunStatus.failed, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            cancel.cancel()

    async def _check_server_after_cancel(self) -> None:
        """A run cancelled once it had its server keeps that server only if it still
        serves: a user may cancel because it hung, before the watchdog's stall limit, and a
        stuck engine answers /health. The server stays this run's (busy) meanwhile."""
        handle, watchdog = self.handle, self.watchdog
        if handle is None or not handle.alive() or (watchdog is not None and watchdog.finding):
            return
        # One request's progress is not watched: its prefill gets the blind allowance.
        limit = (watchdog.blind_limit() if watchdog is not None
                 else blind_limit(self.settings, self.spec))
        if not await still_serves(self.fleet.client, handle, limit):
            log.warning("run %s: its server %s did not answer a one-token request after the "
                        "cancel; it takes no more runs", self.run_id, handle.id)
            await self.fleet.retire(handle, f"hung: no answer to a one-token request within "
                                            f"{limit:.0f} s after run {self.run_id} was cancelled")

    async def _cancelled_before_start(self) -> None:
        """Cancelled while still queued: the guarded move from ``queued`` (the API may
        have made it already, which is as good)."""
        await asyncio.to_thread(store.transition, self.engine, self.run_id, RunStatus.cancelled,
                                error="cancelled by the user")

    async def _run(self) -> None:
        self.fleet.prepare_drivers()
        handle = self.handle = await self._server()
        spec = self.spec
        batch = asked_concurrency(spec.max_concurrency, spec.prompt_budget(), spec.request_rate)
        # A server shorter than the run (vLLM fitted its length to its KV cache memory once
        # it was started for this run) would cut every request's output short: nothing is
        # sent, and the server stays, idle, for runs it fits.
        reason = too_long(spec, handle) or infeasible(batch or 1, spec.longest_request_tokens(),
                                                      handle.kv_tokens)
        if reason is None and self.seeded is not None:
            reason = await self.seeded.problem(handle)
        load_format = effective_load_format(spec.model, spec.engine.load_format)
        facts = provenance.service_facts()

        # One transaction: the server and the provenance recorded, and the move to running.
        began = await asyncio.to_thread(
            store.begin_measuring, self.engine, self.run_id, handle.id, handle.cpu_binding, load_format,
            handle.kv_tokens, facts, go=reason is None)
        if reason is not None:
            raise RunFailed(reason)
        if not began:
            return
        log.info("run %s started on vLLM server %s: %s, ISL %d, OSL %d, %d prompts, concurrency %s, mode %s",
                 self.run_id, handle.id, spec.model, spec.input_len, spec.output_len, spec.num_prompts,
                 spec.max_concurrency, spec.mode)
        if self.seeded is not None:
            failed = await self.seeded.seed(handle, self._watching)
            if failed is not None:
                raise RunFailed(failed)
        duration, sent, rule = await self._measure(handle)
        # Every answered request saved now: the waits below (the connector's account, the
        # summary) take seconds, during which progress must be right and a crash lose nothing.
        await self.persist()
        # The interval over every answered request (the rule was checked on fewer), and,
        # off the event loop, the summary (a big run's takes seconds of CPU): one trip.
        interval, summary = await asyncio.to_thread(
            lambda: (itl_interval(list(self.samples), spec), self._summary(duration)))
        if rule is None:
            rule = MAX_PROMPTS if spec.stop is not None else NUM_PROMPTS
        self.stopped_by = stop_record(rule, spec, sent, interval)
        if self.watchdog is not None and self.watchdog.finding is not None:
            raise self.watchdog.finding
        if not handle.alive():
            tail = await asyncio.to_thread(handle.tail)
            await self.fleet.bury(handle, "exited during a run")
            raise WorkerError(f"vLLM server exited during the run{handle.ended_why()}; "
                              f"last log lines:\n{tail}")
        samples = self.samples
        ok = [s for s in samples if s.success]
        if len(ok) < len(samples) and not await self.fleet.healthy(handle):
            # A server that stopped answering is not reused: the next run gets a new one.
            tail = await asyncio.to_thread(handle.tail)
            await self.fleet.retire(handle, "stopped answering")
            raise WorkerError(
                f"vLLM server{handle.where()} stopped answering during the run ({len(samples) - len(ok)} "
                f"requests failed); last log lines:\n{tail}"
            )
        if not ok:
            first_error = next((s.error for s in samples if s.error), "no request succeeded")
            tail = await asyncio.to_thread(handle.tail)
            await self._end(RunStatus.failed, f"every request failed; first error: {first_error}\n"
                      f"last log lines of the vLLM server:\n{tail}", summary=summary)
            return
        # Only a run whose requests came back is judged on the connector's account (a dead
        # or failing server has its own, clearer reason above).
        answered = len(ok) + self.spec.warmup_prompts
        seeded = self.seeded.prompts if self.seeded is not None else 0
        totals = await self._connector_totals(answered + seeded)
        failure, warnings = connector_verdict(totals, self.spec.mode, answered + seeded)
        if failure is None and self.seeded is not None:
            failure = self.seeded.replay_problem(summary, handle.vocab_size, self.samples, self.points)
        if failure is not None:
            await self._end(RunStatus.failed, failure, summary=summary)
            return
        recomputed = int(totals.get("recomputed_requests", 0))
        warnings += await asyncio.to_thread(self._warnings, summary, batch, recomputed)
        await self._end(RunStatus.succeeded, None, summary=summary, warnings=warnings)

    def _watching(self, watchdog: Watchdog) -> None:
        """The watchdog now watching the run's server (a cancel reads its limits)."""
        self.watchdog = watchdog

    def _summary(self, duration: float) -> dict[str, Any]:
        """vLLM's summary keys and, beside them, each latency statistic's 95% interval over
        requests, the run against its roofline (``roofline``: None when the server's
        connector did not report its sizes) and its energy (``energy``). CPU and database
        work: called in a thread."""
        summary: dict[str, Any] = dict(
            summarize(self.samples, duration, self.spec.goodput.model_dump(exclude_none=True)))
        summary.update(summary_intervals(self.samples))
        summary["prefill_stall"] = prefill_stall(self.samples, self.spec.mode)
        # The provenance as stored now: a connector report after the snapshot is in it.
        prov = store.get_run(self.engine, self.run_id).provenance or {}
        itl = summary.get("decode_median_itl_ms")
        summary["roofline"] = roofline(self.samples, prov.get("roofline"),
                                       itl if isinstance(itl, float) else None)
        if self.meter is not None:
            tokens = summary.get("total_output_tokens")
            summary["energy"] = self.meter.result(tokens if isinstance(tokens, int) else 0)
        summary["fill_neutrality"] = self._neutrality()
        return summary

    def _neutrality(self) -> dict[str, Any]:
        """Whether a dummy fill is neutral for the run's model and engine (file reads)."""
        spec = self.spec
        speculative = spec.engine.speculative
        return fill_neutrality(local_model_config(self.settings, spec.model, spec.engine.num_layers),
                               speculative.vllm_config() if speculative is not None else None)

    def _warnings(self, summary: dict[str, Any], batch: int | None, recomputed: int) -> list[dict[str, Any]]:
        """What the run's numbers should be read with. CPU and file work: called in a thread."""
        spec = self.spec
        return [
            *run_warnings(self.samples, summary),
            *server_warnings(self.points, self.samples, batch, recomputed=recomputed,
                             replayed=spec.mode.seeds),
            *client_warnings(self.samples, self.beats, spec.request_rate is not None),
            *dummy_moe(effective_load_format(spec.model, spec.engine.load_format),
                       local_model_config(self.settings, spec.model, spec.engine.num_layers)),
            *energy_warnings(summary.get("energy")),
            *fill_not_neutral(spec.mode, summary.get("fill_neutrality") or {}),
        ]

    async def _connector_totals(self, answered: int) -> dict[str, Any]:
        """The connector's counters for this run once they account for the ``answered``
        requests (both sides report shortly after a request ends), or what is there after
        ``REPORT_WAIT_S``; then, where the scheduler counted the run's steps, until the
        worker's timed steps account for them too, or ``STEPS_WAIT_S`` more."""
        began = time.monotonic()
        tp = self.spec.engine.tensor_parallel_size
        while True:
            # Cleared before the read: a report stored after it wakes the wait below.
            self._report_came.clear()
            run = await asyncio.to_thread(store.get_run, self.engine, self.run_id)
            totals = connector_totals((run.connector or {}).get("ranks", {}))
            complete = totals["requests_seen"] >= answered and (
                totals["filled_requests"] == 0
                or (totals["worker_ranks"] >= tp and totals["requests_filled"] >= totals["filled_requests"])
            )
            deadline = began + REPORT_WAIT_S
            if complete and totals["steps_tagged"]:
                # The scheduler's count is final once every request it saw has finished.
                complete = (totals["requests_finished"] >= totals["requests_seen"]
                            and totals["steps_timed"] + totals["steps_dropped"] >= totals["steps_tagged"])
                deadline += STEPS_WAIT_S
            left = deadline - time.monotonic()
            if complete or left <= 0:
                return totals
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._report_came.wait(), left)

    async def _server(self) -> WorkerHandle:
        if self.placement.reuse is not None:
            return self.placement.reuse
        # A stored spec skipped the filesystem checks (``RunSpec.stored``): a model
        # directory can have gone since the run was queued. Checked before any warm
        # worker is stopped for this run. So is a hub model that left the cache.
        problem = await asyncio.to_thread(spec_problem, self.spec) or await asyncio.to_thread(
            hub.model_problem, self.spec.model, self.settings.hub_check)
        if problem is not None:
            raise RunFailed(problem)
        return await self.fleet.server_for(self.run_id, self.spec, self.placement)

    async def _stop_when_known(self, drivers: LoadDrivers) -> None:
        """Tell the drivers to stop sending once the interval rule of the run's stop
        spec is met (checked on the samples so far, off the event loop)."""
        checked = 0
        while True:
            await asyncio.sleep(STOP_CHECK_S)
            if len(self.samples) == checked:
                continue
            checked = len(self.samples)
            interval, cost_s = await asyncio.to_thread(_rule_and_cost, self.spec, list(self.samples))
            if interval is not None:
                await drivers.stop_sending(ITL_CI)
                return
            await asyncio.sleep(cost_s * STOP_CHECK_SHARE)

    async def _measure(self, handle: WorkerHandle) -> tuple[float, int, str | None]:
        """Drive the load from driver processes while watching the worker; return the
        duration, the measured requests sent and the stop rule that ended the sending
        (None: all were sent). Samples land in ``self.samples`` as they arrive."""
        drivers = self.fleet.drivers_for(self.run_id, self.spec, handle)
        self.beats = drivers.beats
        watch = self.watchdog = Watchdog(self.settings, self.spec, self.fleet, handle, drivers)

        def on_sample(sample: Sample) -> None:
            self.took(sample)
            watch.saw(sample)

        # At the start and end always; during the run only when asked (``scrape_every_s``):
        # a scrape stalls every open stream of the server (see ``Settings``).
        every_s = self.settings.scrape_every_s
        scraper = Scraper(self.fleet.client, handle.url, every_s=every_s or 1.0)
        # Scrapes are stamped with the wall clock; samples with perf_counter (one clock for
        # every process of this machine): points are moved onto the samples' clock.
        to_perf = time.perf_counter() - time.time()

        def on_point(point: ScrapedPoint) -> None:
            self.points.append((point.t + to_perf, point.values))

        if (first := await scraper.scrape()) is not None:
            on_point(first)
        meter = self.meter = EnergyMeter.for_server(handle)
        meter.start()
        measure = asyncio.create_task(drivers.run(on_sample))
        watchdog = asyncio.create_task(watch.run())
        persister = asyncio.create_task(self._persist_every())
        scraping = asyncio.create_task(scraper.run(on_point))
        if not every_s:
            scraping.cancel()
        stopper = asyncio.create_task(self._stop_when_known(drivers))
        if self.spec.stop is None or self.spec.stop.itl_ci_pct is None:
            stopper.cancel()
        try:
            await asyncio.wait({measure, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if not measure.done():
                # The worker died or hung: stop sending, keep what was measured.
                measure.cancel()
                await asyncio.gather(measure, return_exceptions=True)
                raise watchdog.result()
            duration = measure.result()
            await asyncio.to_thread(meter.stop)
            scraping.cancel()
            await asyncio.gather(scraping, return_exceptions=True)
            if (last := await scraper.scrape()) is not None:
                on_point(last)
            rule = drivers.stopped_rule
            if rule is not None and drivers.sent >= self.spec.prompt_budget():
                rule = None  # every request was sent before the rule was met
            return duration, drivers.sent, rule
        finally:
            tasks = (measure, watchdog, persister, scraping, stopper)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

            def wind_up() -> None:
                meter.stop()
                with contextlib.suppress(Exception):  # a record, never a reason to fail the run
                    store.record_drivers(self.engine, self.run_id, drivers.placement)

            await asyncio.to_thread(wind_up)

    async def _end(self, status: RunStatus | None, error: str | None, **fields: object) -> None:
        """The one way out: save what is left of the samples and write the end state
        (``status`` None: keep the status the API set). Retried; never raises."""
        counts: dict[str, Any] = {"completed": self.answered, "failed": self.failed}
        if self.stopped_by is not None:
            counts["stopped_by"] = self.stopped_by
            if self.spec.stop is not None:
                # A run that stopped early sent fewer than its budget: that is its total.
                counts["total"] = len(self.samples)
        for attempt in range(END_TRIES):
            try:
                await self.persist()
                if status is not None:
                    extra = {"error": error} if error else {}
                    self.end_written = await asyncio.to_thread(
                        store.transition, self.engine, self.run_id, status, **counts, **extra, **fields)
                    if self.end_written:
                        log.info("run %s %s", self.run_id, ended_line(status, error, counts, fields))
                return
            except Exception:
                log.exception("run %s: writing its end state failed (try %d of %d)",
                              self.run_id, attempt + 1, END_TRIES)
                await asyncio.sleep(0.05 * 2 ** attempt)


def ended_line(status: RunStatus, error: str | None, counts: dict[str, Any],
               fields: dict[str, object]) -> str:
    """How a run ended, in one line of the service's log: its outcome, requests, the decode
    median ITL and TPOT, or the first line of its error."""
    done = f"{counts['completed']} requests answered, {counts['failed']} failed"
    summary = fields.get("summary")
    figures = ""
    if isinstance(summary, dict):
        shown = [f"{name} {value:.2f} ms" for name, key in (("decode median ITL", "decode_median_itl_ms"),
                                                           ("decode median TPOT", "decode_median_tpot_ms"))
                 if isinstance(value := summary.get(key), int | float)]
        figures = ": " + ", ".join(shown) if shown else ""
    why = f": {error.splitlines()[0]}" if error else ""
    return f"{status.value} ({done}){figures}{why}"


def spec_problem(spec: RunSpec) -> str | None:
    """Why ``spec`` would be refused if it were submitted now (None: it would not)."""
    try:
        RunSpec.model_validate(spec.model_dump())
    except ValidationError as exc:
        return f"the run's spec is no longer valid: {describe(exc)}"
    return None


def ensure_ended(engine: Engine, run_id: str) -> None:
    """After a runner returned: a run it left ``starting`` or ``running`` (its end write
    failed every try) is failed now, so it never waits for a restart to end."""
    with contextlib.suppress(Exception):
        run = store.get_run(engine, run_id)
        if run.status in (RunStatus.starting.value, RunStatus.running.value):
            store.transition(engine, run_id, RunStatus.failed,
                             error="the run's end could not be recorded (database error); "
                             "see the service log")

