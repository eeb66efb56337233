"""The REST API under /api, plus /healthz and /metrics: one module of routes per concept."""

from __future__ import annotations

from fastapi import APIRouter

from service.web.api import (
    capacity,
    compare,
    connector,
    exports,
    health,
    imports,
    models,
    runs,
    sweeps,
    workers,
)

router = APIRouter()
for part in (runs, exports, imports, sweeps, capacity, compare, workers, models, connector, health):
    router.include_router(part.router)
