"""vLLM servers as local processes: start, wait until healthy, stop, and clean up after a
crash. The fleet (``service.control.fleet``) holds the handles; this module does the
process work.

Each worker leads a process group of its own (in the service's session: see
``service.control.procs``) so that stopping it reaches the engine core and worker processes
vLLM spawns. Health is polled with a deadline while watching for early exit and for the
log lines that say the engine failed (``service.control.startup_errors``: vLLM's API server
may hang on a dead engine rather than exit). A failed start's message begins with the
exception the engine raised and what to change, then the last lines of the worker's log.

A start that fails or is interrupted leaves its worker to the fleet, which stops it
(``Fleet.server_for``): the fleet is the one that holds it until its process group is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine

from service.control import provenance
from service.control.cpu_binding import binding_env, parse_binding_log
from service.control.handles import LAST_WORDS_WAIT_S, EngineFailed, WorkerError, WorkerHandle, add_worker_row
from service.control.procs import (
    ROOT_CAUSE_WAIT_S,
    STARTING_LINE_S,
    WORKER_ENV,
    LogFollower,
    NoFreePort,
    drain_to_capped_file,
    free_port,
    is_our_worker,
    kill_group,
    log_head,
    remove_rpc_dir,
    rpc_dir,
    start_failure,
    stop_process_group,
)
from service.control.startup_errors import (
    clock,
    engine_failed,
    startup_phase,
)
from service.control.vllm_cli import (
    answers_as,
    kv_capacity,
    model_vocab_size,
    served_max_model_len,
    worker_argv,
)
from service.core.ids import new_id, utcnow
from service.core.spec import RunSpec
from service.settings import Settings
from service.storage import workers
from service.storage.tables import Worker
from service.storage.workers import hash_token

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
# A starting server's log is read this often, and its /health asked every HEALTH_POLL_S
# (each ask may take its whole timeout: vLLM binds its port long before it answers).
LOG_POLL_S = 0.25
HEALTH_POLL_S = 0.5
HEALTH_TIMEOUT_S = 2.0


class LocalServers:
    """Starts and stops the vLLM worker processes of this service."""

    def __init__(self, settings: Settings, engine: Engine, client: httpx.AsyncClient) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.tokens: dict[str, str] = {}
        # Ports chosen for servers whose process is not holding them yet: two starts at once
        # must not choose the same one.
        self._reserved_ports: set[int] = set()

    async def start(self, spec: RunSpec, gpus: list[str], hold: Callable[[WorkerHandle], None],
                    taken: set[int]) -> WorkerHandle:
        """Start a worker for ``spec``'s model and engine and wait until it is healthy.
        ``hold`` gets its handle as soon as its process exists; ``taken``: ports of the
        servers held already."""
        worker_id = new_id("w")
        token = secrets.token_urlsafe(32)
        try:
            port = free_port(taken | self._reserved_ports, self.settings.server_port_range)
        except NoFreePort as exc:
            raise WorkerError(str(exc)) from None
        self._reserved_ports.add(port)
        try:
            return await self._start(spec, gpus, hold, worker_id, token, port)
        finally:
            self._reserved_ports.discard(port)

    async def _start(self, spec: RunSpec, gpus: list[str], hold: Callable[[WorkerHandle], None],
                     worker_id: str, token: str, port: int) -> WorkerHandle:
        argv, model_path = worker_argv(self.settings, spec, port, token, gpus)
        self.settings.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.settings.logs_dir / f"{worker_id}.log"
        url = f"http://127.0.0.1:{port}"
        env = dict(os.environ)
        env[WORKER_ENV] = worker_id
        env["VLLM_RPC_BASE_PATH"] = str(rpc_dir(worker_id))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        cpu_binding: dict[str, Any] | None = None
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            # GPU ids are NVML's (and nvidia-smi's) numbers, in PCI bus order; CUDA's own
            # default puts the fastest GPU first. A site that chose an order keeps it.
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        else:
            # The same thread layout whatever the worker loads: see service/control/cpu_binding.py.
            chosen = binding_env(spec.engine.tensor_parallel_size, os.environ)
            env.update(chosen)
            cpu_binding = {"env": chosen}
        await add_worker_row(self.engine, Worker(
            id=worker_id,
            key=spec.worker_key(),
            model=spec.model,
            engine=spec.engine.model_dump(),
            url=url,
            port=port,
            token_hash=hash_token(token),
            log_path=str(log_path),
            gpus=",".join(gpus),
            cpu_binding=cpu_binding,
            provenance={"launch": provenance.launch(argv, env, token)},
        ))
        log.info("starting vLLM server %s for %s on port %s (log %s)", worker_id, spec.model, port, log_path)
        # Made here, with no await before the process holds it: a run cancelled at an
        # await above leaves no directory behind.
        rpc_dir(worker_id).mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.settings.data_dir),
                # Its own process group (stopped as one), in the service's session: see
                # ``service.control.procs.SAME_SESSION``.
                process_group=0,
            )
        except BaseException:
            remove_rpc_dir(worker_id)
            raise
        assert process.stdout is not None
        copier = threading.Thread(
            target=drain_to_capped_file,
            args=(process.stdout, log_path, self.settings.worker_log_max_bytes),
            name=f"log-{worker_id}",
            daemon=True,
        )
        copier.start()
        # No await from here until the handle is held: a run cancelled in between would
        # leave this process running with nothing to stop it.
        handle = WorkerHandle(
            id=worker_id,
            key=spec.worker_key(),
            url=url,
            port=port,
            served_model=spec.model,
            process=process,
            log_path=log_path,
            log_copier=copier,
            gpus=gpus,
            vocab_size=model_vocab_size(model_path),
            cpu_binding=cpu_binding,
            auto_fit=spec.engine.max_model_len is None,
        )
        hold(handle)
        self.tokens[worker_id] = token
        # From here a failure leaves the worker to the fleet, which holds it: it stops it.
        await asyncio.to_thread(workers.update_worker, self.engine, worker_id, pid=process.pid)
        await self._wait_healthy(handle)
        handle.kv_tokens = await kv_capacity(self.client, handle.url)
        handle.max_model_len = await served_max_model_len(self.client, handle.url, spec.model)
        if cpu_binding is not None:
            # What vLLM made of the variables, as its worker logged it while starting.
            cores = parse_binding_log(await asyncio.to_thread(log_head, log_path))
            handle.cpu_binding = cpu_binding = {**cpu_binding, **(cores or {})}
        await asyncio.to_thread(workers.update_worker, self.engine, worker_id, status="ready",
                                ready_at=utcnow(), kv_tokens=handle.kv_tokens,
                                max_model_len=handle.max_model_len, cpu_binding=cpu_binding)
        # Ready only now, with no await before the caller takes it for its run: a ready
        # worker that is not busy is idle to placement, which would give it to a queued
        # run of the same kind while the run it was started for is still waiting for it.
        handle.ready = True
        log.info("vLLM server %s ready at %s for run %s (%s, max_model_len %s)", worker_id, url,
                 handle.busy_run, spec.model, handle.max_model_len)
        return handle

    async def _wait_healthy(self, handle: WorkerHandle) -> None:
        """Return once the server answers /health. Raise ``WorkerError`` if it exits first
        or is not healthy by the start timeout, and ``EngineFailed`` as soon as its log says
        its engine failed (its API server may live on, never to answer)."""
        process = handle.process
        assert process is not None, "only started workers are waited for"
        timeout = self.settings.worker_start_timeout_s
        deadline = time.monotonic() + timeout
        follower = LogFollower(handle.log_path)
        failed_at: float | None = None
        probe: asyncio.Task[bool] | None = None
        next_probe = 0.0
        began = time.monotonic()
        phase: str | None = None
        next_line = began + STARTING_LINE_S
        try:
            while True:
                code = process.poll()
                if code is not None:
                    raise WorkerError(await self._start_failure(
                        handle, f"vLLM server exited with code {code} before it became healthy"))
                lines = await asyncio.to_thread(follower.new_lines)
                phase = startup_phase(lines.splitlines(), phase)
                if time.monotonic() >= next_line:
                    # The service's terminal says what a long start is doing, not only that it waits.
                    next_line += STARTING_LINE_S
                    log.info("starting vLLM server %s for run %s: %s, %s", handle.id, handle.busy_run,
                             clock(time.monotonic() - began), phase or "starting")
                if failed_at is None and engine_failed(lines):
                    failed_at = time.monotonic()
                    log.warning("worker %s: its log says its engine failed to start", handle.id)
                if failed_at is not None:
                    message, caused = await asyncio.to_thread(
                        start_failure, handle.log_path,
                        "vLLM server's engine failed to start (the server was stopped)")
                    if caused or time.monotonic() - failed_at >= ROOT_CAUSE_WAIT_S:
                        raise EngineFailed(message)
                if probe is not None and probe.done():
                    # It still runs: it answered, not a program before it on its port.
                    if probe.result() and process.poll() is None:
                        return
                    probe = None
                now = time.monotonic()
                if probe is None and now >= next_probe:
                    probe = asyncio.create_task(
                        answers_as(self.client, handle.url, handle.served_model, HEALTH_TIMEOUT_S))
                    next_probe = now + HEALTH_POLL_S
                if now > deadline:
                    raise WorkerError(await self._start_failure(
                        handle, f"vLLM server not healthy after {timeout:.0f} s"))
                await asyncio.sleep(LOG_POLL_S)
        finally:
            if probe is not None:
                probe.cancel()

    async def _start_failure(self, handle: WorkerHandle, what: str) -> str:
        """The message of a start that failed: its root cause from the log first."""

        def read() -> str:
            if handle.log_copier is not None and not handle.alive():
                # Its last words may still be in the pipe: they are often the cause.
                handle.log_copier.join(timeout=LAST_WORDS_WAIT_S)
            return start_failure(handle.log_path, what)[0]

        return await asyncio.to_thread(read)

    async def stop(self, handle: WorkerHandle, status: str = "stopped", error: str | None = None) -> None:
        """Stop the worker's whole process group: SIGTERM, then SIGKILL after the grace period."""
        assert isinstance(handle.process, subprocess.Popen), "only workers started here are stopped here"
        self.tokens.pop(handle.id, None)
        await asyncio.to_thread(stop_process_group, handle.process, self.settings.worker_stop_grace_s)
        await asyncio.to_thread(remove_rpc_dir, handle.id)
        await asyncio.to_thread(workers.update_worker, self.engine, handle.id, status=status,
                                stopped_at=utcnow(), error=error)
        log.info("vLLM server %s %s%s", handle.id, status, f": {error}" if error else "")

    async def bury(self, handle: WorkerHandle, error: str) -> None:
        """Record that a worker died on its own; its group is still stopped."""
        assert isinstance(handle.process, subprocess.Popen), "only workers started here are buried here"
        self.tokens.pop(handle.id, None)

        def bury(process: subprocess.Popen[bytes]) -> None:
            stop_process_group(process, 0)
            remove_rpc_dir(handle.id)
            workers.update_worker(self.engine, handle.id, status="failed", stopped_at=utcnow(), error=error)

        await asyncio.to_thread(bury, handle.process)

    def slots(self) -> None:
        """Placement uses this machine's GPUs (``Settings.gpu_ids``)."""
        return None

    def nodes(self) -> list[dict[str, Any]]:
        """This machine."""
        gpus = self.settings.gpu_ids()
        return [{"id": "local", "address": "127.0.0.1", "cpus": float(os.cpu_count() or 1),
                 "gpus": float(len(gpus))}]

    def open(self) -> None:
        """Nothing to watch: processes here are polled directly."""

    async def close(self) -> None:
        """Nothing started by ``open``."""

    def reap_orphans(self) -> int:
        """After a crash: stop process groups of workers a previous service left behind.
        Blocking (database and process work): call it from a thread."""
        stopped = 0
        for worker in workers.local_workers_alive(self.engine):
            if worker.pid is not None and is_our_worker(worker.pid, worker.id):
                log.warning("stopping orphaned worker %s (pid %s)", worker.id, worker.pid)
                kill_group(worker.pid, self.settings.worker_stop_grace_s)
                stopped += 1
            remove_rpc_dir(worker.id)
            workers.update_worker(self.engine, worker.id, status="stopped", stopped_at=utcnow(),
                                error="service restarted; worker stopped")
        return stopped


