"""The fidelity ledger: fill against real prefill per model, on engine steps."""

from __future__ import annotations

from fastapi import APIRouter

from service.analysis.fidelity_ledger import fidelity
from service.web.deps import DB, READ
from service.web.errors import ERROR_RESPONSES
from service.web.schemas import FidelityPublic

router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/api/fidelity", response_model=FidelityPublic, dependencies=READ)
def get_fidelity(engine: DB) -> FidelityPublic:
    """Per model and per family, the newest fill/prefill pairs' ratio of predicted step time
    at matched decode steps with its 95% interval, decided against +-5%, and the median ITL
    error (MAPE) beside it."""
    return FidelityPublic.model_validate(fidelity(engine))
