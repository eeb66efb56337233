"""Server-rendered HTML pages for people (not part of the REST API's schema): one module
per concept, drawn with ``render``."""

from __future__ import annotations

from fastapi import APIRouter

from service.web.pages import capacity, compare, fidelity, runs, sweeps
from service.web.pages.login import login_router

router = APIRouter()
for part in (runs, sweeps, capacity, compare, fidelity):
    router.include_router(part.router)

__all__ = ["login_router", "router"]
