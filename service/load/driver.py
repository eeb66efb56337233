"""The load driver process: the data plane. One run's requests are sent and timed in
processes that do nothing else: no SQLite, no pages, no connector traffic, no scheduler.
The service's side of them (starting, feeding, reading, stopping) is ``service.load.shards``.

The service starts a driver process for each shard of a run (one shard per
``STREAMS_PER_SHARD`` streams, at most one per core): forked from the warm host
(``service.load.forkserver``), which runs ``main`` in the child, or, without one,
``python -m service.load.driver``. It talks to each over its pipes, one JSON object per
line:

service -> driver (stdin)
    ``DriverConfig``, then ``{"start": t0}`` once every shard is ready: the measured
    schedule begins at ``t0``; later ``{"stop": rule}`` when a stop rule is met: no more
    requests are sent, those sent finish. Closing stdin (the service is gone) ends the
    driver.
driver -> service (stdout)
    ``{"kind": "ready"}`` after its warmup requests, ``{"kind": "sample", "sample": {...}}``
    as each measured request ends, ``{"kind": "beat", ...}`` every ``BEAT_S`` (a driver
    whose loop is stuck stops beating; see ``_drive`` for what a beat says),
    ``{"kind": "stopped", "rule": "duration"}`` when its time box (``duration_s`` after
    ``t0``) ended the sending, ``{"kind": "done", "duration": s, "sent": n}`` at the end.
    A traceback goes to stderr, which the service keeps in a log file.

Lines are written by a thread of their own from an unbounded queue: a service slow to
read (its event loop busy, the 64 KiB pipe full) delays the lines, never the timing of
the streams.

Clock: every shard and the service use ``time.perf_counter``, which on Linux is
``CLOCK_MONOTONIC``, one clock for all processes of the machine; so the samples of all
shards of a run, and ``t0``, are on the same time line. Shards on other hosts (a Ray
cluster) time on their host's clock; ``service.load.ray_drivers`` measures each host's
offset and moves their instants onto the service's clock.

Shards split the requests round-robin by position and the concurrency limit as evenly
as it goes; each keeps its share of the one seeded schedule.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from pydantic import BaseModel

from service.load.generator import LoadGenerator
from service.load.plan import LoadShape, make_plan

if TYPE_CHECKING:
    from service.core.spec import RunSpec

STREAMS_PER_SHARD = 256
BEAT_S = 1.0
# How long a driver told to stop (SIGTERM) spends writing its queued lines before it
# exits; the service reads them for ``service.load.shards.STOP_WAIT_S``.
STOPPED_FLUSH_S = 2.0


class DriverConfig(BaseModel):
    """What one shard needs to drive its part of a run."""

    run_id: str
    spec: LoadShape
    base_url: str
    served_model: str
    vocab_size: int | None
    request_timeout_s: float
    # The requests' ``cache_salt``; None: the run id (a seeded run's: its seed set's).
    cache_salt: str | None = None
    shard: int = 0
    shards: int = 1
    # A time box: no request is sent later than this after the schedule's start.
    duration_s: float | None = None
    # "seeding": a seeded run's unmeasured seeding pass, whose logs are named apart.
    phase: str | None = None

    def log_name(self) -> str:
        """The name of this shard's stderr log in the logs folder: ``{run_id}.driver{shard}.log``,
        or ``{run_id}.{phase}.driver{shard}.log`` (the measured requests' drivers and the
        seeding pass's never write one file)."""
        phase = f".{self.phase}" if self.phase else ""
        return f"{self.run_id}{phase}.driver{self.shard}.log"


def shard_count(spec: RunSpec | LoadShape, cpus: int | None = None) -> int:
    """How many driver processes a run gets: one per ``STREAMS_PER_SHARD`` streams it may
    have open at once, at most one per core, at least one."""
    streams = spec.max_concurrency or spec.num_prompts
    if spec.max_concurrency is None and spec.request_rate is not None:
        # An open loop's streams in flight depend on the server; assume all may overlap.
        streams = spec.num_prompts
    cores = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(1, min(cores, math.ceil(streams / STREAMS_PER_SHARD)))


def shard_concurrency(limit: int | None, shard: int, shards: int) -> int | None:
    """This shard's part of the run's concurrency limit (None: no limit)."""
    if limit is None:
        return None
    return max(1, limit // shards + (1 if shard < limit % shards else 0))


async def _drive(config: DriverConfig, emit: Callable[[dict[str, Any]], None],
                 start_line: asyncio.Future[float], stop_line: asyncio.Event | None = None) -> None:
    spec = config.spec
    plan = make_plan(spec, config.vocab_size)
    generator = LoadGenerator(
        config.base_url, config.served_model, config.run_id,
        shard_concurrency(spec.max_concurrency, config.shard, config.shards),
        config.request_timeout_s, cache_salt=config.cache_salt, seeding=config.phase == "seeding",
    )

    async def beat() -> None:
        # Each beat says how busy this process was since the last one (CPU seconds per
        # second, of one core) and how late the beat itself ran (the event loop's lag):
        # a saturated driver sends late, and the run says so (``client_lag``). It also
        # says, for hang detection, how many streams are open, when any stream last got
        # bytes, and when the oldest open stream started (None: none is open): a stream
        # cannot have been silent for longer than it has been open.
        cpu_then, then = time.process_time(), time.perf_counter()
        emit({"kind": "beat"})
        while True:
            due = then + BEAT_S
            await asyncio.sleep(BEAT_S)
            now, cpu_now = time.perf_counter(), time.process_time()
            emit({"kind": "beat", "t": now, "cpu": round((cpu_now - cpu_then) / (now - then), 4),
                  "lag_ms": round(max(0.0, now - due) * 1000, 3),
                  "open": generator.open, "last_data": generator.last_data,
                  "oldest_open": generator.oldest_open})
            cpu_then, then = cpu_now, now

    beating = asyncio.create_task(beat())
    try:
        mine = range(config.shard, len(plan.input_lens), config.shards)
        await generator.warmup(plan, [p for p in mine if p < plan.warmups])
        emit({"kind": "ready"})
        t0 = await start_line

        async def stop_when_told() -> None:
            waits: list[asyncio.Task[Any]] = []
            if stop_line is not None:
                waits.append(asyncio.create_task(stop_line.wait()))
            if config.duration_s is not None:
                waits.append(asyncio.create_task(
                    asyncio.sleep(t0 + config.duration_s - time.perf_counter())))
            if not waits:
                return
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()
            if not (stop_line is not None and stop_line.is_set()):
                emit({"kind": "stopped", "rule": "duration"})
            generator.stop_sending()

        stopper = asyncio.create_task(stop_when_told())
        try:
            duration = await generator.measure(
                plan, lambda s: emit({"kind": "sample", "sample": s.as_dict()}),
                [p for p in mine if p >= plan.warmups], start=t0,
            )
        finally:
            stopper.cancel()
        emit({"kind": "done", "duration": duration, "sent": generator.sent})
    finally:
        beating.cancel()
        await generator.aclose()


class LineWriter:
    """Writes the driver's lines to ``out`` from a thread of its own, in order; ``emit``
    only queues them, so it never blocks the event loop that times the streams."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="driver-lines", daemon=True)
        self._thread.start()

    def emit(self, message: dict[str, Any]) -> None:
        """Queue one message as a line (any thread)."""
        self._lines.put(json.dumps(message) + "\n")

    def _write(self) -> None:
        while (line := self._lines.get()) is not None:
            try:
                self.out.write(line)
                if self._lines.empty():
                    self.out.flush()
            except OSError:
                # The service closed the pipe or died: nobody reads what we measure.
                os._exit(3)
        self.out.flush()

    def close(self, timeout: float | None = None) -> None:
        """Write every line queued so far, then stop (wait at most ``timeout`` seconds)."""
        self._lines.put(None)
        self._thread.join(timeout)


def main() -> None:
    """Entry point of ``python -m service.load.driver``."""
    # A process group of its own, so a terminal's Ctrl-C reaches the service only (which
    # then stops its drivers itself); not a session of its own (see ``service.control.procs``).
    os.setpgrp()
    # The protocol owns the real stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    line = sys.stdin.readline()
    if not line:
        return  # a spare the service no longer needs (or a service that is gone)
    config = DriverConfig.model_validate_json(line)
    writer = LineWriter(out)

    def terminated() -> None:
        # Stopped by the service, which reads what is left for a while: hand it the lines
        # measured so far, then go.
        writer.close(STOPPED_FLUSH_S)
        os._exit(0)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        start_line: asyncio.Future[float] = loop.create_future()
        stop_line = asyncio.Event()

        def read_stdin() -> None:
            line = sys.stdin.readline()
            if line:
                t0 = float(json.loads(line)["start"])

                def start() -> None:
                    if not start_line.done():
                        start_line.set_result(t0)

                loop.call_soon_threadsafe(start)
                while line := sys.stdin.readline():
                    if "stop" in json.loads(line):
                        loop.call_soon_threadsafe(stop_line.set)
            # The service closed our stdin or died: nobody reads what we measure.
            os._exit(3)

        threading.Thread(target=read_stdin, daemon=True).start()
        loop.add_signal_handler(signal.SIGTERM, terminated)
        await _drive(config, writer.emit, start_line, stop_line)

    try:
        asyncio.run(run())
    finally:
        writer.close()


if __name__ == "__main__":
    main()
