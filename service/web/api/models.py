"""The models the service writes itself: the bundled tiny model and the shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.analysis.neutrality import fill_neutrality
from service.core.shapes import SHAPES, catalogue, shape_config
from service.core.tinymodel import TINY_MODEL_NAME, tiny_config
from service.web.deps import READ
from service.web.errors import ERROR_RESPONSES

router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/api/models", dependencies=READ)
def list_models(request: Request) -> dict[str, Any]:
    """Bundled models a run can name: the tiny model and published architectures' shapes,
    each with whether a dummy KV fill is neutral for it (``fill_neutral``; where it is not,
    ``fill_not_neutral_because`` and mode ``seeded`` as the remedy), and whether it runs on
    this service's CPU servers at its fewest layers (``runs_on_cpu``, ``why_not``)."""
    shapes = []
    memory = request.app.state.scheduler.fleet.cpu_memory_bytes()
    for entry, shape in zip(catalogue(memory), SHAPES.values(), strict=True):
        neutrality = fill_neutrality(shape_config(shape, None))
        shapes.append({**entry, "fill_neutral": neutrality["neutral"],
                       "fill_not_neutral_because": neutrality["reasons"]})
    tiny = fill_neutrality(tiny_config())
    return {"tiny": TINY_MODEL_NAME, "tiny_fill_neutral": tiny["neutral"], "shapes": shapes,
            "remedy": "mode \"seeded\": prompts prefilled once, decode measured on real KV "
                      "from the prefix cache"}
