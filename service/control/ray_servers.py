"""vLLM servers as Ray actors: the server backend for a Ray cluster.

Imported only when ``DECODEBENCH_RAY_ADDRESS`` is set (``service.app``); nothing else in
the service imports Ray. The service keeps deciding which kind of server a run needs,
when to reuse one and when to stop one (``service.control.placement``, on *slots*: one
per GPU of the cluster, or per ``ray_server_cpus`` CPUs on a cluster without GPUs); Ray
decides the node.

Each server is a detached, named actor (``server-<worker id>`` in the service's
namespace, ``ray_namespace``) holding ``tensor_parallel_size`` GPUs (or CPUs) on the
node Ray picked. The actor (``ServerHost``, in ``service.control.ray_server_host``: the
code that runs on the node) starts vLLM there; the service reaches the server over HTTP
like any other. Named and detached so that a service that crashed finds them on its next
start and stops them (``reap_orphans``): nothing it started is left running on the
cluster. This module is the service's side.

Liveness is watched from the service every ``WATCH_S``: an actor that died (its node
left the cluster, its process was killed) makes its server's ``poll`` return an exit
code, with the reason (``WorkerHandle.gone``) naming the node, and the run on it fails
as with a crashed local worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.exceptions import GetTimeoutError, RayError
from sqlalchemy import Engine

from service.control import provenance
from service.control.cpu_binding import parse_binding_log
from service.control.energy import EnergyMeter, result_of
from service.control.handles import EngineFailed, WorkerError, WorkerHandle, add_worker_row
from service.control.procs import ROOT_CAUSE_WAIT_S, STARTING_LINE_S
from service.control.ray_server_host import ServerHost
from service.control.startup_errors import clock
from service.control.vllm_cli import (
    answers_as,
    kv_capacity,
    model_vocab_size,
    served_max_model_len,
    worker_argv,
)
from service.core.ids import new_id, utcnow
from service.core.shapes import ensure_bundled, is_bundled
from service.core.spec import RunSpec
from service.settings import Settings
from service.storage import workers
from service.storage.tables import Worker
from service.storage.workers import hash_token

log = logging.getLogger(__name__)

SERVER_PREFIX = "server-"
# Names of the actors this service makes in its namespace; on a restart every one of them
# is from an earlier life (driver hosts: ``service.load.ray_drivers``).
OUR_PREFIXES = (SERVER_PREFIX, "drivers-")
# How often the service asks every server actor whether its process still runs.
WATCH_S = 0.5
# How long one question to an actor may take before the answer counts as lost.
ASK_TIMEOUT_S = 10.0
# The exit code a server gets when its actor is gone without saying one.
LOST = -int(signal.SIGKILL)
# How many times a server actor that died before it ran is placed again.
PLACE_TRIES = 3
# How long the service waits for the cluster's address to answer at start.
CONNECT_TIMEOUT_S = 5.0
class RayProcess:
    """A server actor as the fleet sees a process: ``poll`` answers from the last look
    (``RayServers.watch``), never by asking the cluster."""

    def __init__(self, actor: Any, worker_id: str) -> None:
        self.actor = actor
        self.worker_id = worker_id
        self.pid = 0
        self.returncode: int | None = None
        self.node: dict[str, Any] = {}
        self.gone: str | None = None
        # The actor is gone with the process (its node left, or it died): nothing to ask it.
        self.lost = False
        self.last_tail = ""
        self._read_after_gone = False

    def poll(self) -> int | None:
        return self.returncode

    def where(self) -> str:
        return f"Ray node {self.node.get('id')} ({self.node.get('address')})"

    def ended(self, code: int, why: str | None = None) -> None:
        """The server's process ended (``why``: more than its exit code is known). The
        reason always names the node: a node going away often shows first as its
        processes ending, before the cluster has marked the node dead."""
        if self.returncode is None:
            self.returncode = code
            self.gone = why or f"on {self.where()}, exit code {code}"

    def energy_meter(self) -> EnergyMeter:
        """A meter that reads beside the server, on its node (``EnergyMeter.for_server``)."""
        return NodeMeter(self)

    def tail(self) -> str:
        """The server's last log lines, read on its node (blocking; from a thread). Once the
        process has ended they are read once more, unless read already: the actor outlives
        its server, and a server that died starting has said why only in its log."""
        if self.gone is None or not self._read_after_gone:
            self._read_after_gone = self.gone is not None
            with contextlib.suppress(RayError, GetTimeoutError):
                self.last_tail = str(ray.get(self.actor.tail.remote(), timeout=ASK_TIMEOUT_S))
        if self.gone is not None:
            return f"({self.gone}; the last lines read from it:)\n{self.last_tail}"
        return self.last_tail


class NodeMeter(EnergyMeter):
    """The energy and clocks of a server on a Ray node, read by its actor on that node
    (``ServerHost.energy_start``, ``energy_stop``) and sent back once the run's load ends."""

    def __init__(self, process: RayProcess) -> None:
        super().__init__(None, None)
        self.process = process
        self._state: dict[str, Any] | None = None

    def start(self) -> None:
        # Returns at once: the actor starts its reading thread on its node.
        self.process.actor.energy_start.remote(list(self.process.node.get("gpu_ids") or []))

    def stop(self) -> None:
        """Stop the node's meter and fetch what it read (blocking: from a thread)."""
        try:
            self._state = dict(ray.get(self.process.actor.energy_stop.remote(), timeout=ASK_TIMEOUT_S))
        except (RayError, GetTimeoutError) as exc:
            self._state = EnergyMeter(None, f"the readings on {self.process.where()} were lost: "
                                            f"{type(exc).__name__}").state()

    def result(self, output_tokens: int) -> dict[str, Any]:
        state = self._state or EnergyMeter(None, "the meter on the node was never stopped").state()
        block = result_of(state, output_tokens)
        block["node"] = self.process.node.get("address")
        if not block.get("available") and block.get("why"):
            block["why"] = f"on {self.process.where()}: {block['why']}"
        return block


def unreachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why nothing answers at a ``HOST:PORT`` or ``ray://HOST:PORT`` address (a TCP
    connect), or None. ``ray.init`` itself retries an address where nothing listens for
    minutes; this says it in seconds. (``auto`` is Ray's to find: it fails fast.)"""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"nothing answers at {host}:{port} ({exc.strerror or type(exc).__name__})"


def connect(settings: Settings) -> None:
    """Join the cluster at ``ray_address`` in the service's namespace, once. Never starts
    a Ray head (nor its dashboard): ``ray.init`` with an address only connects. Raises
    ``ConnectionError`` (with the reason) when the cluster cannot be reached."""
    if ray.is_initialized():
        return
    assert settings.ray_address
    if (why := unreachable(settings.ray_address)) is not None:
        raise ConnectionError(f"cannot reach the Ray cluster at {settings.ray_address}: {why}")
    try:
        ray.init(address=settings.ray_address, namespace=settings.ray_namespace,
                 log_to_driver=False, logging_level=logging.WARNING)
    except Exception as exc:  # Ray raises several types for one cause: say it in one line
        first = (str(exc).splitlines() or [""])[0]
        raise ConnectionError(f"cannot reach the Ray cluster at {settings.ray_address}: "
                              f"{type(exc).__name__}: {first}") from exc


def cluster_nodes() -> list[dict[str, Any]]:
    """The nodes Ray reports that are alive: id, address, CPUs, GPUs (blocking)."""
    nodes = []
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if not node.get("Alive"):
            continue
        resources = node.get("Resources") or {}
        nodes.append({"id": node["NodeID"], "address": node.get("NodeManagerAddress"),
                      "cpus": resources.get("CPU", 0.0), "gpus": resources.get("GPU", 0.0)})
    return nodes


class RayServers:
    """Starts and stops the vLLM servers of this service as actors on a Ray cluster."""

    def __init__(self, settings: Settings, engine: Engine, client: httpx.AsyncClient) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.tokens: dict[str, str] = {}
        self._procs: dict[str, RayProcess] = {}
        # Ports chosen for servers that may not hold them yet (``_start``), and the lock that
        # makes a choice and its reservation one step: the choice is asked of a node, an await.
        self._reserved: set[int] = set()
        self._choosing = asyncio.Lock()
        self._nodes: list[dict[str, Any]] = []
        self._watcher: asyncio.Task[None] | None = None
        connect(settings)

    # ------------------------------------------------------------ the cluster

    def nodes(self) -> list[dict[str, Any]]:
        """The alive nodes as last seen (``refresh``)."""
        return list(self._nodes)

    def refresh(self) -> None:
        """Look at the cluster's nodes again (blocking: from a thread)."""
        self._nodes = cluster_nodes()

    def slots(self) -> list[str]:
        """What placement hands out: one slot per GPU of the cluster's alive nodes, or on
        a cluster without GPUs one per ``ray_server_cpus`` CPUs."""
        gpus = sum(int(n["gpus"]) for n in self._nodes)
        if gpus:
            return [f"gpu{k}" for k in range(gpus)]
        cpus = sum(float(n["cpus"]) for n in self._nodes)
        return [f"cpu{k}" for k in range(int(cpus // self.settings.ray_server_cpus))]

    def _has_gpus(self) -> bool:
        return any(n["gpus"] for n in self._nodes)

    # ------------------------------------------------------------ a server's life

    async def start(self, spec: RunSpec, gpus: list[str], hold: Callable[[WorkerHandle], None],
                    taken: set[int]) -> WorkerHandle:
        """Start a server actor for ``spec`` (``gpus``: the slots placement gave the run;
        Ray picks the node and the GPUs) and wait until it is healthy."""
        self._ensure_watching()
        worker_id = new_id("w")
        token = secrets.token_urlsafe(32)
        on_gpu = self._has_gpus()
        process = RayProcess(self._actor(spec, worker_id, on_gpu, 1), worker_id)
        self._procs[worker_id] = process
        # Held before any await: a run cancelled while its server starts leaves nothing
        # on the cluster that nobody holds. The URL is known once Ray has placed it.
        handle = WorkerHandle(
            id=worker_id, key=spec.worker_key(), url="", port=0, served_model=spec.model,
            process=process, log_path=Path(os.devnull), gpus=gpus, backend="ray",
            remote_tail=process.tail, auto_fit=spec.engine.max_model_len is None,
        )
        hold(handle)
        self.tokens[worker_id] = token
        # From here a failure leaves the server to the fleet, which holds it: it stops it.
        await self._start(spec, handle, process, token, on_gpu, taken)
        handle.ready = True
        log.info("worker %s ready at %s on node %s", worker_id, handle.url, (handle.node or {}).get("id"))
        return handle

    def _actor(self, spec: RunSpec, worker_id: str, on_gpu: bool, attempt: int) -> Any:
        """A new server actor; Ray places it on a node with the GPUs (or CPUs) it asks for."""
        tp = spec.engine.tensor_parallel_size
        name = f"{SERVER_PREFIX}{worker_id}" + (f".{attempt}" if attempt > 1 else "")
        remote = ray.remote(ServerHost).options(
            name=name, namespace=self.settings.ray_namespace, lifetime="detached", max_restarts=0,
            max_concurrency=1, num_gpus=tp if on_gpu else 0,
            num_cpus=0 if on_gpu else self.settings.ray_server_cpus * tp,
        )
        return remote.remote(worker_id, str(self.settings.data_dir.resolve()))

    async def _placed(self, spec: RunSpec, process: RayProcess, on_gpu: bool) -> dict[str, Any]:
        """Where the server's actor landed. An actor that died before it ran (Ray placed it
        on a node that was dying, before the cluster knew) is made again, up to
        ``PLACE_TRIES`` times."""
        timeout = self.settings.worker_start_timeout_s
        for attempt in range(1, PLACE_TRIES + 1):
            if attempt > 1:
                process.actor = self._actor(spec, process.worker_id, on_gpu, attempt)
            try:
                return dict(await self._ask(process.actor.where.remote(), timeout))
            except TimeoutError:
                raise WorkerError(
                    f"no Ray node took a server with {spec.engine.tensor_parallel_size} "
                    f"{'GPU' if on_gpu else 'CPU slot'}(s) within {timeout:.0f} s"
                ) from None
            except RayError as exc:
                log.warning("worker %s: its actor died before it ran (%s); placing it again",
                            process.worker_id, type(exc).__name__)
                with contextlib.suppress(RayError, ValueError):
                    ray.kill(process.actor)
                await asyncio.sleep(WATCH_S)
        raise WorkerError(f"Ray could not place the server: its actor died {PLACE_TRIES} times before it ran")

    async def _ask(self, ref: Any, timeout: float = ASK_TIMEOUT_S) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)

    async def _start(self, spec: RunSpec, handle: WorkerHandle, process: RayProcess, token: str,
                     on_gpu: bool, taken: set[int]) -> None:
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        where = await self._placed(spec, process, on_gpu)
        actor = process.actor
        node = {"id": where["id"], "address": where["address"], "gpu_ids": where["gpu_ids"]}
        process.node = handle.node = node
        host = self.settings.ray_server_host or where["address"]
        # Without DECODEBENCH_SERVER_PORTS the node's system picks the port. With a range,
        # the first free one of it, less the ports of the servers held already and of those
        # starting, which may not have bound theirs yet (``taken``: on any node; skipping
        # more of the range than needed is harmless).
        ports = self.settings.server_port_range
        chosen = None if ports is None else (ports.start, ports.stop - 1)
        # Two starts at once (a sweep's servers, one per GPU) would otherwise both be told the
        # range's first free port, and the second server's bind fail ("address already in use").
        async with self._choosing:
            port = int(await self._ask(actor.free_port.remote(host, chosen, sorted(taken | self._reserved))))
            self._reserved.add(port)
        try:
            await self._start_on(spec, handle, process, token, on_gpu, where, host, port, deadline)
        finally:
            self._reserved.discard(port)

    async def _start_on(self, spec: RunSpec, handle: WorkerHandle, process: RayProcess, token: str,
                        on_gpu: bool, where: dict[str, Any], host: str, port: int,
                        deadline: float) -> None:
        actor, node = process.actor, process.node
        argv, model_path = worker_argv(self.settings, spec, port, token, handle.gpus if on_gpu else [],
                                       host=host, models_dir=Path(where["models_dir"]))
        handle.port = port
        handle.url = f"http://{host}:{port}"
        # The vocabulary is read here: the service's copy of the tiny model, or the model's
        # config in this host's cache (None when it is not there: prompts then stay in
        # the range every tokenizer has).
        bundled = is_bundled(spec.model)
        handle.vocab_size = model_vocab_size(
            str(ensure_bundled(self.settings.models_dir, spec.model, spec.engine.num_layers)) if bundled
            else model_path)
        env = {k: v for k, v in os.environ.items() if k.startswith(self._forwarded())}
        await add_worker_row(self.engine, Worker(
            id=handle.id, key=handle.key, model=spec.model, engine=spec.engine.model_dump(),
            url=handle.url, port=port, token_hash=hash_token(token), log_path="", backend="ray",
            node=node, gpus=",".join(node["gpu_ids"]),
            provenance={"launch": provenance.launch(argv, env, token)},
        ))
        log.info("starting worker %s for %s on node %s (%s)", handle.id, spec.model, node["id"],
                 node["address"])
        started = await self._ask(actor.start.remote(
            argv, env, spec.engine.tensor_parallel_size, not on_gpu, self.settings.worker_log_max_bytes,
            (spec.model, spec.engine.num_layers) if bundled else None))
        process.pid = int(started["pid"])
        handle.cpu_binding = started["cpu_binding"]
        await asyncio.to_thread(workers.update_worker, self.engine, handle.id, pid=process.pid,
                                log_path=f"{node['address']}:{started['log_path']}")
        await self._wait_healthy(handle, process, deadline)
        handle.kv_tokens = await kv_capacity(self.client, handle.url)
        handle.max_model_len = await served_max_model_len(self.client, handle.url, spec.model)
        if handle.cpu_binding is not None:
            head = await self._ask(actor.head.remote())
            handle.cpu_binding = {**handle.cpu_binding, **(parse_binding_log(head) or {})}
        await asyncio.to_thread(workers.update_worker, self.engine, handle.id, status="ready",
                                ready_at=utcnow(), kv_tokens=handle.kv_tokens,
                                max_model_len=handle.max_model_len, cpu_binding=handle.cpu_binding)

    def _forwarded(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.settings.ray_forward_env.split(",") if p.strip())

    async def _wait_healthy(self, handle: WorkerHandle, process: RayProcess, deadline: float) -> None:
        """Return once the server answers /health. As for a server started here
        (``LocalServers._wait_healthy``), its log is read on its node while it starts:
        ``EngineFailed`` as soon as that says its engine failed (its API server may hang on
        the dead engine until the start timeout), and every failure leads with the root
        cause the log names and what to change."""
        began = time.monotonic()
        next_line = began + STARTING_LINE_S
        failed_at: float | None = None
        where = (handle.node or {}).get("address")
        while True:
            code = process.poll()
            if code is not None:
                gone = f" ({process.gone})" if process.gone else ""
                raise WorkerError(await self._start_failure(
                    process, f"vLLM server exited with code {code} before it became healthy{gone}"))
            with contextlib.suppress(RayError, TimeoutError):
                state = await self._ask(process.actor.starting.remote())
                if state["engine_failed"] and failed_at is None:
                    failed_at = time.monotonic()
                    log.warning("worker %s: its log says its engine failed to start", handle.id)
                if time.monotonic() >= next_line:
                    next_line += STARTING_LINE_S
                    log.info("starting vLLM server %s for run %s on node %s: %s, %s", handle.id,
                             handle.busy_run, where, clock(time.monotonic() - began),
                             state["phase"] or "starting")
            if failed_at is not None:
                message, caused = await self._ask(process.actor.failure.remote(
                    f"vLLM server's engine failed to start on node {where} (the server was stopped)"))
                if caused or time.monotonic() - failed_at >= ROOT_CAUSE_WAIT_S:
                    raise EngineFailed(message)
            # The server itself, not another program on its port (``answers_as``).
            if await answers_as(self.client, handle.url, handle.served_model, 2.0) and process.poll() is None:
                return
            if time.monotonic() > deadline:
                raise WorkerError(await self._start_failure(
                    process, f"vLLM server not healthy after {self.settings.worker_start_timeout_s:.0f} s "
                             f"on node {where}"))
            await asyncio.sleep(0.5)

    async def _start_failure(self, process: RayProcess, what: str) -> str:
        """A failed start's message read on the server's node, root cause first; where the
        node cannot be asked (it is gone), its last log lines as last read."""
        try:
            message, _ = await self._ask(process.actor.failure.remote(what))
            return str(message)
        except (RayError, TimeoutError):
            tail = await asyncio.to_thread(process.tail)
            return f"{what}; last log lines:\n{tail}"

    async def stop(self, handle: WorkerHandle, status: str = "stopped", error: str | None = None) -> None:
        """Stop the server's process group on its node, then its actor. A server whose
        process ended on its own is stopped too: its group may hold children still, and the
        actor removes its sockets' directory."""
        self.tokens.pop(handle.id, None)
        process = self._procs.pop(handle.id, None)
        if process is not None:
            if not process.lost:
                with contextlib.suppress(RayError, TimeoutError):
                    await self._ask(process.actor.stop.remote(self.settings.worker_stop_grace_s),
                                    self.settings.worker_stop_grace_s + ASK_TIMEOUT_S)
            with contextlib.suppress(RayError, ValueError):
                ray.kill(process.actor)
            process.ended(0, "stopped by the service")
        await asyncio.to_thread(workers.update_worker, self.engine, handle.id, status=status,
                                stopped_at=utcnow(), error=error)
        log.info("worker %s %s", handle.id, status)

    async def bury(self, handle: WorkerHandle, error: str) -> None:
        """The server ended on its own (or its node did): stop what is left, record why."""
        await self.stop(handle, status="failed", error=f"{error}{handle.ended_why()}")

    def reap_orphans(self) -> int:
        """After a crash of the service: stop every actor a previous life left in our
        namespace (servers with their process groups, driver hosts), and close their rows
        (blocking)."""
        stopped = 0
        for name in ray.util.list_named_actors(all_namespaces=False):
            if not name.startswith(OUR_PREFIXES):
                continue
            try:
                actor = ray.get_actor(name, namespace=self.settings.ray_namespace)
            except ValueError:
                continue
            if name.startswith(SERVER_PREFIX):
                with contextlib.suppress(RayError, GetTimeoutError):
                    ray.get(actor.stop.remote(self.settings.worker_stop_grace_s),
                            timeout=self.settings.worker_stop_grace_s + ASK_TIMEOUT_S)
            with contextlib.suppress(RayError, ValueError):
                ray.kill(actor)
            log.warning("stopped actor %s left by an earlier run of the service", name)
            stopped += 1
        for worker in workers.local_workers_alive(self.engine, backend="ray"):
            workers.update_worker(self.engine, worker.id, status="stopped", stopped_at=utcnow(),
                                  error="service restarted; worker stopped")
        self.refresh()
        return stopped

    def open(self) -> None:
        """Start watching the cluster (inside the event loop)."""
        self._ensure_watching()

    async def close(self) -> None:
        """Stop watching (the fleet has stopped the servers)."""
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)

    # ------------------------------------------------------------ watching

    def _ensure_watching(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self.watch())

    async def watch(self) -> None:
        """Every ``WATCH_S``: the nodes, and whether each server's process still runs. An
        actor whose node left the cluster, or that died, ends its server's process."""
        while True:
            try:
                await asyncio.to_thread(self.refresh)
                alive = {n["id"] for n in self._nodes}
                procs = [p for p in self._procs.values() if p.returncode is None and p.pid]
                futures: list[Future[Any]] = [p.actor.poll.remote().future() for p in procs]
                for process, future in zip(procs, futures, strict=True):
                    if process.node.get("id") not in alive:
                        process.lost = True
                        process.ended(LOST, f"its {process.where()} left the cluster")
                        continue
                    try:
                        code = await asyncio.wait_for(asyncio.wrap_future(future), ASK_TIMEOUT_S)
                    except (RayError, TimeoutError) as exc:
                        process.lost = True
                        process.ended(LOST, f"its actor on {process.where()} was lost ({type(exc).__name__})")
                        continue
                    if code is not None:
                        process.ended(int(code))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watching the Ray servers failed; trying again")
            await asyncio.sleep(WATCH_S)
