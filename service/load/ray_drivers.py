"""Load drivers on a Ray cluster: a run's shards run on the node of its server (or spread
over ``RunSpec.driver_nodes`` nodes), so requests cross the network users have between
client and server. Imported only when the service runs with Ray (``Settings.ray_address``);
nothing on the default path imports this module or Ray.

The pieces:

``DriverHost``
    One detached actor per node, named ``drivers-<node id>`` in the service's namespace,
    kept between runs: it holds a ``DriverPool`` there (spare driver processes, started
    ahead of need), so a run pays a few actor calls, not an interpreter start. It starts a
    run's shard processes, writes their config line, keeps what they write on stdout until
    the service has it, and writes ``start`` and ``stop`` lines to them when told to. The
    processes and their pipe protocol are those of ``service.load.driver``, unchanged.
``RayDrivers``
    A run's shards as its runner sees them (``service.control.fleet.LoadDrivers``), the
    counterpart of ``service.load.shards.Drivers``: same messages, same errors.
``RayDriverBackend``
    The fleet's ``DriverBackend`` on Ray.

Lines come back by long polling: ``DriverHost.lines(key, since, wait_s)`` returns every
line of a shard from number ``since`` on, at once when there is one, else after at most
``wait_s``; lines before ``since`` are dropped (the service has them). A poll the service
gave up on (cancelled, timed out) loses nothing: the next one, or ``stop``, asks again from
the same number. So every sample reaches the runner exactly once, about as soon as the
driver wrote it, and the runner persists it as with local drivers.

Clocks. Each driver times its requests on its own host's ``time.perf_counter``. Before the
schedule starts, the service asks each host for its clock a few times; the answer of the
shortest round trip gives the host's offset (its clock minus the service's, taken as the
middle of the round trip) with an uncertainty of half that round trip. ``t0`` is sent to
each host on its own clock (t0 + offset) and every instant a host reports (a sample's
``start_time``, ``due_time`` and ``sent_time``, a beat's times) is moved back onto the
service's clock, so the runner sees one time line; spans (TTFT, ITL, latency, a shard's
duration) are taken as measured. The offsets are kept in ``RayDrivers.clocks`` for the
run's record.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.core.sample import Sample
from service.load.driver import DriverConfig
from service.load.shards import (
    STOP_WAIT_S,
    DriverError,
    DriverPool,
    DriverProcess,
    ShardedRun,
    run_configs,
)
from service.storage.logs import log_tail

if TYPE_CHECKING:
    from service.core.spec import RunSpec
    from service.settings import Settings

log = logging.getLogger(__name__)

# How long a poll waits on the host for a line when there is none.
POLL_S = 0.5
# How long an actor call may take before its host counts as unresponsive.
CALL_S = 10.0
# How long a new driver host may take to start (a worker process, its imports).
HOST_START_S = 60.0
# The schedule starts this long after the service decides t0: time for every host to
# get its ``go`` first.
START_LEAD_S = 0.25
# Clock pings per host; the one with the shortest round trip gives the offset.
PINGS = 5
# Logs of ended shards a host keeps (for ``stderr_tail``), the last to end.
LOGS_KEPT = 64
# A shard the service has not asked about for this long is an orphan (its service died:
# a host outlives it) and is stopped; a live service polls every ``POLL_S`` or so.
ORPHAN_S = 60.0


def host_name(node_id: str) -> str:
    """The actor name of the driver host on a node."""
    return f"drivers-{node_id}"


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


# The actor class of ``DriverHost`` (defined once: each ``ray.remote`` exports the class anew).
_REMOTE_HOST: Any = ray.remote(DriverHost)


@dataclass
class HostRef:
    """The service's handle on a driver host, with the node it runs on."""

    actor: Any
    node_id: str
    node_ip: str

    @property
    def where(self) -> str:
        """The node, as error messages name it."""
        return f"{self.node_id} ({self.node_ip})"

    async def call(self, method: str, *args: Any, timeout: float = CALL_S) -> Any:
        """Call ``method`` on the host; ``DriverError`` naming the node if it fails, its
        host or node died, or no answer came in ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(getattr(self.actor, method).remote(*args), timeout)
        except TimeoutError:
            raise DriverError(f"the load driver host on node {self.where} did not answer "
                              f"{method} within {timeout:g} s") from None
        except RayError as exc:
            raise DriverError(f"the load driver host on node {self.where} failed or is gone "
                              f"({type(exc).__name__}): {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class RayDrivers(ShardedRun):
    """The load driver shards of one run on a Ray cluster, as its runner sees them: on
    ``node_id`` (the server's node), or round-robin over ``nodes`` nodes starting there."""

    def __init__(self, configs: list[DriverConfig], backend: RayDriverBackend, node_id: str | None,
                 nodes: int, hang_s: float) -> None:
        super().__init__(configs, hang_s)
        self.backend = backend
        self.node_id = node_id
        self.nodes = nodes
        # Which node each shard runs on.
        self.shard_nodes: dict[int, str] = {}
        # Per shard: its node and that host's clock offset to the service (its clock minus
        # the service's) with the offset's uncertainty, both in seconds.
        self.clocks: list[dict[str, Any]] = []
        self._hosts: list[HostRef] = []
        self._offsets: list[float] = []
        self._keys: list[str] = []
        # Per shard, how many of its lines were handed on.
        self._handed: list[int] = []
        self._tails: dict[int, str] = {}

    @property
    def placement(self) -> list[dict[str, Any]]:
        """Where each shard runs, with its host's clock offset once measured (for the run's
        record and ``GET /api/cluster``)."""
        if self.clocks:
            return list(self.clocks)
        return [{"shard": k, "node_id": node, "node_ip": None} for k, node in self.shard_nodes.items()]

    async def run(self, on_sample: Callable[[Sample], None]) -> float:
        """Start the shards on their hosts, start their schedule together once all are
        ready, hand every sample on (on the service's clock) as it arrives; return the run's
        duration (s). Raises ``DriverError`` if a shard dies or hangs, or its host or node
        does (named in the message). Cancelling stops the shards; samples they sent before
        that are handed on first."""
        try:
            await self._place()
            await self._measure_clocks()
            for k, config in enumerate(self.configs):
                key = await self._hosts[k].call("open", config.model_dump_json(),
                                                f"{config.run_id}.driver{k}.log")
                self._keys.append(key)
                self._handed.append(0)
            pollers = [asyncio.create_task(self._poll(k, on_sample)) for k in range(len(self._keys))]
            starter = asyncio.create_task(self._go())
            tasks: set[asyncio.Task[None]] = {*pollers, starter}
            try:
                while not all(p.done() for p in pollers):
                    done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()
            finally:
                for task in (*pollers, starter):
                    task.cancel()
                await asyncio.gather(*pollers, starter, return_exceptions=True)
            if len(self.durations) != len(self._keys):
                raise DriverError("a load driver ended without finishing its requests; its stderr:\n"
                                  f"{await self._fetch_tails()}")
            return max(self.durations)
        finally:
            await self._stop(on_sample)

    async def _place(self) -> None:
        alive = await asyncio.to_thread(self.backend.alive_nodes)
        first = self.node_id or await asyncio.to_thread(self.backend.own_node)
        if first is None or first not in alive:
            if self.node_id is not None:
                raise DriverError(f"the run's server node {self.node_id} is not alive in the Ray cluster")
            first = next(iter(alive), None)
            if first is None:
                raise DriverError("the Ray cluster has no alive node for the load drivers")
        chosen = [first, *[n for n in alive if n != first]][: self.nodes]
        if len(chosen) < self.nodes:
            raise DriverError(f"the run asks for its load drivers on {self.nodes} nodes; "
                              f"the Ray cluster has {len(alive)} alive")
        hosts = {node: await self.backend.host(node, alive[node]) for node in chosen}
        for k in range(len(self.configs)):
            node = chosen[k % len(chosen)]
            self.shard_nodes[k] = node
            self._hosts.append(hosts[node])

    async def _measure_clocks(self) -> None:
        found: dict[str, tuple[float, float]] = {}
        for host in self._hosts:
            if host.node_id in found:
                continue
            best: tuple[float, float] | None = None
            for _ in range(PINGS):
                sent = time.perf_counter()
                remote = float(await host.call("clock"))
                back = time.perf_counter()
                if best is None or back - sent < best[0]:
                    best = (back - sent, remote - (sent + back) / 2)
            assert best is not None
            found[host.node_id] = best
        for k, host in enumerate(self._hosts):
            round_trip, offset = found[host.node_id]
            self._offsets.append(offset)
            self.clocks.append({"shard": k, "node_id": host.node_id, "node_ip": host.node_ip,
                                "offset_s": offset, "uncertainty_s": round_trip / 2})

    async def _go(self) -> None:
        await self.all_ready.wait()
        t0 = time.perf_counter() + START_LEAD_S
        await asyncio.gather(*(host.call("go", key, t0 + offset)
                               for host, key, offset in zip(self._hosts, self._keys, self._offsets,
                                                            strict=True)))

    def _hand_on(self, k: int, lines: list[str], on_sample: Callable[[Sample], None]) -> None:
        for line in lines:
            self._handed[k] += 1
            self.take(k, json.loads(line), on_sample, self._offsets[k])

    async def _poll(self, k: int, on_sample: Callable[[Sample], None]) -> None:
        host, key = self._hosts[k], self._keys[k]
        heard = time.perf_counter()
        while True:
            lines, code = await host.call("lines", key, self._handed[k], POLL_S,
                                          timeout=POLL_S + self.hang_s)
            self._hand_on(k, lines, on_sample)
            now = time.perf_counter()
            if lines:
                heard = now
            if code is not None:
                if code != 0:
                    raise DriverError(f"load driver {k} on node {host.where} exited with code {code}; "
                                      f"its stderr:\n{await self._fetch_tails()}")
                return
            if now - heard > self.hang_s:
                raise DriverError(f"load driver {k} on node {host.where} sent nothing for "
                                  f"{self.hang_s:g} s (hung); its stderr:\n{await self._fetch_tails()}")

    async def stop_sending(self, rule: str) -> None:
        """Tell every shard to send no more requests (those sent finish and count)."""
        if self.stopped_rule is None:
            self.stopped_rule = rule
        await asyncio.gather(*(host.call("stop_sending", key, rule)
                               for host, key in zip(self._hosts, self._keys, strict=False)),
                             return_exceptions=True)

    async def _fetch_tails(self) -> str:
        async def one(k: int) -> None:
            with contextlib.suppress(DriverError):
                self._tails[k] = str(await self._hosts[k].call("stderr_tail", self._keys[k]))

        await asyncio.gather(*(one(k) for k in range(len(self._keys))))
        return self.stderr_tail()

    def stderr_tail(self) -> str:
        """The last lines each shard wrote to stderr, as last fetched from its host."""
        parts = [f"[driver {k} on {self._hosts[k].where}]\n{text}"
                 for k, text in sorted(self._tails.items()) if text]
        return "\n".join(parts) or "(nothing on stderr)"

    async def _stop(self, on_sample: Callable[[Sample], None]) -> None:
        """Stop every shard still running and hand on what it wrote before it stopped; a
        host that is gone is skipped (its lines went with it)."""
        async def one(k: int) -> None:
            try:
                lines, _ = await self._hosts[k].call("stop", self._keys[k], self._handed[k],
                                                     timeout=STOP_WAIT_S + CALL_S)
            except DriverError as exc:
                log.warning("stopping load driver %d: %s", k, exc)
                return
            self._hand_on(k, lines, on_sample)

        await asyncio.gather(*(one(k) for k in range(len(self._keys))))


class RayDriverBackend:
    """Where runs' load drivers run when the service has a Ray cluster: driver hosts on
    its nodes (``service.control.fleet.DriverBackend``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # The nodes this backend has put a driver host on.
        self._nodes: set[str] = set()

    def start(self) -> None:
        """Connect to the cluster, unless this process already is."""
        if not ray.is_initialized():
            ray.init(address=self.settings.ray_address, namespace=self.settings.ray_namespace)

    def drivers_for(self, run_id: str, spec: RunSpec, base_url: str, served_model: str,
                    vocab_size: int | None, request_timeout_s: float, hang_s: float, *,
                    node_id: str | None = None) -> RayDrivers:
        """The drivers of one run against the server at ``base_url``, on ``node_id`` (the
        server's node; None: this process's node) or spread over ``spec.driver_nodes``
        nodes from there, with at least one shard per node."""
        configs = run_configs(run_id, spec, base_url, served_model, vocab_size, request_timeout_s,
                              at_least=spec.driver_nodes)
        return RayDrivers(configs, self, node_id, spec.driver_nodes, hang_s)

    def alive_nodes(self) -> dict[str, str]:
        """The cluster's alive nodes: IP by node id, in the cluster's order (blocking)."""
        return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()  # type: ignore[no-untyped-call]
                if n.get("Alive")}

    def own_node(self) -> str | None:
        """The node this process runs on, if it is one of the cluster's (blocking)."""
        with contextlib.suppress(Exception):
            return str(ray.get_runtime_context().get_node_id())
        return None

    async def host(self, node_id: str, node_ip: str) -> HostRef:
        """The driver host on a node: the one there, else a new one (pinned to the node)."""
        def get() -> Any:
            return _REMOTE_HOST.options(
                name=host_name(node_id), namespace=self.settings.ray_namespace,
                lifetime="detached", get_if_exists=True, num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.settings.ray_namespace)

        actor = await asyncio.to_thread(get)
        self._nodes.add(node_id)
        ref = HostRef(actor, node_id, node_ip)
        where = await ref.call("node", timeout=HOST_START_S)
        if where["node_id"] != node_id:
            raise DriverError(f"the load driver host meant for node {ref.where} runs on "
                              f"{where['node_id']} ({where['node_ip']})")
        return ref

    async def close(self) -> None:
        """Stop the driver hosts this backend used (their shards and spares): they are
        detached and would outlive the service."""
        for node_id in sorted(self._nodes):
            def get(node_id: str = node_id) -> Any:
                return ray.get_actor(host_name(node_id), namespace=self.settings.ray_namespace)

            try:
                actor = await asyncio.to_thread(get)
            except ValueError:
                continue  # gone already
            with contextlib.suppress(DriverError):
                await HostRef(actor, node_id, "").call("close", timeout=STOP_WAIT_S + CALL_S)
            with contextlib.suppress(RayError, ValueError):
                await asyncio.to_thread(ray.kill, actor)
        self._nodes.clear()
