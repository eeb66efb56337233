"""The service's side of the load drivers: the processes of one run, started, fed,
read and stopped by the service (``Drivers``), and a pool of spares (``DriverPool``).

What a driver process does, and the lines it and the service exchange, is in
``service.load.driver``; this module holds no timing of its own. Drivers are forked
from a warm host (``service.load.forkserver``) that has imported them already; while
there is none, each is a ``python -m service.load.driver`` process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from service.core.sample import Sample
from service.load.driver import DriverConfig, shard_count
from service.load.forkserver_client import DriverHost, HostLost
from service.load.plan import LoadShape
from service.storage.logs import log_tail

if TYPE_CHECKING:
    from service.core.spec import RunSpec

log = logging.getLogger(__name__)

# Lines carry a sample's gaps and text: well over asyncio's 64 KiB default.
LINE_LIMIT = 64 << 20
# How long a stopped shard gets to go before SIGKILL.
STOP_WAIT_S = 3.0


# How far ahead the shards of a run are given their common start (s).
START_LEAD_S = 0.05


class DriverError(Exception):
    """A driver process died, hung or could not start; the message says why."""


class DriverProcess(Protocol):
    """One driver process as ``Drivers`` uses it: an ``asyncio`` child process, or a
    driver forked by the host (``forkserver_client.HostedDriver``)."""

    stdin: asyncio.StreamWriter | None
    stdout: asyncio.StreamReader | None

    @property
    def pid(self) -> int:
        """Its process id."""
        ...

    @property
    def returncode(self) -> int | None:
        """Its exit code (``-signal`` if a signal ended it); None while it runs."""
        ...

    async def wait(self) -> int:
        """Wait for it to end; its exit code."""
        ...

    def terminate(self) -> None:
        """SIGTERM."""
        ...

    def kill(self) -> None:
        """SIGKILL."""
        ...


class Progress(NamedTuple):
    """What a shard's latest beat said of its streams: how many are open, when any stream
    last got bytes, when the oldest open one started (None: none is open), and the
    beat's time."""

    open: int
    last_data: float
    oldest_open: float | None
    t: float


class DriverPool:
    """Driver processes started ahead of need. Each is forked from a warm host
    (``service.load.forkserver``), which has imported the load generator once, so a
    driver costs milliseconds; without a host (it died: a new one is started) a driver
    is a Python process of its own, whose start and imports take about a second on a
    small machine. A run takes a process that has started already (waiting for its
    config on stdin), and a new spare is started behind it.

    Nothing starts before the first run needs it (``prepare``, called as a run starts
    its server, which takes far longer than the host's imports): a service that only
    shows results runs no driver host (its start costs 0.3 s of CPU)."""

    def __init__(self, log_dir: Path, spares: int = 1, warm: bool = False) -> None:
        self.log_dir = log_dir
        self.spares = spares
        # Fork drivers from a host (False: every driver is a process of its own).
        self.warm = warm
        self.host: DriverHost | None = None
        self._ready: list[tuple[DriverProcess, Path]] = []
        self._filling: set[asyncio.Task[None]] = set()
        self._count = 0
        self._closed = False
        self._prepared = False

    def start(self) -> None:
        """Ready for runs; nothing starts until one comes (``prepare``)."""

    def prepare(self) -> None:
        """A run is on its way: start the host and the spares, once (inside the event loop)."""
        if self._prepared or self._closed:
            return
        self._prepared = True
        if self.warm:
            self._start_host()
        self._refill()

    def _start_host(self) -> None:
        self.host = DriverHost(self.log_dir)
        self.host.start()

    async def _spawn(self) -> tuple[DriverProcess, Path]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._count += 1
        log_path = self.log_dir / f"driver-spare-{os.getpid()}-{self._count}.log"
        host = self.host
        if host is not None:
            try:
                return await host.spawn(log_path, LINE_LIMIT), log_path
            except HostLost as e:
                if self.host is host and not self._closed:
                    log.warning("%s: this driver starts as a process of its own%s", e,
                                ", and a new host starts" if host.was_ready else "")
                    # A host that never got ready would fail again: drivers go on as
                    # processes of their own.
                    self.host = None
                    if host.was_ready:
                        self._start_host()
                    await host.close()
        with log_path.open("wb") as log_file:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "service.load.driver",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log_file,
                limit=LINE_LIMIT,
                # Its own process group (the driver makes it first thing: uvloop has no
                # process_group), in the service's session: see ``service.control.procs``.
            )
        return proc, log_path

    def refill(self) -> None:
        """Start spares up to the pool's size (after a run, when the machine is quiet)."""
        self._refill()

    def _refill(self) -> None:
        if self._closed:
            return
        while len(self._ready) + len(self._filling) < self.spares:
            async def fill() -> None:
                spare = await self._spawn()
                if self._closed:
                    await _stop_processes([spare[0]])
                else:
                    self._ready.append(spare)
            task = asyncio.create_task(fill())
            self._filling.add(task)
            task.add_done_callback(self._filling.discard)

    async def take(self, name: str) -> tuple[DriverProcess, Path]:
        """A driver process for one shard, its stderr log renamed to ``name``."""
        self.prepare()
        while self._ready:
            proc, log_path = self._ready.pop(0)
            if proc.returncode is None:
                break
        else:
            proc, log_path = await self._spawn()
        # No new spare now: a driver of its own takes a core for a moment, and a run's
        # first requests (and its connector's pull of the fill values) come next.
        # ``refill`` after the run.
        target = self.log_dir / name
        log_path.rename(target)
        return proc, target

    def drivers_for(self, run_id: str, spec: RunSpec, base_url: str, served_model: str,
                    vocab_size: int | None, request_timeout_s: float, hang_s: float, *,
                    node_id: str | None = None, phase: str | None = None) -> Drivers:
        """The driver processes of one run, taken from this pool (all on this machine:
        ``node_id``, the server's Ray node, is for backends that place drivers)."""
        return Drivers.for_run(run_id, spec, base_url, served_model, vocab_size, request_timeout_s,
                               self, hang_s, phase)

    async def close(self) -> None:
        """Stop the spares; no new ones are started."""
        self._closed = True
        for task in list(self._filling):
            task.cancel()
        await asyncio.gather(*self._filling, return_exceptions=True)
        await _stop_processes([p for p, _ in self._ready])
        for _, log_path in self._ready:
            log_path.unlink(missing_ok=True)
        self._ready.clear()
        if self.host is not None:
            await self.host.close()


def _terminate(procs: list[DriverProcess]) -> None:
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()


async def _stop_processes(procs: list[DriverProcess]) -> None:
    """SIGTERM, then SIGKILL after ``STOP_WAIT_S``; reaped either way."""
    _terminate(procs)
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), STOP_WAIT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def run_configs(run_id: str, spec: RunSpec, base_url: str, served_model: str,
                vocab_size: int | None, request_timeout_s: float, at_least: int = 1,
                phase: str | None = None) -> list[DriverConfig]:
    """The configs of one run's shards: ``shard_count`` of them, or ``at_least``
    (``phase``: see ``DriverConfig.phase``)."""
    # With a stop rule the plan holds the most requests the run may send; a shard
    # stops early when told to, or at its time box.
    shape = LoadShape.of(spec).model_copy(update={"num_prompts": spec.prompt_budget()})
    duration_s = spec.stop.duration_s if spec.stop is not None else None
    n = max(at_least, shard_count(shape))
    return [
        DriverConfig(run_id=run_id, spec=shape, base_url=base_url,
                     served_model=served_model, vocab_size=vocab_size,
                     request_timeout_s=request_timeout_s, cache_salt=spec.seed_set_salt(),
                     shard=k, shards=n,
                     duration_s=duration_s, phase=phase)
        for k in range(n)
    ]


# Fields of a sample and of a beat that are instants on the driver's clock (the others
# are spans): moved onto the service's clock when the driver's clock is another host's.
SAMPLE_TIMES = ("start_time", "due_time", "sent_time")
BEAT_TIMES = ("t", "last_data", "oldest_open")


class ShardedRun:
    """What the service knows of one run's shards from the lines they sent, wherever they
    run (``Drivers`` here, ``service.load.ray_drivers.RayDrivers`` on a Ray cluster)."""

    def __init__(self, configs: list[DriverConfig], hang_s: float) -> None:
        self.configs = configs
        # A shard silent for this long (no beat, no sample) has hung.
        self.hang_s = hang_s
        # Every beat of every shard: ``{"t", "cpu", "lag_ms", "shard"}``.
        self.beats: list[dict[str, float]] = []
        # Which stop rule ended the sending, as the shards reported it ("duration"), or as
        # the service told them (``stop_sending``); None: every request was sent.
        self.stopped_rule: str | None = None
        # Measured requests the shards sent (known once they are done).
        self.sent = 0
        # Per shard, from its latest beat (on the service's clock).
        self.progress: dict[int, Progress] = {}
        # Each shard's duration, from its ``done`` line; the shards that sent one.
        self.durations: list[float] = []
        self.finished: set[int] = set()
        self._ready: set[int] = set()
        # Set once every shard has done its warmup: the schedule may start.
        self.all_ready = asyncio.Event()

    @property
    def placement(self) -> list[dict[str, Any]]:
        """Every shard runs on this machine, on its clock."""
        return [{"shard": k, "node_id": "local", "node_ip": "127.0.0.1"} for k in range(len(self.configs))]

    def quiet(self) -> tuple[int, float] | None:
        """Streams open over the shards still sending, and for how long they have waited for
        bytes with none coming: from the later of the last bytes any shard saw and the start
        of the oldest stream open (a stream opened after a pause between requests has waited
        only since it opened) to the oldest of the sending shards' latest beats (a shard may
        have had bytes since its beat, unknown yet; a finished one beats no more, and its
        last beat must not hold the others' silence back). None before every shard has
        beaten once or finished."""
        if len(self.progress.keys() | self.finished) < len(self.configs):
            return None
        sending = [p for k, p in self.progress.items() if k not in self.finished]
        open_now = sum(p.open for p in sending)
        starts = [p.oldest_open for p in sending if p.open and p.oldest_open is not None]
        if not starts:
            return open_now, 0.0
        # A finished shard's last bytes count: the server answered then.
        since = max(max(p.last_data for p in self.progress.values()), min(starts))
        known_until = min(p.t for p in sending)
        return open_now, max(0.0, known_until - since)

    def take(self, shard: int, message: dict[str, Any], on_sample: Callable[[Sample], None],
             offset: float = 0.0) -> None:
        """Act on one line of ``shard``; ``offset`` is its clock minus the service's."""
        kind = message.get("kind")
        if kind == "sample":
            sample = message["sample"]
            if offset:
                for name in SAMPLE_TIMES:
                    if sample.get(name) is not None:
                        sample[name] -= offset
            on_sample(Sample(**sample))
        elif kind == "ready":
            self._ready.add(shard)
            if len(self._ready) == len(self.configs):
                self.all_ready.set()
        elif kind == "done":
            self.finished.add(shard)
            self.durations.append(float(message["duration"]))
            self.sent += int(message.get("sent", 0))
        elif kind == "stopped":
            # Every shard has the same time box from the same t0: each stops itself.
            if self.stopped_rule is None:
                self.stopped_rule = str(message["rule"])
        elif kind == "beat" and "cpu" in message:
            if offset:
                for name in BEAT_TIMES:
                    if message.get(name) is not None:
                        message[name] -= offset
            self.beats.append({"t": float(message["t"]), "cpu": float(message["cpu"]),
                               "lag_ms": float(message["lag_ms"]), "shard": shard})
            oldest = message.get("oldest_open")
            self.progress[shard] = Progress(
                int(message["open"]), float(message["last_data"]),
                None if oldest is None else float(oldest), float(message["t"]))


class Drivers(ShardedRun):
    """The driver processes of one run, as the service sees them."""

    def __init__(self, configs: list[DriverConfig], pool: DriverPool, hang_s: float) -> None:
        super().__init__(configs, hang_s)
        self.pool = pool
        self.log_paths: list[Path] = []
        self.procs: list[DriverProcess] = []

    @classmethod
    def for_run(cls, run_id: str, spec: RunSpec, base_url: str, served_model: str,
                vocab_size: int | None, request_timeout_s: float, pool: DriverPool,
                hang_s: float, phase: str | None = None) -> Drivers:
        """The shards of one run (``shard_count`` of them)."""
        return cls(run_configs(run_id, spec, base_url, served_model, vocab_size, request_timeout_s,
                               phase=phase), pool, hang_s)

    async def stop_sending(self, rule: str) -> None:
        """Tell every shard to send no more requests (those sent finish and count)."""
        if self.stopped_rule is None:
            self.stopped_rule = rule
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.is_closing():
                with contextlib.suppress(OSError, ConnectionError):
                    proc.stdin.write(json.dumps({"stop": rule}).encode() + b"\n")
                    await proc.stdin.drain()

    def stderr_tail(self) -> str:
        """The last lines each shard wrote to stderr."""
        parts = [f"[{path.name}]\n{text}" for path in self.log_paths if (text := log_tail(path).strip())]
        return "\n".join(parts) or "(nothing on stderr)"

    async def run(self, on_sample: Callable[[Sample], None]) -> float:
        """Start the shards, start their schedule together once all are ready, hand every
        sample to ``on_sample`` as it arrives; return the run's duration (s). Raises
        ``DriverError`` if a shard dies or hangs. Cancelling stops the shards; samples
        they sent before that are handed on first."""
        def handle(shard: int, message: dict[str, Any]) -> None:
            self.take(shard, message, on_sample)

        try:
            for config in self.configs:
                proc, log_path = await self.pool.take(config.log_name())
                self.procs.append(proc)
                self.log_paths.append(log_path)
                assert proc.stdin is not None
                proc.stdin.write(config.model_dump_json().encode() + b"\n")
                await proc.stdin.drain()

            async def go() -> None:
                await self.all_ready.wait()
                # A moment ahead, so every shard starts the schedule at the same instant (one
                # shard has nobody to wait for: it starts when told).
                t0 = time.perf_counter() + (START_LEAD_S if len(self.procs) > 1 else 0.0)
                for proc in self.procs:
                    assert proc.stdin is not None
                    proc.stdin.write(json.dumps({"start": t0}).encode() + b"\n")
                    await proc.stdin.drain()

            starter = asyncio.create_task(go())
            readers = [asyncio.create_task(self._read(k, handle)) for k in range(len(self.procs))]
            try:
                await asyncio.gather(*readers)
            finally:
                starter.cancel()
                for reader in readers:
                    reader.cancel()
                await asyncio.gather(starter, *readers, return_exceptions=True)
            if len(self.durations) != len(self.procs):
                raise DriverError(f"a load driver ended without finishing its requests; its stderr:\n"
                                  f"{self.stderr_tail()}")
            return max(self.durations)
        finally:
            await self.stop(handle)

    async def _read(self, shard: int, handle: Callable[[int, dict[str, Any]], None]) -> None:
        proc = self.procs[shard]
        assert proc.stdout is not None
        while True:
            # ``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for`` returns the
            # line when a cancel lands as the line arrives, and the cancel is lost (the
            # cancelled run then went on sending to its end). Here the read is awaited in
            # this task, whose cancel is raised at its next step whatever the read did.
            try:
                async with asyncio.timeout(self.hang_s):
                    line = await proc.stdout.readline()
            except TimeoutError:
                raise DriverError(
                    f"load driver {shard} sent nothing for {self.hang_s:g} s (hung); its stderr:\n"
                    f"{self.stderr_tail()}"
                ) from None
            if not line:
                break
            handle(shard, json.loads(line))
        code = await proc.wait()
        if code != 0:
            raise DriverError(f"load driver {shard} exited with code {code}; its stderr:\n"
                              f"{self.stderr_tail()}")

    async def stop(self, handle: Callable[[int, dict[str, Any]], None] | None = None) -> None:
        """Stop every shard still running (SIGTERM, then SIGKILL) and wait for it; with
        ``handle``, what they wrote before they stopped is read and handed to it first."""
        _terminate(self.procs)
        if handle is not None:
            for shard, proc in enumerate(self.procs):
                with contextlib.suppress(TimeoutError, ValueError, OSError):
                    async with asyncio.timeout(STOP_WAIT_S):
                        assert proc.stdout is not None
                        while line := await proc.stdout.readline():
                            handle(shard, json.loads(line))
        await _stop_processes(self.procs)
        self.pool.refill()
