"""The app factory: ``create_app(settings)`` wires the database, HTTP client, fleet
and scheduler into a FastAPI app whose lifespan owns them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import anyio.to_thread
import httpx
from fastapi import Depends, FastAPI
from sqlalchemy import Engine

from service.control import provenance
from service.control.fleet import DriverBackend, Fleet, ServerBackend
from service.control.queue import Scheduler
from service.settings import Settings
from service.storage import logs
from service.storage.db import LOOP_EXECUTOR_THREADS, THREADPOOL_THREADS, make_engine
from service.web import api, openapi_links, pages, prom
from service.web.errors import install_error_handlers
from service.web.limits import BodyLimit
from service.web.query import one_value_each

log = logging.getLogger(__name__)
# How often the logs of workers that ended long ago are looked for (``service.storage.logs``).
LOG_PRUNE_EVERY_S = 60.0


async def prune_logs(engine: Engine, settings: Settings) -> None:
    """Delete the logs of workers that ended before the last ``settings.worker_logs_kept``."""
    try:
        await asyncio.to_thread(logs.prune_worker_logs, engine, settings.logs_dir,
                                settings.worker_logs_kept)
    except Exception:
        log.exception("pruning worker logs failed; trying again later")


async def prune_logs_every(engine: Engine, settings: Settings) -> None:
    """``prune_logs`` every ``LOG_PRUNE_EVERY_S`` (workers end while the service runs), until
    cancelled."""
    while True:
        await asyncio.sleep(LOG_PRUNE_EVERY_S)
        await prune_logs(engine, settings)


def cluster_backends(settings: Settings, engine: Engine, client: httpx.AsyncClient
                     ) -> tuple[ServerBackend | None, DriverBackend | None]:
    """The Ray backends when ``ray_address`` is set (Ray is imported only then); else
    none, and the fleet uses local processes."""
    if not settings.ray_address:
        return None, None
    from service.control.ray_servers import RayServers
    from service.load.ray_drivers import RayDriverBackend

    return RayServers(settings, engine, client), RayDriverBackend(settings)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service app for ``settings`` (read from the environment when omitted)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Where database work runs (one rule): sync routes in FastAPI's threadpool, the
        # rest through ``asyncio.to_thread``; never on the event loop. The database pool
        # has a connection for each of these threads (``service.storage.db.POOL_SIZE``).
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADPOOL_THREADS
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(LOOP_EXECUTOR_THREADS, thread_name_prefix="decodebench-io"))
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        # Read once (a git call): every run records it.
        await asyncio.to_thread(provenance.service_facts)
        engine = make_engine(settings.db_path)
        client = httpx.AsyncClient()
        fleet = Fleet(settings, engine, client, *cluster_backends(settings, engine, client))
        scheduler = Scheduler(settings, engine, fleet)
        app.state.settings = settings
        app.state.engine = engine
        app.state.scheduler = scheduler
        app.state.prometheus = prom.make_registry(engine, scheduler)
        app.state.api_token = settings.resolve_api_token()
        await scheduler.start()
        await prune_logs(engine, settings)
        pruning = asyncio.create_task(prune_logs_every(engine, settings))
        try:
            yield
        finally:
            pruning.cancel()
            await asyncio.gather(pruning, return_exceptions=True)
            await scheduler.shutdown()
            await client.aclose()
            engine.dispose()

    app = FastAPI(
        title="decodebench",
        version="0.1.0",
        description="Long-context decode benchmarks for vLLM, with KV cache fill instead of prefill.",
        lifespan=lifespan,
        dependencies=[Depends(one_value_each)],
    )
    install_error_handlers(app)

    app.add_middleware(BodyLimit)
    app.include_router(api.router)
    app.include_router(pages.login_router)
    app.include_router(pages.router)
    openapi_links.install(app)
    return app
