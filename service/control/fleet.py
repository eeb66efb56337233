"""The fleet: every vLLM server the service can place runs on, and the load drivers of
its runs, behind one interface.

The fleet is the one owner of every server handle and its state: placeable (ready or
starting, idle or busy with one run), stopping (its GPUs stay held until its process group
has exited), and the runs placed on a server that is not up yet. The scheduler reads that
state (``rows``) and reserves what a placement decided (``reserve``); a run's runner gets
its server (``server_for``), its load drivers (``drivers_for``), retires a server that
failed (``retire``, ``bury``), and gives everything back once (``release``). Nothing else
writes a handle's state.

Where servers and drivers live is the backends' business: ``service.control.local`` starts
vLLM processes on this machine, ``service.control.registered`` drives servers started
elsewhere, and ``service.load.driver`` runs driver processes here. A backend that places
them on other hosts plugs in behind the same methods: a server is a handle with a URL, a
liveness check and a log tail; a run's drivers are a ``LoadDrivers`` that streams samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from sqlalchemy import Engine

from service.control.handles import EngineFailed, WorkerError, WorkerHandle
from service.control.local import LocalServers
from service.control.placement import Decision, WorkerRow
from service.control.registered import RegisteredServers
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.load.shards import DriverPool
from service.settings import Settings

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0


class LoadDrivers(Protocol):
    """A run's load drivers as its runner sees them, wherever they run."""

    beats: list[dict[str, float]]
    stopped_rule: str | None
    sent: int

    async def run(self, on_sample: Callable[[Sample], None]) -> float:
        """Send the run's requests; hand each sample on as it arrives; the duration (s)."""
        ...

    async def stop_sending(self, rule: str) -> None:
        """Send no more requests; those sent finish and count."""
        ...

    def quiet(self) -> tuple[int, float] | None:
        """Streams open, and seconds none of them got a byte (None: not known yet)."""
        ...

    def stderr_tail(self) -> str:
        """What the drivers last said on their error output."""
        ...

    @property
    def placement(self) -> list[dict[str, Any]]:
        """Where each shard runs: ``{"shard", "node_id", "node_ip"}``, and on a cluster
        the host's clock offset to the service (``offset_s``, ``uncertainty_s``)."""
        ...


class ServerBackend(Protocol):
    """Where the servers this service starts run, and how they are started and stopped
    (``service.control.local.LocalServers``: processes on this machine)."""

    # Worker tokens of the servers it started, by worker id.
    tokens: dict[str, str]

    async def start(self, spec: RunSpec, gpus: list[str], hold: Callable[[WorkerHandle], None],
                    taken: set[int]) -> WorkerHandle:
        """Start a server for ``spec`` on ``gpus``; ``hold`` gets its handle as soon as it
        exists (before any await); return once it is healthy. A start that fails or is
        cancelled after ``hold`` leaves the server running: the fleet stops it."""
        ...

    async def stop(self, handle: WorkerHandle, status: str = "stopped", error: str | None = None) -> None:
        """Stop the server and everything it started; return once they are gone."""
        ...

    async def bury(self, handle: WorkerHandle, error: str) -> None:
        """The server exited on its own: stop what is left of it and record why."""
        ...

    def reap_orphans(self) -> int:
        """After a crash of the service: stop servers a previous one left (blocking)."""
        ...

    def slots(self) -> list[str] | None:
        """What placement may give servers (one slot per GPU); None: the service host's
        GPUs (``Settings.gpu_ids``)."""
        ...

    def nodes(self) -> list[dict[str, Any]]:
        """The hosts servers may run on: id, address, CPUs, GPUs."""
        ...

    def open(self) -> None:
        """Get ready (inside the event loop)."""
        ...

    async def close(self) -> None:
        """Stop what ``open`` started (the servers are stopped already)."""
        ...


class DriverBackend(Protocol):
    """Where the load drivers of runs run (``service.load.shards.DriverPool``: processes
    on this machine; ``service.load.ray_drivers.RayDriverBackend``: on a Ray cluster's
    nodes, imported only when the service has one)."""

    def start(self) -> None:
        """Get ready for runs (inside the event loop)."""
        ...

    def prepare(self) -> None:
        """A run is on its way (its server is starting): start what its drivers need, if
        that is not running yet (inside the event loop)."""
        ...

    async def close(self) -> None:
        """Stop everything kept ready."""
        ...

    def drivers_for(self, run_id: str, spec: RunSpec, base_url: str, served_model: str,
                    vocab_size: int | None, request_timeout_s: float, hang_s: float, *,
                    node_id: str | None = None, phase: str | None = None) -> LoadDrivers:
        """The drivers of one run against the server at ``base_url``; ``node_id`` is the
        server's Ray node, where a backend that places drivers puts them (None: unknown);
        ``phase``: "seeding" for a seeded run's seeding pass (``DriverConfig.phase``)."""
        ...


@dataclass
class Placement:
    """Where a run goes: an idle server of its kind, or GPUs for a new server (after
    stopping the idle servers in ``evict``)."""

    key: str
    reuse: WorkerHandle | None = None
    gpus: list[str] = field(default_factory=list)
    evict: list[WorkerHandle] = field(default_factory=list)


class Fleet:
    """The servers and drivers of this service (see the module docstring)."""

    def __init__(self, settings: Settings, engine: Engine, client: httpx.AsyncClient,
                 servers: ServerBackend | None = None, drivers: DriverBackend | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        # Servers runs can be placed on (ready, or starting for the run that waits on it).
        self.workers: dict[str, WorkerHandle] = {}
        # The registered ones among them: their records, probes and removal.
        self.registered = RegisteredServers(engine, client, self.workers)
        # Servers being stopped: they take no runs and hold their GPUs until stopped.
        self._stopping: dict[str, WorkerHandle] = {}
        # Runs placed on a new server that is not up yet, with the GPUs they hold.
        self._starting: dict[str, Placement] = {}
        # The stops in progress, by server: each runs to its end, whoever asked for it.
        self._stops: dict[str, asyncio.Task[None]] = {}
        self.servers: ServerBackend = servers or LocalServers(settings, engine, client)
        self.driver_pool: DriverBackend = drivers or DriverPool(settings.logs_dir, warm=settings.warm_drivers)
        self._gpus: list[str] = []
        # The drivers of runs being measured (for ``cluster``).
        self._drivers: dict[str, LoadDrivers] = {}

    @property
    def tokens(self) -> dict[str, str]:
        """Worker tokens of the servers this service started, by worker id."""
        return self.servers.tokens

    # ------------------------------------------------------------ life of the service

    async def recover(self) -> int:
        """After a crash: stop worker process groups a previous service left, and take
        back the registered servers (unavailable until probed). Returns how many
        orphans were stopped."""
        # The GPUs, once: NVML's first answer can take a while (never on the event loop).
        if self.servers.slots() is None:
            self._gpus = await asyncio.to_thread(self.settings.gpu_ids)
        orphans = await asyncio.to_thread(self.servers.reap_orphans)
        registered = await self.registered.load_registered()
        if registered:
            log.info("%d registered workers to probe", registered)
        return orphans

    def start(self) -> None:
        """Start the backends' watchers (inside the event loop); drivers start with the first run."""
        self.servers.open()
        self.driver_pool.start()

    async def shutdown(self) -> None:
        """Stop the spare drivers and every server this service started, at once, and
        return once all are gone: ready, starting (a start the shutdown interrupted is
        stopping already) and stopping ones."""
        await self.driver_pool.close()
        for handle in [*self.workers.values(), *self._stopping.values()]:
            if not handle.external:
                self._taking_down(handle, functools.partial(
                    self.servers.stop, handle, "stopped", "the service shut down"))
        await asyncio.gather(*self._stops.values(), return_exceptions=True)
        await self.servers.close()

    # ------------------------------------------------------------ what placement sees

    def rows(self) -> tuple[list[WorkerRow], list[tuple[str, list[str]]]]:
        """Every server as placement sees it (stopping ones too: they hold GPUs), and the
        (kind, GPUs) of runs whose new server is not up yet."""
        rows = [_row(h, stopping=False) for h in self.workers.values()]
        rows += [_row(h, stopping=True) for h in self._stopping.values()]
        return rows, [(p.key, p.gpus) for p in self._starting.values()]

    def gpu_ids(self) -> list[str]:
        """The GPUs (or, on a cluster, the slots) servers may be placed on: the service
        host's known from ``recover``, a cluster's as its backend last saw them."""
        slots = self.servers.slots()
        return list(self._gpus) if slots is None else slots

    def on_cpu(self) -> bool:
        """Whether the servers this service starts run on CPUs: this host has no GPUs it may
        use, or the cluster's slots are CPUs (``RayServers.slots`` names them ``cpu<k>``)."""
        return all(slot.startswith("cpu") for slot in self.gpu_ids())

    def cpu_memory_bytes(self) -> int | None:
        """The memory of the CPU machine this service starts its servers on, which a bundled
        shape's server is checked against (``Settings.cpu_memory_bytes``); None where its
        servers have GPUs, or run on a cluster's nodes and no ``cpu_memory_gib`` is set."""
        if not self.on_cpu():
            return None
        if self.servers.slots() is not None and self.settings.cpu_memory_gib is None:
            return None
        return self.settings.cpu_memory_bytes()

    def reserve(self, decision: Decision) -> Placement:
        """Hold what a placement decided for its run, before any await: the reused server
        is busy with it; evicted servers take no runs (their GPUs stay held); the GPUs of
        a new server are the run's."""
        placement = Placement(key=decision.key)
        handles = {**self.workers, **self._stopping}
        if decision.reuse is not None:
            placement.reuse = handles[decision.reuse]
            placement.reuse.busy_run = decision.run_id
            return placement
        placement.gpus = list(decision.gpus)
        placement.evict = [handles[w] for w in decision.evict]
        for handle in placement.evict:
            self.workers.pop(handle.id, None)
            self._stopping[handle.id] = handle
        self._starting[decision.run_id] = placement
        return placement

    # ------------------------------------------------------------ a run's servers

    async def server_for(self, run_id: str, spec: RunSpec, placement: Placement) -> WorkerHandle:
        """The run's server: the one it reuses, or a new one started after the servers
        its placement evicts have stopped."""
        if placement.reuse is not None:
            return placement.reuse
        for handle in list(placement.evict):
            await self._stop(handle, "stopped", f"stopped to make room for run {run_id} ({spec.model})")

        held: list[WorkerHandle] = []

        def hold(handle: WorkerHandle) -> None:
            # Called right after the process starts, before any await: a run cancelled
            # while its server starts leaves nothing running that nobody holds.
            handle.busy_run = run_id
            self.workers[handle.id] = handle
            held.append(handle)

        taken = {h.port for h in (*self.workers.values(), *self._stopping.values())}
        try:
            return await self.servers.start(spec, placement.gpus, hold, taken)
        except BaseException as exc:
            for handle in held:
                stopping = self._taking_down(handle, self._stop_unstarted(handle, exc))
                # Cancelled (a user's cancel, the service's shutdown): the run ends now and
                # the stop goes on, held here (``shutdown`` waits for it). Failed: the run's
                # error comes once its server is gone.
                if not isinstance(exc, asyncio.CancelledError):
                    with contextlib.suppress(Exception):  # logged by the stop; the run's error is exc
                        await asyncio.shield(stopping)
            raise
        finally:
            self._starting.pop(run_id, None)

    def _stop_unstarted(self, handle: WorkerHandle, exc: BaseException) -> Callable[[], Awaitable[None]]:
        """How to stop a server whose start failed: one whose engine failed or whose main
        process exited has nothing to shut down cleanly and is killed at once; any other
        gets the grace period."""
        reason = str(exc) if isinstance(exc, WorkerError) else "start interrupted"
        if isinstance(exc, EngineFailed) or not handle.alive():
            return lambda: self.servers.bury(handle, reason)
        return lambda: self.servers.stop(handle, "failed", reason)

    async def healthy(self, handle: WorkerHandle) -> bool:
        """True if the server is alive and answers /health within a few seconds."""
        if not handle.alive():
            return False
        try:
            response = await self.client.get(f"{handle.url}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def retire(self, handle: WorkerHandle, error: str) -> None:
        """A server failed (hung, stopped answering): a started one is stopped (its GPUs
        held until it has), a registered one takes no runs until it answers again."""
        await self._stop(handle, "failed", error)

    async def bury(self, handle: WorkerHandle, error: str) -> None:
        """A server exited on its own: what is left of its process group is stopped."""
        if handle.external:
            await self.registered.set_unavailable(handle, error)
            return
        await self._take_down(handle, lambda: self.servers.bury(handle, error))

    async def reap_dead(self) -> None:
        """Bury started servers that exited while idle."""
        for handle in list(self.workers.values()):
            if not handle.external and not handle.alive() and handle.busy_run is None:
                tail = await asyncio.to_thread(handle.tail)
                code = handle.process.returncode if handle.process is not None else None
                await self.bury(handle, f"exited with code {code}; last log lines:\n{tail}")

    async def _stop(self, handle: WorkerHandle, status: str, error: str) -> None:
        if handle.external:
            await self.registered.set_unavailable(handle, error)
            return
        await self._take_down(handle, lambda: self.servers.stop(handle, status, error))

    async def _take_down(self, handle: WorkerHandle, stop: Callable[[], Awaitable[None]]) -> None:
        """Stop a started server and return once its process group is gone; the stop goes
        on if the caller is cancelled meanwhile."""
        await asyncio.shield(self._taking_down(handle, stop))

    def _taking_down(self, handle: WorkerHandle, stop: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Start stopping a started server (once: a second call gets the first stop), holding
        it (and its GPUs and port) among the stopping ones until its process group is gone."""
        task = self._stops.get(handle.id)
        if task is not None:
            return task
        self.workers.pop(handle.id, None)
        self._stopping[handle.id] = handle

        async def stopping() -> None:
            await stop()

        task = asyncio.ensure_future(stopping())
        self._stops[handle.id] = task

        def stopped(done: asyncio.Task[None]) -> None:
            # Held until the stop is done, even when the run that asked is cancelled
            # meanwhile: the process group keeps its GPUs until it has exited.
            self._stopping.pop(handle.id, None)
            self._stops.pop(handle.id, None)
            if not done.cancelled() and done.exception() is not None:
                log.error("stopping worker %s failed", handle.id, exc_info=done.exception())

        task.add_done_callback(stopped)
        return task

    def server_of(self, run_id: str) -> str | None:
        """The id of the server the run holds (one starting for it, or the one it runs on);
        None while it holds none. From any thread: a read of the fleet's handles."""
        return next((h.id for h in list(self.workers.values()) if h.busy_run == run_id), None)

    def release(self, run_id: str, used: list[WorkerHandle]) -> None:
        """The run is over: the servers it used are idle again (and were used just now,
        for least-recently-used eviction), and it holds no GPUs."""
        self._starting.pop(run_id, None)
        self._drivers.pop(run_id, None)
        for handle in [*used, *self.workers.values()]:
            if handle.busy_run == run_id:
                handle.busy_run = None
                handle.last_used = time.monotonic()

    async def release_evicted(self, run_id: str, placement: Placement) -> None:
        """Servers set aside for a run that ended without stopping them: one whose stop
        began is waited out; one it never began to stop (the run failed or was cancelled
        before its server started) goes back to the fleet, idle and warm, as before the
        placement: a run that failed its checks costs no one a warm server."""
        for handle in placement.evict:
            if handle.id not in self._stopping:
                continue
            if handle.id in self._stops:
                try:
                    await self._stop(handle, "stopped", f"stopped to make room for run {run_id}")
                except BaseException:
                    log.exception("stopping worker %s failed", handle.id)
            elif handle.alive():
                self._stopping.pop(handle.id, None)
                self.workers[handle.id] = handle
            else:
                self._stopping.pop(handle.id, None)

    # ------------------------------------------------------------ a run's drivers

    def prepare_drivers(self) -> None:
        """A run is on its way: what its drivers need starts now, beside its server's start."""
        self.driver_pool.prepare()

    def drivers_for(self, run_id: str, spec: RunSpec, handle: WorkerHandle,
                    phase: str | None = None) -> LoadDrivers:
        """The load drivers of a run against its server (on the server's node, where the
        backend has nodes); ``phase``: see ``DriverBackend.drivers_for``."""
        drivers = self.driver_pool.drivers_for(run_id, spec, handle.url, handle.served_model,
                                               handle.vocab_size, self.settings.request_timeout_s,
                                               self.settings.driver_hang_s,
                                               node_id=(handle.node or {}).get("id"), phase=phase)
        self._drivers[run_id] = drivers
        return drivers

    # ------------------------------------------------------------ what runs where

    def cluster(self) -> dict[str, Any]:
        """The hosts servers run on, each with the servers and the runs' driver shards on
        it (``GET /api/cluster``). On the event loop: reads only what is held here."""
        nodes: dict[str, dict[str, Any]] = {}
        for node in self.servers.nodes():
            nodes[node["id"]] = {**node, "alive": True, "servers": [], "drivers": []}

        def on(node_id: str, address: str | None = None) -> dict[str, Any]:
            return nodes.setdefault(node_id, {"id": node_id, "address": address, "cpus": None,
                                              "gpus": None, "alive": False, "servers": [], "drivers": []})

        for handle in [*self.workers.values(), *self._stopping.values()]:
            if handle.external:
                continue
            # A cluster's server has no node until Ray has placed it.
            node = handle.node or ({"id": "local", "address": "127.0.0.1", "gpu_ids": handle.gpus}
                                   if handle.backend == "local" else {"id": "(not placed yet)"})
            on(node["id"], node.get("address"))["servers"].append({
                "id": handle.id, "model": handle.served_model, "url": handle.url, "ready": handle.ready,
                "run_id": handle.busy_run, "stopping": handle.id in self._stopping,
                "gpu_ids": node.get("gpu_ids") or [], "max_model_len": handle.max_model_len,
            })
        for run_id, drivers in list(self._drivers.items()):
            for shard in drivers.placement:
                on(shard["node_id"], shard.get("node_ip"))["drivers"].append({"run_id": run_id, **shard})
        backend = "ray" if self.settings.ray_address else "local"
        return {"backend": backend, "nodes": list(nodes.values())}


def _row(handle: WorkerHandle, stopping: bool) -> WorkerRow:
    return WorkerRow(
        id=handle.id, key=handle.key, external=handle.external, ready=handle.ready,
        busy=handle.busy_run is not None, gpus=tuple(handle.gpus),
        last_used=handle.last_used, stopping=stopping, max_model_len=handle.max_model_len,
        max_len_why=handle.max_len_why(),
    )
