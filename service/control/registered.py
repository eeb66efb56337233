"""vLLM servers started elsewhere and registered with the service: their records, their
health probes, and when they may take runs."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from sqlalchemy import Engine

from service.control.handles import WorkerHandle
from service.control.vllm_cli import kv_capacity
from service.core import shapes
from service.core.errors import Conflict, NotFound, shown
from service.core.ids import new_id, utcnow
from service.core.servers import WorkerRegister
from service.core.tinymodel import TINY_MODEL_NAME, VOCAB_SIZE
from service.storage import workers
from service.storage.tables import Worker
from service.storage.workers import hash_token

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
# A healthy registered server's last_seen_at is written at most this often.
LAST_SEEN_EVERY_S = 30.0


class RegisteredServers:
    """The registered servers of the fleet (``service.control.fleet.Fleet``): it keeps them
    in its ``workers``, shared with this, next to the ones it starts."""

    def __init__(self, engine: Engine, client: httpx.AsyncClient, workers: dict[str, WorkerHandle]) -> None:
        self.engine = engine
        self.client = client
        # The fleet's own dict of servers runs can be placed on: never replaced, only changed.
        self.workers = workers

    def _check_url_free(self, url: str) -> None:
        for handle in self.workers.values():
            if handle.external and handle.url == url:
                raise Conflict(f"a server at {url} is registered already as {handle.id}")

    async def register(self, body: WorkerRegister) -> tuple[Worker, str]:
        """Record a vLLM server started elsewhere; it takes runs once its probes pass.
        Returns its row and its worker token (the only time the token is seen)."""
        self._check_url_free(body.url)
        token = body.token or secrets.token_urlsafe(32)
        if await asyncio.to_thread(workers.worker_by_token, self.engine, token) is not None:
            raise Conflict("that token is already in use by another worker; choose another")
        # Another registration of the same URL may have got in while the lookup ran.
        self._check_url_free(body.url)
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
            backend="registered",
            vocab_size=body.vocab_size or _bundled_vocab(body.model),
            error="registered; waiting for the server to answer /health",
        )
        # Placed before the write, so that no second registration of the URL gets in.
        self.workers[worker.id] = self._registered_handle(worker)
        try:
            await asyncio.to_thread(workers.add_worker, self.engine, worker)
        except BaseException:
            self.workers.pop(worker.id, None)
            raise
        log.info("registered worker %s at %s for %s", worker.id, worker.url, worker.model)
        return worker, token

    def _registered_handle(self, worker: Worker) -> WorkerHandle:
        return WorkerHandle(
            id=worker.id, key=worker.key, url=worker.url, port=worker.port,
            served_model=worker.model, process=None, log_path=Path(os.devnull),
            vocab_size=worker.vocab_size, kv_tokens=worker.kv_tokens, backend="registered",
        )

    async def load_registered(self) -> int:
        """On start: take back the registered servers, unavailable until a probe passes."""
        rows = await asyncio.to_thread(workers.take_back_registered, self.engine)
        for worker in rows:
            self.workers[worker.id] = self._registered_handle(worker)
        return len(rows)

    async def deregister(self, worker_id: str) -> None:
        """Forget a registered server: it takes no more runs and its token stops working."""
        handle = self.workers.get(worker_id)
        if handle is None:
            row = await asyncio.to_thread(workers.get_worker, self.engine, worker_id)
            if row is None or not row.external or row.status == "removed":
                raise NotFound(f"no registered worker {shown(worker_id)}")
            raise Conflict(f"worker {worker_id} is not registered any more")
        if not handle.external:
            raise Conflict(
                f"worker {worker_id} was started by this service, which stops it when it needs "
                "the room; only registered servers can be removed"
            )
        if handle.busy_run is not None:
            raise Conflict(f"worker {worker_id} is serving run {handle.busy_run}; cancel that run first")
        del self.workers[worker_id]
        await asyncio.to_thread(workers.update_worker, self.engine, worker_id, status="removed",
                                stopped_at=utcnow(), error=None)
        log.info("removed registered worker %s", worker_id)

    async def set_unavailable(self, handle: WorkerHandle, error: str) -> None:
        """A registered server stopped answering: no runs go to it until a probe passes."""
        handle.ready = False
        if handle.id in self.workers:
            await asyncio.to_thread(workers.update_worker, self.engine, handle.id, status="unavailable",
                                    error=error)

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
                cards = {m["id"]: m for m in listed.json()["data"]}
                if handle.served_model not in cards:
                    problem = f"the server serves {list(cards)}, not {handle.served_model!r}"
                else:
                    length = cards[handle.served_model].get("max_model_len")
                    handle.max_model_len = length if isinstance(length, int) and length > 0 else None
        except httpx.HTTPError as exc:
            problem = f"no answer from {handle.url}: {_why_no_answer(exc)}"
        except (ValueError, KeyError, TypeError):
            problem = f"{handle.url}/v1/models did not answer with a model list"
        if handle.id not in self.workers:
            return False  # removed while the probe was out
        now = utcnow()
        if problem is not None:
            if handle.ready or handle.last_problem != problem:
                log.warning("worker %s unavailable: %s", handle.id, problem)
                handle.last_problem = problem
                await self.set_unavailable(handle, problem)
            return False
        handle.last_problem = None
        if handle.ready:
            if time.monotonic() - handle.seen_written > LAST_SEEN_EVERY_S:
                handle.seen_written = time.monotonic()
                await asyncio.to_thread(workers.update_worker, self.engine, handle.id, last_seen_at=now)
            return False
        if handle.kv_tokens is None:
            handle.kv_tokens = await kv_capacity(self.client, handle.url)
            if handle.id not in self.workers:
                return False
        handle.ready = True
        handle.seen_written = time.monotonic()
        await asyncio.to_thread(workers.update_worker, self.engine, handle.id, status="ready",
                                ready_at=now, last_seen_at=now, error=None, kv_tokens=handle.kv_tokens,
                                max_model_len=handle.max_model_len)
        log.info("worker %s at %s answers; ready", handle.id, handle.url)
        return True


def _why_no_answer(exc: httpx.HTTPError) -> str:
    """Why a probe got no answer, in words that stay the same from one probe round to the next
    for one cause: a port that closes each connection unanswered makes httpx raise a read error
    or a protocol error by the race between the request's bytes and the close."""
    if isinstance(exc, httpx.TimeoutException):
        return f"nothing came back within {PROBE_TIMEOUT_S:g} s"
    if isinstance(exc, httpx.ConnectError):
        return f"could not connect ({exc})" if str(exc) else "could not connect"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return "it closed the connection without answering"
    return f"{type(exc).__name__} {exc}".strip()


def _bundled_vocab(model: str) -> int | None:
    """The vocabulary of a bundled model a registered server serves, None for others."""
    if model == TINY_MODEL_NAME:
        return VOCAB_SIZE
    if model in {s.model for s in shapes.SHAPES.values()}:
        return int(shapes.shape_of(model).config["vocab_size"])
    return None
