"""The watchdog of a run's server: it says when the server died, hung, or stopped
answering while the run was being measured, and takes the server out of service.

A hang is silence without progress: streams open, none got a byte, and the server's own
``/metrics`` did not move, for ``stall_limit``. The server's /health may still answer, as
a stuck engine's API server does. Silence is counted by the load drivers
(``LoadDrivers.quiet``) from the later of the last byte and the start of the oldest open
stream, so pauses between requests of a slow open loop are not one.

Progress is what the engine shows between its steps (``EngineProgress``). A long prompt is
computed in chunks, one engine step each, and vLLM's /metrics moves after every step, its
first token or not: on vLLM 0.32 the gauges ``num_requests_running``/``waiting`` and
``kv_cache_usage_perc`` are set from the scheduler's stats every step (a chunk's KV blocks
raise the usage), while the token counters move only once a request has a token. A stuck
engine steps no more and its /metrics stays as it was. So a prefill of any length, at any
speed, is not a hang while its chunks come; one step longer than the limit is (chunked
prefill off, or steps of more tokens than the machine computes in ``stall_s``): three
times the run's longest time to first token, once it has one, allows for that.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import httpx

from service.analysis.server_metrics import RUNNING, WAITING, Scraper
from service.control.fleet import Fleet, LoadDrivers
from service.control.handles import WorkerError, WorkerHandle
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.settings import Settings

WATCH_EVERY_S = 0.5
# A server may be silent and still for this many times the run's longest time to first
# token, or its longest engine step seen, before it counts as hung (``Settings.stall_s``
# is the floor).
STALL_TTFT_FACTOR = 3.0
# While every open stream is silent, the server's /metrics is read this many times per
# stall limit, from a sixth of it on: a render costs the engine's cores on a CPU machine
# (up to 0.7 s on 2 cores), so not on every tick, and never while tokens flow.
PROGRESS_LOOKS = 6
# Only for a server whose /metrics says nothing of its steps (no answer, or none of
# vLLM's series: ``--disable-log-stats``): before a real prefill's first token it is
# allowed this slow (tokens per second), as the watchdog cannot see its progress.
BLIND_PREFILL_TOKENS_S = 1000.0


def stall_limit(settings: Settings, longest_ttft: float = 0.0, longest_step: float = 0.0) -> float:
    """Seconds a server may go with every open stream silent and its /metrics still before
    it has hung: ``stall_s``, or if more, three times the run's longest time to first token
    so far (one engine step can hold a whole prompt's prefill, and nothing moves within a
    step) or its longest engine step seen (a chunk of a prompt costs more the longer the
    context before it)."""
    return max(settings.stall_s, STALL_TTFT_FACTOR * longest_ttft, STALL_TTFT_FACTOR * longest_step)


def blind_limit(settings: Settings, spec: RunSpec, longest_ttft: float = 0.0,
                seeding: bool = False) -> float:
    """The limit where the server's progress cannot be seen (its /metrics says nothing; a
    one-token request after a cancel): ``stall_limit``, or before the first token of a
    real prefill (a prefill run, or a seeded run's ``seeding`` pass) its longest prompt at
    ``BLIND_PREFILL_TOKENS_S`` if more."""
    limit = stall_limit(settings, longest_ttft)
    if longest_ttft <= 0 and (spec.mode.prefills_measured or seeding):
        longest = math.floor(spec.input_len * (1 + spec.range_ratio))
        return max(limit, longest / BLIND_PREFILL_TOKENS_S)
    return limit


async def still_serves(client: httpx.AsyncClient, handle: WorkerHandle, limit: float) -> bool:
    """Whether the server answers a one-token request within ``limit`` seconds: after a
    run was cancelled, a stuck engine (which keeps /health up) must not take the next run.
    Any answer but a server error counts (a refusal is an answer)."""
    body = {"model": handle.served_model, "prompt": "ok", "max_tokens": 1, "temperature": 0.0}
    try:
        response = await client.post(f"{handle.url}/v1/completions", json=body, timeout=limit)
    except httpx.HTTPError:
        return False
    return response.status_code < 500


class EngineProgress:
    """Whether the server's /metrics moved during the current silence of its streams, and
    when it last did: read every ``every`` seconds while the silence lasts (``look``),
    forgotten when it ends (``reset``). A value that changed between two reads, any of the
    series ``server_metrics.parse`` keeps, is progress; the time between two moves, the
    server's step."""

    def __init__(self, scraper: Scraper) -> None:
        self.scraper = scraper
        # The longest time between two moves of one silence (s): an engine step, or the
        # time between reads if longer (a read every ``every`` s sees at most one move).
        # Kept over the run's silences.
        self.longest_step = 0.0
        self.reset()

    def reset(self) -> None:
        """A silence ended, or none began: what was read belongs to it."""
        self.values: dict[str, float] | None = None
        self.looked_at = -math.inf
        # When the last read that found a value changed was made (None: none did).
        self.moved_at: float | None = None
        # Whether /metrics said anything kept in this silence (if not, the progress
        # cannot be seen: ``blind_limit``).
        self.answered = False

    async def look(self, now: float, every: float) -> None:
        """Read /metrics if ``every`` seconds passed since the last read (``now``:
        ``time.monotonic``)."""
        if now - self.looked_at < every:
            return
        self.looked_at = now
        point = await self.scraper.scrape()
        if point is None:
            return
        self.answered = True
        if self.values is not None and point.values != self.values:
            if self.moved_at is not None:
                self.longest_step = max(self.longest_step, now - self.moved_at)
            self.moved_at = now
        self.values = point.values

    def still_for(self, now: float, quiet: float) -> float:
        """Seconds of the silence (``quiet``) since /metrics last moved."""
        return quiet if self.moved_at is None else min(quiet, now - self.moved_at)


class Watchdog:
    """Watches one run's server while its drivers send (see the module docstring):
    the measured requests, or (``seeding``) a seeded run's seeding pass, whose findings
    name it."""

    def __init__(self, settings: Settings, spec: RunSpec, fleet: Fleet, handle: WorkerHandle,
                 drivers: LoadDrivers, seeding: bool = False) -> None:
        self.settings = settings
        self.spec = spec
        self.fleet = fleet
        self.handle = handle
        self.drivers = drivers
        self.seeding = seeding
        # What its findings say the server was doing.
        self.during = "the seeding pass" if seeding else "the run"
        self.failures = 0
        # The longest time to first token of the run so far (s): a prefill this long is
        # not a hang (see ``stall_limit``).
        self.longest_ttft = 0.0
        self.scraper = Scraper(fleet.client, handle.url)
        self.engine = EngineProgress(self.scraper)
        self.now: Callable[[], float] = time.monotonic
        # What it found (hung, stopped answering), set before it takes the server down:
        # requests failing meanwhile must not read as the server exiting on its own.
        self.finding: WorkerError | None = None

    def saw(self, sample: Sample) -> None:
        """A request of the run ended."""
        if not sample.success:
            self.failures += 1
        elif sample.ttft > self.longest_ttft:
            self.longest_ttft = sample.ttft

    def stall_limit(self) -> float:
        """Seconds of silence without progress after which the worker has hung (see
        ``stall_limit``)."""
        return stall_limit(self.settings, self.longest_ttft, self.engine.longest_step)

    def blind_limit(self) -> float:
        """The limit where the server's progress cannot be seen (see ``blind_limit``)."""
        return blind_limit(self.settings, self.spec, self.longest_ttft, self.seeding)

    async def _stalled(self) -> WorkerError | None:
        """A ``WorkerError`` when streams are open, none got a byte and the server's
        /metrics did not move for ``stall_limit`` (its /health may still answer: a stuck
        engine keeps its API server up). /metrics is read only while every stream is
        silent, ``PROGRESS_LOOKS`` times a limit."""
        progress = self.drivers.quiet()
        if progress is None:
            return None
        open_now, quiet = progress
        limit = self.stall_limit()
        every = max(WATCH_EVERY_S, limit / PROGRESS_LOOKS)
        if open_now == 0 or quiet < every:
            self.engine.reset()
            return None
        now = self.now()
        await self.engine.look(now, every)
        if not self.engine.answered:
            limit = max(limit, self.blind_limit())
        still = self.engine.still_for(now, quiet)
        if still < limit:
            return None
        if not self.engine.answered:
            moved = "its /metrics said nothing of its progress"
        elif self.engine.moved_at is None:
            moved = "its /metrics did not move"
        else:
            moved = f"its /metrics did not move for {still:.0f} s"
        handle = self.handle
        said = await self._engine_says()
        tail = await asyncio.to_thread(handle.tail)
        self.finding = WorkerError(
            f"vLLM server hung{' during the seeding pass' if self.seeding else ''}: none of the "
            f"{open_now} open streams got a token for {quiet:.0f} s and {moved} (the limit: "
            f"{limit:.0f} s; DECODEBENCH_STALL_S sets it, or three times the run's longest "
            f"time to first token or engine step if more), while {said}; last log lines:\n{tail}"
        )
        # Known before the stop: requests failing meanwhile must not read as the server
        # exiting on its own.
        await self.fleet.retire(handle, f"hung: no token on any open stream for {quiet:.0f} s")
        return self.finding

    async def _engine_says(self) -> str:
        """What the worker's /metrics says it is doing, in words for an error message."""
        point = await self.scraper.scrape()
        if point is None:
            return "its /metrics did not answer"
        running = point.values.get(RUNNING)
        waiting = point.values.get(WAITING)
        if running is None:
            return "its /metrics did not say how many requests it runs"
        return f"it reported {running:.0f} requests running and {waiting or 0:.0f} waiting"

    async def run(self) -> WorkerError:
        """Return (never raise) once the worker has died, hung (``_stalled``), or stopped
        answering after a failed request; until then, watch."""
        handle = self.handle
        checked = 0

        async def exited() -> WorkerError:
            tail = await asyncio.to_thread(handle.tail)
            await self.fleet.bury(handle, "exited during the seeding pass" if self.seeding
                                  else "exited during a run")
            return WorkerError(f"vLLM server exited during {self.during}{handle.ended_why()}; "
                              f"last log lines:\n{tail}")

        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            if not handle.alive():
                return await exited()
            if self.failures > checked:
                checked = self.failures
                if not await self.fleet.healthy(handle):
                    # A dying server refuses connections a moment before it is reaped.
                    await asyncio.sleep(WATCH_EVERY_S)
                    if not handle.alive():
                        return await exited()
                    tail = await asyncio.to_thread(handle.tail)
                    self.finding = WorkerError(
                        f"vLLM server{handle.where()} stopped answering during {self.during} "
                        f"({checked} requests failed); last log lines:\n{tail}"
                    )
                    await self.fleet.retire(handle, "stopped answering")
                    return self.finding
            if (hung := await self._stalled()) is not None:
                return hung
