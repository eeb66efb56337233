"""The fidelity ledger page: fill against real prefill per model and family, on engine steps."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from service.analysis.fidelity_ledger import fidelity
from service.web.deps import DB
from service.web.pages.render import PAGE, templates

router = APIRouter(dependencies=PAGE, include_in_schema=False)


@router.get("/fidelity", response_class=HTMLResponse)
def fidelity_page(request: Request, engine: DB) -> HTMLResponse:
    """The ledger: per model and family, the step-time ratio fill/prefill with its interval
    and decision, the median ITL error beside it and the figures others publish."""
    return templates.TemplateResponse(request, "fidelity.html", {"ledger": fidelity(engine)})
