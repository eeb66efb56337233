"""The REST API under /api, plus /healthz and /metrics: one module of routes per concept."""

from __future__ import annotations

from fastapi import APIRouter

from service.web.api import (
    capacity,
    compare,
    connector,
    exports,
    fidelity,
    health,
    imports,
    models,
    runs,
    steps,
    sweeps,
    workers,
)

router = APIRouter()
for part in (runs, steps, exports, imports, sweeps, capacity, compare, fidelity, workers, models, connector,
             health):
    router.include_router(part.router)
