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
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
from sqlalchemy import Engine, update
from sqlmodel import Session, col, select

from service.db import write_session
from service.models import RunSpec, Worker, new_id, utcnow
from service.settings import Settings
from service.tinymodel import TINY_MODEL_NAME, ensure_tiny_model

log = logging.getLogger(__name__)

# Environment variable that marks a process as ours, so that after a crash we only
# ever stop process groups this service started.
WORKER_ENV = "DECODEBENCH_WORKER_ID"
LOG_TAIL_LINES = 40
_LABEL = re.compile(r'(\w+)="([^"]*)"')
REPO_ROOT = Path(__file__).resolve().parents[1]


class WorkerError(Exception):
    """A worker failed to start or died; the message carries its log tail."""


def hash_token(token: str) -> str:
    """The stored form of a worker token."""
    return hashlib.sha256(token.encode()).hexdigest()


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
    """A running worker process the service owns."""

    id: str
    key: str
    url: str
    port: int
    served_model: str
    process: subprocess.Popen[bytes]
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

    def alive(self) -> bool:
        """True while the worker's main process has not exited."""
        return self.process.poll() is None


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


class Launcher:
    """Owns the vLLM worker processes of this service."""

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
        engine = spec.engine
        on_cpu = not gpus
        if spec.model == TINY_MODEL_NAME:
            model_path = str(ensure_tiny_model(self.settings.models_dir))
        else:
            model_path = spec.model
        kv_config = {
            "kv_connector": "FillConnector",
            "kv_connector_module_path": "connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "control_url": self.settings.control_base_url(),
                "worker_token": token,
                "fill_mean": spec.fill.mean,
                "fill_std": spec.fill.std,
            },
        }
        dtype = engine.dtype or ("float32" if on_cpu else "auto")
        argv = [
            *self.settings.worker_command(),
            "--model", model_path,
            "--served-model-name", spec.model,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", dtype,
            "--tensor-parallel-size", str(engine.tensor_parallel_size),
            "--kv-transfer-config", json.dumps(kv_config),
        ]  # fmt: skip
        mem = engine.gpu_memory_utilization or (0.3 if on_cpu else None)
        if mem is not None:
            argv += ["--gpu-memory-utilization", str(mem)]
        if engine.max_model_len is not None:
            argv += ["--max-model-len", str(engine.max_model_len)]
        if spec.model == TINY_MODEL_NAME:
            argv += ["--load-format", "dummy"]
        if on_cpu:
            argv += ["--enforce-eager"]
        argv += list(engine.extra_args)
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
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
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
        self._update(worker_id, status="ready", ready_at=utcnow(), kv_tokens=handle.kv_tokens)
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
        """Stop the worker's whole process group: SIGTERM, then SIGKILL after the grace period."""
        self.workers.pop(handle.id, None)
        self.tokens.pop(handle.id, None)
        await asyncio.to_thread(stop_process_group, handle.process, self.settings.worker_stop_grace_s)
        self._update(handle.id, status=status, stopped_at=utcnow(), error=error)
        log.info("worker %s %s", handle.id, status)

    async def stop_all(self) -> None:
        """Stop every worker this service started."""
        for handle in list(self.workers.values()):
            await self.stop(handle)

    def mark_dead(self, handle: WorkerHandle, error: str) -> None:
        """Record that a worker died on its own; its group is still stopped."""
        self.workers.pop(handle.id, None)
        self.tokens.pop(handle.id, None)
        stop_process_group(handle.process, 0)
        self._update(handle.id, status="failed", stopped_at=utcnow(), error=error)

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
                select(Worker).where(col(Worker.status).in_(("starting", "ready")))
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
