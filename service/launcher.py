"""vLLM worker processes: start, wait until healthy, stop, and clean up after a crash.

Each worker is a child process group (``start_new_session``) so that stopping it
reaches the engine core and worker processes vLLM spawns. Health is polled with a
deadline while watching for early exit, and a failure carries the last lines of
the worker's log file so the user sees why.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import Engine, update
from sqlmodel import Session, col, select

from service.cpu_binding import binding_env, parse_binding_log
from service.db import write_session
from service.errors import Conflict, NotFound
from service.models import (
    EngineSpec,
    FillSpec,
    RunSpec,
    Worker,
    WorkerRegister,
    new_id,
    utcnow,
)
from service.settings import Settings
from service.tinymodel import TINY_MODEL_NAME, VOCAB_SIZE, ensure_tiny_model

log = logging.getLogger(__name__)

# Environment variable that marks a process as ours, so that after a crash we only
# ever stop process groups this service started.
WORKER_ENV = "DECODEBENCH_WORKER_ID"
LOG_TAIL_LINES = 40
PROBE_TIMEOUT_S = 5.0
# A healthy registered server's last_seen_at is written at most this often.
LAST_SEEN_EVERY_S = 30.0
_LABEL = re.compile(r'(\w+)="([^"]*)"')
REPO_ROOT = Path(__file__).resolve().parents[1]


class WorkerError(Exception):
    """A worker failed to start or died; the message carries its log tail."""


def hash_token(token: str) -> str:
    """The stored form of a worker token."""
    return hashlib.sha256(token.encode()).hexdigest()


def log_head(path: Path, max_bytes: int = 1 << 20) -> str:
    """The first ``max_bytes`` of a log file (empty if missing)."""
    try:
        with path.open("rb") as f:
            return f.read(max_bytes).decode("utf-8", errors="replace")
    except OSError:
        return ""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (empty if missing)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


@dataclass
class WorkerHandle:
    """A vLLM server runs can be placed on: a process this service owns, or a registered
    server that runs elsewhere (``process`` is None)."""

    id: str
    key: str
    url: str
    port: int
    served_model: str
    process: subprocess.Popen[bytes] | None
    log_path: Path
    gpus: list[str] = field(default_factory=list)
    vocab_size: int | None = None
    # The run using this worker now (one at a time, so runs never disturb each other).
    busy_run: str | None = None
    last_used: float = field(default_factory=time.monotonic)
    # Healthy at least once: until then no run may be placed on it.
    ready: bool = False
    # Tokens the server's KV cache holds, as it reports on /metrics (None if it does not say).
    kv_tokens: int | None = None
    # CPU workers: the binding variables it was started with and the cores vLLM reports.
    cpu_binding: dict[str, Any] | None = None
    # Registered servers: the last probe's complaint, and when last_seen_at was last written.
    last_problem: str | None = None
    seen_written: float = 0.0

    @property
    def external(self) -> bool:
        """True for a registered server this service did not start."""
        return self.process is None

    def alive(self) -> bool:
        """True while the worker's main process has not exited. A registered server has no
        process here; whether it answers is for its health probes to say."""
        return self.process is None or self.process.poll() is None

    def tail(self) -> str:
        """The last lines of the worker's log, or where to look for a registered server's."""
        if self.external:
            return f"(registered server {self.url}: its log is on the host that runs it)"
        return log_tail(self.log_path)


def drain_to_capped_file(pipe: IO[bytes], path: Path, max_bytes: int) -> None:
    """Copy a worker's output to ``path`` until it closes; past ``max_bytes`` the file
    moves to ``path.1`` (replacing an older one) and a new one starts, so a chatty
    worker never fills the disk and never blocks on a full pipe."""
    out = path.open("ab")
    try:
        for chunk in iter(lambda: pipe.read1(64 * 1024), b""):  # type: ignore[attr-defined]
            if out.tell() + len(chunk) > max_bytes:
                out.close()
                os.replace(path, path.with_name(path.name + ".1"))
                out = path.open("ab")
            out.write(chunk)
            out.flush()
    except (OSError, ValueError):
        pass
    finally:
        out.close()
        pipe.close()


def _free_port(taken: set[int]) -> int:
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            return port
    raise WorkerError("no free port found for a new worker")


def _model_vocab_size(model_path: str) -> int | None:
    config = Path(model_path) / "config.json"
    try:
        vocab = json.loads(config.read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return int(vocab) if isinstance(vocab, int) else None


def kv_transfer_config(control_url: str, token: str, mean: float, std: float) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` that loads the FillConnector, pulling from ``control_url``."""
    return {
        "kv_connector": "FillConnector",
        "kv_connector_module_path": "connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "control_url": control_url,
            "worker_token": token,
            "fill_mean": mean,
            "fill_std": std,
        },
    }


def engine_flags(model: str, engine: EngineSpec, on_cpu: bool) -> list[str]:
    """vLLM server flags for an engine spec (CPU defaults where vLLM's own fail on CPU)."""
    flags = [
        "--dtype", engine.dtype or ("float32" if on_cpu else "auto"),
        "--tensor-parallel-size", str(engine.tensor_parallel_size),
    ]  # fmt: skip
    mem = engine.gpu_memory_utilization or (0.3 if on_cpu else None)
    if mem is not None:
        flags += ["--gpu-memory-utilization", str(mem)]
    if engine.max_model_len is not None:
        flags += ["--max-model-len", str(engine.max_model_len)]
    if model == TINY_MODEL_NAME:
        flags += ["--load-format", "dummy"]
    if on_cpu:
        flags += ["--enforce-eager"]
    return flags + list(engine.extra_args)


def serve_command(body: WorkerRegister, control_url: str, token: str) -> tuple[str, dict[str, Any]]:
    """The ``vllm serve`` line a registered server is to be started with, and its KV config."""
    fill = FillSpec()
    config = kv_transfer_config(control_url, token, fill.mean, fill.std)
    port = urlsplit(body.url).port or 8000
    argv = [
        "vllm", "serve", body.model, "--served-model-name", body.model,
        "--host", "0.0.0.0", "--port", str(port),
        "--kv-transfer-config", json.dumps(config, separators=(",", ":")),
        *engine_flags(body.model, body.engine, on_cpu=False),
    ]  # fmt: skip
    return shlex.join(argv), config


class Launcher:
    """Owns the vLLM worker processes of this service, and the registered servers it drives."""

    def __init__(self, settings: Settings, engine: Engine, client: httpx.AsyncClient) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.workers: dict[str, WorkerHandle] = {}
        self.tokens: dict[str, str] = {}

    def build_argv(
        self, spec: RunSpec, port: int, token: str, gpus: list[str]
    ) -> tuple[list[str], str]:
        """The worker's argv (never a shell string) and the model path it serves."""
        if spec.model == TINY_MODEL_NAME:
            model_path = str(ensure_tiny_model(self.settings.models_dir))
        else:
            model_path = spec.model
        kv_config = kv_transfer_config(
            self.settings.control_base_url(), token, spec.fill.mean, spec.fill.std
        )
        argv = [
            *self.settings.worker_command(),
            "--model", model_path,
            "--served-model-name", spec.model,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--kv-transfer-config", json.dumps(kv_config),
            *engine_flags(spec.model, spec.engine, on_cpu=not gpus),
        ]  # fmt: skip
        return argv, model_path

    async def start(self, spec: RunSpec, gpus: list[str]) -> WorkerHandle:
        """Start a worker for ``spec``'s model and engine and wait until it is healthy."""
        worker_id = new_id("w")
        token = secrets.token_urlsafe(32)
        port = _free_port({h.port for h in self.workers.values()})
        argv, model_path = self.build_argv(spec, port, token, gpus)
        self.settings.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.settings.logs_dir / f"{worker_id}.log"
        url = f"http://127.0.0.1:{port}"
        env = dict(os.environ)
        env[WORKER_ENV] = worker_id
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        cpu_binding: dict[str, Any] | None = None
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        else:
            # The same thread layout whatever the worker loads: see service/cpu_binding.py.
            chosen = binding_env(spec.engine.tensor_parallel_size, os.environ)
            env.update(chosen)
            cpu_binding = {"env": chosen}
        with Session(self.engine) as session:
            session.add(
                Worker(
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
                )
            )
            session.commit()
        log.info("starting worker %s for %s on port %s", worker_id, spec.model, port)
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(self.settings.data_dir),
            start_new_session=True,
        )
        assert process.stdout is not None
        threading.Thread(
            target=drain_to_capped_file,
            args=(process.stdout, log_path, self.settings.worker_log_max_bytes),
            name=f"log-{worker_id}",
            daemon=True,
        ).start()
        self._update(worker_id, pid=process.pid)
        handle = WorkerHandle(
            id=worker_id,
            key=spec.worker_key(),
            url=url,
            port=port,
            served_model=spec.model,
            process=process,
            log_path=log_path,
            gpus=gpus,
            vocab_size=_model_vocab_size(model_path),
            cpu_binding=cpu_binding,
        )
        self.workers[worker_id] = handle
        self.tokens[worker_id] = token
        try:
            await self._wait_healthy(handle)
        except BaseException as exc:
            reason = str(exc) if isinstance(exc, WorkerError) else "start interrupted"
            await self.stop(handle, status="failed", error=reason)
            raise
        handle.ready = True
        handle.kv_tokens = await self._kv_capacity(handle)
        if cpu_binding is not None:
            # What vLLM made of the variables, as its worker logged it while starting.
            cores = parse_binding_log(await asyncio.to_thread(log_head, log_path))
            handle.cpu_binding = cpu_binding = {**cpu_binding, **(cores or {})}
        self._update(worker_id, status="ready", ready_at=utcnow(), kv_tokens=handle.kv_tokens,
                     cpu_binding=cpu_binding)
        log.info("worker %s ready at %s", worker_id, url)
        return handle

    async def _kv_capacity(self, handle: WorkerHandle) -> int | None:
        """KV cache size in tokens from vLLM's ``cache_config_info`` metric, if it is there."""
        try:
            text = (await self.client.get(f"{handle.url}/metrics", timeout=10.0)).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = dict(_LABEL.findall(line))
                try:
                    return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
                except (KeyError, ValueError):
                    return None
        return None

    async def _wait_healthy(self, handle: WorkerHandle) -> None:
        assert handle.process is not None, "only started workers are waited for"
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        while True:
            code = handle.process.poll()
            if code is not None:
                raise WorkerError(
                    f"vLLM server exited with code {code} before it became healthy; "
                    f"last log lines:\n{log_tail(handle.log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                response = await self.client.get(f"{handle.url}/health", timeout=2.0)
                if response.status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"vLLM server not healthy after {self.settings.worker_start_timeout_s:.0f} s; "
                    f"last log lines:\n{log_tail(handle.log_path)}"
                )
            await asyncio.sleep(0.5)

    async def stop(self, handle: WorkerHandle, status: str = "stopped", error: str | None = None) -> None:
        """Stop the worker's whole process group: SIGTERM, then SIGKILL after the grace period.
        A registered server is not ours to stop: it is marked unavailable until it answers again."""
        if handle.process is None:
            self.set_unavailable(handle, error or status)
            return
        self.workers.pop(handle.id, None)
        self.tokens.pop(handle.id, None)
        await asyncio.to_thread(stop_process_group, handle.process, self.settings.worker_stop_grace_s)
        self._update(handle.id, status=status, stopped_at=utcnow(), error=error)
        log.info("worker %s %s", handle.id, status)

    async def stop_all(self) -> None:
        """Stop every worker this service started (registered servers stay registered)."""
        for handle in list(self.workers.values()):
            if not handle.external:
                await self.stop(handle)

    def mark_dead(self, handle: WorkerHandle, error: str) -> None:
        """Record that a worker died on its own; its group is still stopped."""
        if handle.process is None:
            self.set_unavailable(handle, error)
            return
        self.workers.pop(handle.id, None)
        self.tokens.pop(handle.id, None)
        stop_process_group(handle.process, 0)
        self._update(handle.id, status="failed", stopped_at=utcnow(), error=error)

    # --- registered servers -------------------------------------------------------------

    def register(self, body: WorkerRegister) -> tuple[Worker, str]:
        """Record a vLLM server started elsewhere; it takes runs once its probes pass.
        Returns its row and its worker token (the only time the token is seen)."""
        for handle in self.workers.values():
            if handle.external and handle.url == body.url:
                raise Conflict(f"a server at {body.url} is registered already as {handle.id}")
        token = body.token or secrets.token_urlsafe(32)
        with Session(self.engine) as session:
            taken = session.exec(select(Worker).where(Worker.token_hash == hash_token(token))).first()
        if taken is not None:
            raise Conflict("that token is already in use by another worker; choose another")
        parts = urlsplit(body.url)
        worker = Worker(
            id=new_id("w"),
            key=body.worker_key(),
            model=body.model,
            engine=body.engine.model_dump(),
            url=body.url,
            port=parts.port or (443 if parts.scheme == "https" else 80),
            status="unavailable",
            token_hash=hash_token(token),
            log_path="",
            external=True,
            vocab_size=body.vocab_size or (VOCAB_SIZE if body.model == TINY_MODEL_NAME else None),
            error="registered; waiting for the server to answer /health",
        )
        with Session(self.engine, expire_on_commit=False) as session:
            session.add(worker)
            session.commit()
        self.workers[worker.id] = self._registered_handle(worker)
        log.info("registered worker %s at %s for %s", worker.id, worker.url, worker.model)
        return worker, token

    def _registered_handle(self, worker: Worker) -> WorkerHandle:
        return WorkerHandle(
            id=worker.id, key=worker.key, url=worker.url, port=worker.port,
            served_model=worker.model, process=None, log_path=Path(os.devnull),
            vocab_size=worker.vocab_size, kv_tokens=worker.kv_tokens,
        )

    def load_registered(self) -> int:
        """On start: take back the registered servers, unavailable until a probe passes."""
        with write_session(self.engine) as session:
            rows = session.exec(
                select(Worker).where(col(Worker.external).is_(True), Worker.status != "removed")
            ).all()
            for worker in rows:
                worker.status = "unavailable"
                worker.error = "service restarted; waiting for the server to answer /health"
                session.add(worker)
                self.workers[worker.id] = self._registered_handle(worker)
        return len(rows)

    def deregister(self, worker_id: str) -> None:
        """Forget a registered server: it takes no more runs and its token stops working."""
        handle = self.workers.get(worker_id)
        if handle is None:
            with Session(self.engine) as session:
                row = session.get(Worker, worker_id)
            if row is None or not row.external or row.status == "removed":
                raise NotFound(f"no registered worker {worker_id!r}")
            raise Conflict(f"worker {worker_id} is not registered any more")
        if not handle.external:
            raise Conflict(
                f"worker {worker_id} was started by this service, which stops it when it needs "
                "the room; only registered servers can be removed"
            )
        if handle.busy_run is not None:
            raise Conflict(f"worker {worker_id} is serving run {handle.busy_run}; cancel that run first")
        del self.workers[worker_id]
        self._update(worker_id, status="removed", stopped_at=utcnow(), error=None)
        log.info("removed registered worker %s", worker_id)

    def set_unavailable(self, handle: WorkerHandle, error: str) -> None:
        """A registered server stopped answering: no runs go to it until a probe passes."""
        handle.ready = False
        if handle.id in self.workers:
            self._update(handle.id, status="unavailable", error=error)

    async def probe(self, handle: WorkerHandle) -> bool:
        """Check that a registered server answers and serves its model; mark it ready or
        unavailable. Returns True when it has just become ready."""
        problem = None
        try:
            health = await self.client.get(f"{handle.url}/health", timeout=PROBE_TIMEOUT_S)
            if health.status_code != 200:
                problem = f"/health answered {health.status_code}"
            else:
                listed = await self.client.get(f"{handle.url}/v1/models", timeout=PROBE_TIMEOUT_S)
                served = [m["id"] for m in listed.json()["data"]]
                if handle.served_model not in served:
                    problem = f"the server serves {served}, not {handle.served_model!r}"
        except httpx.HTTPError as exc:
            problem = f"no answer from {handle.url}: {type(exc).__name__} {exc}".strip()
        except (ValueError, KeyError, TypeError):
            problem = f"{handle.url}/v1/models did not answer with a model list"
        if handle.id not in self.workers:
            return False  # removed while the probe was out
        now = utcnow()
        if problem is not None:
            if handle.ready or handle.last_problem != problem:
                log.warning("worker %s unavailable: %s", handle.id, problem)
                handle.last_problem = problem
                self.set_unavailable(handle, problem)
            return False
        handle.last_problem = None
        if handle.ready:
            if time.monotonic() - handle.seen_written > LAST_SEEN_EVERY_S:
                handle.seen_written = time.monotonic()
                self._update(handle.id, last_seen_at=now)
            return False
        if handle.kv_tokens is None:
            handle.kv_tokens = await self._kv_capacity(handle)
            if handle.id not in self.workers:
                return False
        handle.ready = True
        handle.seen_written = time.monotonic()
        self._update(handle.id, status="ready", ready_at=now, last_seen_at=now, error=None,
                     kv_tokens=handle.kv_tokens)
        log.info("worker %s at %s answers; ready", handle.id, handle.url)
        return True

    def _update(self, worker_id: str, **fields: object) -> None:
        # One UPDATE statement: no read first, so no lock upgrade to lose against another writer.
        with Session(self.engine) as session:
            session.exec(update(Worker).where(col(Worker.id) == worker_id).values(**fields))
            session.commit()

    def reap_orphans(self) -> int:
        """After a crash: stop process groups of workers a previous service left behind."""
        stopped = 0
        with write_session(self.engine) as session:
            rows = session.exec(
                select(Worker).where(
                    col(Worker.status).in_(("starting", "ready")), col(Worker.external).is_(False)
                )
            ).all()
            for worker in rows:
                if worker.pid is not None and _is_our_worker(worker.pid, worker.id):
                    log.warning("stopping orphaned worker %s (pid %s)", worker.id, worker.pid)
                    _kill_group(worker.pid, self.settings.worker_stop_grace_s)
                    stopped += 1
                worker.status = "stopped"
                worker.stopped_at = utcnow()
                worker.error = "service restarted; worker stopped"
                session.add(worker)
        return stopped


def _is_our_worker(pid: int, worker_id: str) -> bool:
    """True if ``pid`` is alive and was started by us as ``worker_id`` (guards against pid reuse)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{WORKER_ENV}={worker_id}".encode() in environ.split(b"\0")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(pgid: int, grace_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def stop_process_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``, and reap the leader."""
    pgid = process.pid  # start_new_session makes the child its group's leader
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if process.poll() is not None and not _group_alive(pgid):
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
