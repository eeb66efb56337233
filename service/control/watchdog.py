"""The watchdog of a run's server: it says when the server died, hung, or stopped
answering while the run was being measured, and takes the server out of service.

A hang is silence: streams open and none got a byte for ``stall_limit`` (the server's
/health may still answer, as a stuck engine's API server does). Silence is counted by
the load drivers (``LoadDrivers.quiet``) from the later of the last byte and the start
of the oldest open stream, so pauses between requests of a slow open loop are not one.
"""

from __future__ import annotations

import asyncio
import math

import httpx

from service.analysis.server_metrics import RUNNING, WAITING, Scraper
from service.control.fleet import Fleet, LoadDrivers
from service.control.handles import WorkerError, WorkerHandle
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.settings import Settings

WATCH_EVERY_S = 0.5
# A stream may be silent for this many times the run's longest time to first token
# before its worker counts as hung (``Settings.stall_s`` is the floor).
STALL_TTFT_FACTOR = 3.0
# Before a run's first token, a real prefill is allowed this slow (tokens per second): a
# 131,072-token prompt gets 131 s. Far below any GPU's; about a 2-core CPU's for a 1B
# model.
SLOWEST_PREFILL_TOKENS_S = 1000.0


def stall_limit(settings: Settings, spec: RunSpec, longest_ttft: float = 0.0,
                seeding: bool = False) -> float:
    """Seconds without a byte on any open stream after which a run's worker has hung:
    ``stall_s``, or more where a prefill may be that silent (one step of the engine can
    hold a whole prompt's prefill, and every stream waits for it). That is three times
    the run's longest time to first token so far; before the first, for a real prefill
    (a prefill run, or a seeded run's ``seeding`` pass), its longest prompt at
    ``SLOWEST_PREFILL_TOKENS_S``."""
    if longest_ttft > 0:
        return max(settings.stall_s, STALL_TTFT_FACTOR * longest_ttft)
    if spec.mode == "prefill" or seeding:
        longest = math.floor(spec.input_len * (1 + spec.range_ratio))
        return max(settings.stall_s, longest / SLOWEST_PREFILL_TOKENS_S)
    return settings.stall_s


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
        """Seconds without a byte on any open stream after which the worker has hung (see
        ``stall_limit``)."""
        return stall_limit(self.settings, self.spec, self.longest_ttft, self.seeding)

    async def _stalled(self) -> WorkerError | None:
        """A ``WorkerError`` when streams are open and none got a byte for ``stall_limit``
        (the worker's /health may still answer: a stuck engine keeps its API server up)."""
        progress = self.drivers.quiet()
        if progress is None:
            return None
        open_now, quiet = progress
        limit = self.stall_limit()
        if open_now == 0 or quiet < limit:
            return None
        handle = self.handle
        said = await self._engine_says()
        tail = await asyncio.to_thread(handle.tail)
        self.finding = WorkerError(
            f"vLLM server hung{' during the seeding pass' if self.seeding else ''}: none of the "
            f"{open_now} open streams got a token for {quiet:.0f} s "
            f"(the limit: {limit:.0f} s; DECODEBENCH_STALL_S sets it, and it is more where a "
            f"prefill may be that silent), while {said}; last log lines:\n{tail}"
        )
        # Known before the stop: requests failing meanwhile must not read as the server
        # exiting on its own.
        await self.fleet.retire(handle, f"hung: no token on any open stream for {quiet:.0f} s")
        return self.finding

    async def _engine_says(self) -> str:
        """What the worker's /metrics says it is doing, in words for an error message."""
        point = await Scraper(self.fleet.client, self.handle.url).scrape()
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
