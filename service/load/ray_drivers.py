"""Load drivers on a Ray cluster: a run's shards run on the node of its server (or spread
over ``RunSpec.driver_nodes`` nodes), so requests cross the network users have between
client and server. Imported only when the service runs with Ray (``Settings.ray_address``);
nothing on the default path imports this module or Ray.

The pieces:

``DriverHost`` (``service.load.ray_driver_host``: the code that runs on the node)
    One detached actor per node, named ``drivers-<node id>`` in the service's namespace,
    kept between runs, that starts a run's shard processes there and relays their lines.
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.core.sample import Sample
from service.load.driver import DriverConfig
from service.load.ray_driver_host import DriverHost
from service.load.shards import STOP_WAIT_S, DriverError, ShardedRun, run_configs

if TYPE_CHECKING:
    from service.core.spec import RunSpec
    from service.settings import Settings

log = logging.getLogger(__name__)

# How long a poll waits on the host for a line when there is none.
POLL_S = 0.5
# How long an actor call may take before its host counts as unresponsive.
CALL_S = 10.0
# How long a new driver host may take to start (a worker process, its imports). On a node
# whose cores a vLLM server keeps busy this has taken over 60 s (a CI run saw a host on
# the head node miss 60 s beside the suite's e2e servers); a node that is down is seen
# by Ray's health check well before this.
HOST_START_S = 180.0
# The schedule starts this long after the service decides t0: time for every host to
# get its ``go`` first.
START_LEAD_S = 0.25
# Clock pings per host; the one with the shortest round trip gives the offset.
PINGS = 5


def host_name(node_id: str) -> str:
    """The actor name of the driver host on a node."""
    return f"drivers-{node_id}"


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
        # ``asyncio.timeout``, not ``wait_for``, which on Python 3.11 can lose a cancel that
        # lands as the answer arrives (``Drivers._read``): a cancelled run's pollers stop.
        try:
            async with asyncio.timeout(timeout):
                return await getattr(self.actor, method).remote(*args)
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
                                                config.log_name())
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

    def prepare(self) -> None:
        """Nothing: a node's driver host starts when the first drivers are placed on that node."""

    def drivers_for(self, run_id: str, spec: RunSpec, base_url: str, served_model: str,
                    vocab_size: int | None, request_timeout_s: float, hang_s: float, *,
                    node_id: str | None = None, phase: str | None = None) -> RayDrivers:
        """The drivers of one run against the server at ``base_url``, on ``node_id`` (the
        server's node; None: this process's node) or spread over ``spec.driver_nodes``
        nodes from there, with at least one shard per node."""
        configs = run_configs(run_id, spec, base_url, served_model, vocab_size, request_timeout_s,
                              at_least=spec.driver_nodes, phase=phase)
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
