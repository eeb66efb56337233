"""What the service holds for each vLLM server it can place runs on."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Engine

from service.core.ids import utcnow
from service.storage import workers
from service.storage.logs import log_tail
from service.storage.tables import Worker

# How long a dead worker's log copier gets to write what was still in the pipe.
LAST_WORDS_WAIT_S = 2.0


# The error of a worker row written for a start that a cancel ended before any process.
CANCELLED_BEFORE_PROCESS = "its run was cancelled before the server's process started"


async def add_worker_row(engine: Engine, worker: Worker) -> None:
    """Write a starting server's row, in a thread. A cancel meanwhile cannot stop the
    thread: the row would go in after the start ended, ``starting`` with no process behind
    it (listed as starting until the service restarts). So a cancel waits for the write,
    ends the row ``stopped`` saying why, and then goes on."""
    write = asyncio.ensure_future(asyncio.to_thread(workers.add_worker, engine, worker))
    try:
        await asyncio.shield(write)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await write
            await asyncio.to_thread(workers.update_worker, engine, worker.id, status="stopped",
                                    stopped_at=utcnow(), error=CANCELLED_BEFORE_PROCESS)
        raise


class WorkerError(Exception):
    """A worker failed to start or died; the message carries its log tail."""


class EngineFailed(WorkerError):
    """A starting worker's log says its engine failed: it will never serve, though its API
    server may still run (it can hang on the dead engine). Nothing in it needs a grace period."""


class ServerProcess(Protocol):
    """A started server's main process as the fleet watches it: a ``subprocess.Popen``
    here, or a stand-in for a process on another node (``service.control.ray_servers``).
    ``poll`` never blocks: it may be called on the event loop."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None:
        """The exit code once the process has ended, else None."""
        ...


@dataclass
class WorkerHandle:
    """A vLLM server runs can be placed on: a process this service owns, or a registered
    server that runs elsewhere (``process`` is None)."""

    id: str
    key: str
    url: str
    port: int
    served_model: str
    process: ServerProcess | None
    log_path: Path
    # The thread that copies the process's output to ``log_path``.
    log_copier: threading.Thread | None = None
    gpus: list[str] = field(default_factory=list)
    vocab_size: int | None = None
    # The run using this worker now (one at a time, so runs never disturb each other).
    busy_run: str | None = None
    last_used: float = field(default_factory=time.monotonic)
    # Healthy at least once: until then no run may be placed on it.
    ready: bool = False
    # Tokens the server's KV cache holds, as it reports on /metrics (None if it does not say).
    kv_tokens: int | None = None
    # The server's longest sequence (prompt plus output), as its /v1/models says: a started
    # server's read once it is healthy, a registered one's at each probe (None: not said).
    max_model_len: int | None = None
    # Started with ``--max-model-len -1`` (the run gave no engine.max_model_len): vLLM chose
    # ``max_model_len`` to fit its KV cache memory.
    auto_fit: bool = False
    # CPU workers: the binding variables it was started with and the cores vLLM reports.
    cpu_binding: dict[str, Any] | None = None
    # Registered servers: the last probe's complaint, and when last_seen_at was last written.
    last_problem: str | None = None
    seen_written: float = 0.0
    # Who runs it: "local" (a process of this service), "registered" (started elsewhere)
    # or "ray" (an actor on ``node``: {"id", "address", "gpu_ids"}).
    backend: str = "local"
    node: dict[str, Any] | None = None
    # A server whose log is on another host: how to read its tail (blocking).
    remote_tail: Callable[[], str] | None = None
    # Why its process ended when the backend knows more than an exit code (a node lost).
    gone: str | None = None

    @property
    def external(self) -> bool:
        """True for a registered server this service did not start."""
        return self.backend == "registered"

    def alive(self) -> bool:
        """True while the worker's main process has not exited. A registered server has no
        process here; whether it answers is for its health probes to say."""
        return self.process is None or self.process.poll() is None

    def where(self) -> str:
        """`` on <host>`` for a server on another host (a Ray node), else nothing: for an
        error message."""
        if self.backend == "ray" and self.node:
            return f" on Ray node {self.node.get('id')} ({self.node.get('address')})"
        return ""

    def ended_why(self) -> str:
        """``": <why>"`` when the backend knows why the server ended (its node was lost),
        else nothing: for an error message."""
        return f": {self.gone}" if self.gone else ""

    def max_len_why(self) -> str:
        """Whose ``max_model_len`` this server's is and what a user can change, for the error
        of a run longer than it."""
        if self.external:
            return f"the max_model_len of the registered server {self.url}; lower input_len or output_len"
        if self.auto_fit:
            return (f"the longest server {self.id} fits (vLLM auto-fit to its KV cache memory); lower "
                    "input_len or output_len, or raise engine.gpu_memory_utilization")
        return f"the engine.max_model_len of server {self.id}; lower input_len or output_len"

    def tail(self) -> str:
        """The last lines of the worker's log, or where to look for a registered server's.
        Of a worker that has exited, its last words are waited for (up to a moment) to be
        copied from its pipe to the file first."""
        if self.external:
            return f"(registered server {self.url}: its log is on the host that runs it)"
        if self.remote_tail is not None:
            return self.remote_tail()
        if self.log_copier is not None and not self.alive():
            self.log_copier.join(timeout=LAST_WORDS_WAIT_S)
        return log_tail(self.log_path)
