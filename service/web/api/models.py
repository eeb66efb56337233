"""The models the service writes itself: the bundled tiny model and the shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.core.shapes import catalogue
from service.core.tinymodel import TINY_MODEL_NAME
from service.web.deps import READ
from service.web.errors import ERROR_RESPONSES

router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/api/models", dependencies=READ)
def list_models() -> dict[str, Any]:
    """Bundled models a run can name: the tiny model and published architectures' shapes."""
    return {"tiny": TINY_MODEL_NAME, "shapes": catalogue()}
