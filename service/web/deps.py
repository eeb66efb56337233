"""FastAPI dependencies shared by the API and the pages: the app's database engine and
scheduler, and who may call a route."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy import Engine

from service.control.queue import Scheduler
from service.web.auth import require_admin, require_reader


def get_engine(request: Request) -> Engine:
    """The app's database engine."""
    engine: Engine = request.app.state.engine
    return engine


def get_scheduler(request: Request) -> Scheduler:
    """The app's scheduler."""
    scheduler: Scheduler = request.app.state.scheduler
    return scheduler


DB = Annotated[Engine, Depends(get_engine)]
Sched = Annotated[Scheduler, Depends(get_scheduler)]
# A route's ``dependencies``: callers with the API token, or any reader.
ADMIN: list[Any] = [Depends(require_admin)]
READ: list[Any] = [Depends(require_reader)]
