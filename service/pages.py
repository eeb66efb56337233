"""Server-rendered HTML pages: the runs table and one run's numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from service import store
from service.api import DB, sweep_public
from service.models import RunStatus, connector_totals

router = APIRouter()
templates = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))

PAGE_SIZE = 50

# Summary keys shown on a run's page, in groups, with their units.
METRIC_GROUPS: list[tuple[str, list[str]]] = [
    ("Throughput", ["request_throughput", "request_goodput", "output_throughput",
                    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"]),
    ("Counts", ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens"]),
]
LATENCIES = ["ttft", "tpot", "itl", "e2el"]
STATS = ["mean", "median", "std", "p50", "p90", "p95", "p99"]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


templates.env.filters["fmt"] = _fmt


@router.get("/", response_class=HTMLResponse)
def index(
    request: Request,
    engine: DB,
    status: RunStatus | None = None,
    model: Annotated[str | None, Query(max_length=512)] = None,
    page: Annotated[int, Query(ge=1, le=100_000)] = 1,
) -> HTMLResponse:
    """The runs, newest first."""
    runs, total = store.list_runs(
        engine, status.value if status else None, model or None, PAGE_SIZE, (page - 1) * PAGE_SIZE
    )
    return templates.TemplateResponse(
        request,
        "index.html",
        {
            "runs": runs,
            "total": total,
            "page": page,
            "pages": max(1, -(-total // PAGE_SIZE)),
            "status": status.value if status else "",
            "model": model or "",
            "statuses": [s.value for s in RunStatus],
        },
    )


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str, engine: DB) -> HTMLResponse:
    """One run: its spec, status, and every summary number."""
    run = store.get_run(engine, run_id)
    return templates.TemplateResponse(
        request,
        "run.html",
        {
            "run": run,
            "summary": run.summary or {},
            "connector": connector_totals((run.connector or {}).get("ranks", {})),
            "groups": METRIC_GROUPS,
            "latencies": LATENCIES,
            "stats": STATS,
        },
    )


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, sweep_id: str, engine: DB) -> HTMLResponse:
    """One sweep: its grid and every run's headline numbers."""
    sweep = sweep_public(engine, sweep_id)
    keys = list(sweep.grid)

    def value(spec: dict[str, Any], key: str) -> Any:
        for part in key.split("."):
            spec = spec[part]
        return spec

    rows = [({k: value(r.spec, k) for k in keys}, r) for r in sweep.runs]
    return templates.TemplateResponse(
        request, "sweep.html", {"sweep": sweep, "keys": keys, "rows": rows}
    )
