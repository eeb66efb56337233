"""A node's load driver host on a Ray cluster: the actor's side of ``service.load.ray_drivers``.

``DriverHost`` is one detached actor per node, named ``drivers-<node id>`` in the service's
namespace, kept between runs: it holds a ``DriverPool`` there (spare driver processes,
started ahead of need), so a run pays a few actor calls, not an interpreter start. It
starts a run's shard processes, writes their config line, keeps what they write on stdout
until the service has it (``lines``, a long poll), and writes ``start`` and ``stop`` lines
to them when told to. The processes and their pipe protocol are those of
``service.load.driver``, unchanged. A shard the service stops asking about (its service
died: a host outlives it) is stopped after ``ORPHAN_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import ray

from service.load.shards import STOP_WAIT_S, DriverPool, DriverProcess
from service.storage.logs import log_tail

log = logging.getLogger(__name__)

# Logs of ended shards a host keeps (for ``stderr_tail``), the last to end.
LOGS_KEPT = 64
# A shard the service has not asked about for this long is an orphan (its service died:
# a host outlives it) and is stopped; a live service polls about every 0.5 s (``ray_drivers.POLL_S``).
ORPHAN_S = 60.0


class _Shard:
    """One shard process on a host, and the lines it wrote that the service lacks."""

    def __init__(self, proc: DriverProcess, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.lines: list[str] = []
        # How many lines came before ``lines[0]`` (the service has them).
        self.base = 0
        # The exit code, once the process has ended and every line is read.
        self.code: int | None = None
        self.changed = asyncio.Event()
        self.reader: asyncio.Task[None] | None = None
        # When the service last called about this shard (``time.monotonic``).
        self.touched = time.monotonic()

    def since(self, number: int) -> list[str]:
        """The lines from ``number`` on; those before it are dropped."""
        drop = min(number - self.base, len(self.lines))
        if drop > 0:
            del self.lines[:drop]
            self.base += drop
        return list(self.lines)

    async def read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while line := await self.proc.stdout.readline():
                self.lines.append(line.decode())
                self.changed.set()
        finally:
            self.code = await self.proc.wait()
            self.changed.set()

    async def write(self, line: str) -> None:
        stdin = self.proc.stdin
        if stdin is not None and not stdin.is_closing():
            with contextlib.suppress(OSError, ConnectionError):
                stdin.write(line.encode() + b"\n")
                await stdin.drain()


class DriverHost:
    """The driver processes on one node (a Ray actor; see the module docstring). Its
    methods are coroutines: Ray runs them on the actor's event loop, which relays the
    shards' pipes."""

    def __init__(self, namespace: str, spares: int = 1, orphan_s: float = ORPHAN_S) -> None:
        log_dir = Path(tempfile.gettempdir()) / f"decodebench-drivers-{namespace}"
        self.pool = DriverPool(log_dir, spares)
        self.orphan_s = orphan_s
        self._shards: dict[str, _Shard] = {}
        self._ended: OrderedDict[str, Path] = OrderedDict()
        self._reaper: asyncio.Task[None] | None = None

    def _start(self) -> None:
        # Inside the actor's event loop: the pool starts its spares there.
        if self._reaper is None:
            self.pool.start()
            self._reaper = asyncio.create_task(self._reap_orphans())

    def _shard(self, key: str) -> _Shard:
        shard = self._shards[key]
        shard.touched = time.monotonic()
        return shard

    async def _reap_orphans(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.orphan_s / 2))
            now = time.monotonic()
            for key, shard in list(self._shards.items()):
                if now - shard.touched > self.orphan_s and key in self._shards:
                    log.warning("load driver %s: no word from the service for %.0f s; stopping it",
                                shard.log_path.name, now - shard.touched)
                    with contextlib.suppress(Exception):
                        await self.stop(key, 0)

    async def node(self) -> dict[str, str]:
        """This host's node id and IP (and its spares start, if not yet)."""
        self._start()
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address()}  # type: ignore[no-untyped-call]

    async def clock(self) -> float:
        """This host's ``time.perf_counter``."""
        return time.perf_counter()

    async def open(self, config_json: str, name: str) -> str:
        """Start a shard with this ``DriverConfig`` (JSON), its stderr log named ``name``;
        return its key."""
        self._start()
        proc, log_path = await self.pool.take(name)
        shard = _Shard(proc, log_path)
        key = uuid.uuid4().hex
        self._shards[key] = shard
        shard.reader = asyncio.create_task(shard.read())
        await shard.write(config_json)
        return key

    async def go(self, key: str, t0: float) -> None:
        """Start the shard's schedule at ``t0`` (this host's clock)."""
        await self._shard(key).write(json.dumps({"start": t0}))

    async def stop_sending(self, key: str, rule: str) -> None:
        """Tell the shard to send no more requests (those sent finish and count)."""
        await self._shard(key).write(json.dumps({"stop": rule}))

    async def lines(self, key: str, since: int, wait_s: float) -> tuple[list[str], int | None]:
        """The shard's lines from number ``since`` on, waiting up to ``wait_s`` for one;
        and its exit code once it has ended (then no line follows)."""
        shard = self._shard(key)
        if not shard.since(since) and shard.code is None:
            shard.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(shard.changed.wait(), wait_s)
        return shard.since(since), shard.code

    async def stop(self, key: str, since: int) -> tuple[list[str], int | None]:
        """Stop the shard (SIGTERM; SIGKILL after ``STOP_WAIT_S``) and return what it wrote
        from line ``since`` on, and its exit code."""
        shard = self._shards.pop(key)
        assert shard.reader is not None
        if shard.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                shard.proc.terminate()
        try:
            await asyncio.wait_for(asyncio.shield(shard.reader), STOP_WAIT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                shard.proc.kill()
        # A reader that failed (a line over the limit) has read all it could.
        with contextlib.suppress(Exception):
            await shard.reader
        self._ended[key] = shard.log_path
        while len(self._ended) > LOGS_KEPT:
            _, old = self._ended.popitem(last=False)
            old.unlink(missing_ok=True)
        self.pool.refill()
        return shard.since(since), shard.code

    async def stderr_tail(self, key: str) -> str:
        """The last lines the shard wrote to stderr."""
        shard = self._shards.get(key)
        path = shard.log_path if shard is not None else self._ended.get(key)
        return log_tail(path).strip() if path is not None else ""

    async def close(self) -> None:
        """Stop every shard and the spares."""
        if self._reaper is not None:
            self._reaper.cancel()
        for key in list(self._shards):
            await self.stop(key, 0)
        await self.pool.close()
