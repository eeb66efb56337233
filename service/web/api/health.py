"""The service's own state: ``/healthz`` for probes and ``/metrics`` for Prometheus."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.storage.db import ping
from service.web import prom
from service.web.deps import DB, READ, Sched
from service.web.errors import ERROR_RESPONSES

log = logging.getLogger(__name__)
router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/healthz")
def healthz(engine: DB, scheduler: Sched) -> JSONResponse:
    """Liveness and readiness: the database answers and the scheduler loop runs."""
    checks: dict[str, str] = {}
    try:
        ping(engine)
        checks["db"] = "ok"
    except Exception:
        # The driver's message can name files and settings: it goes to the log, not to an
        # unauthenticated caller.
        log.exception("health check: the database did not answer")
        checks["db"] = "database unavailable"
    checks["scheduler"] = "ok" if scheduler.alive() else "stopped"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ok" if ok else "unavailable", **checks}, status_code=200 if ok else 503)


@router.get("/metrics", response_class=PlainTextResponse, dependencies=READ)
def prometheus_metrics(request: Request, engine: DB, scheduler: Sched) -> Response:
    """Prometheus metrics of the service."""
    registry = prom.app_registry(request.app.state, engine, scheduler)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
