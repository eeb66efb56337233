"""Server-rendered HTML pages: the runs table and one run's numbers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from markupsafe import Markup

from service import charts, server_metrics, store
from service.auth import COOKIE, is_admin, require_page_reader
from service.deps import DB
from service.metrics import Sample as SampleData
from service.models import RunStatus, connector_totals, effective_load_format

# HTML for people, not part of the REST API's schema.
router = APIRouter(dependencies=[Depends(require_page_reader)], include_in_schema=False)
# The login page itself is open.
login_router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))

PAGE_SIZE = 50

# Summary keys shown on a run's page, in groups, with their units.
METRIC_GROUPS: list[tuple[str, list[str]]] = [
    ("Throughput", ["request_throughput", "request_goodput", "output_throughput",
                    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"]),
    ("Counts", ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens"]),
    # Gaps while no request waited for its first token: decode without other prefills (ms).
    ("Decode only (steady window)", ["decode_median_tpot_ms", "decode_p99_tpot_ms",
                                     "decode_median_itl_ms", "decode_p99_itl_ms", "decode_gaps"]),
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
            "sweeps": store.list_sweeps(engine, 10) if page == 1 else [],
            "workers": store.active_workers(engine) if page == 1 else [],
        },
    )


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str, engine: DB) -> HTMLResponse:
    """One run: its spec, status, and every summary number."""
    run = store.get_run(engine, run_id)
    every = store.get_sample_data(engine, run_id)
    samples = [s for s in every if s.success]
    origin = min((s.start_time for s in samples), default=0.0)
    tpots = [t * 1000 for s in samples if (t := s.tpot()) is not None]
    chart_list = [
        charts.histogram(tpots, "TPOT per request", "TPOT (ms)", "requests"),
        charts.histogram([g * 1000 for s in samples for g in s.itl], "Inter-token latency",
                         "ITL (ms)", "gaps"),
        charts.scatter([(s.start_time - origin, s.ttft * 1000) for s in samples],
                       "TTFT over the run", "request start (s)", "TTFT (ms)"),
    ]
    worker = store.get_worker(engine, run.worker_id) if run.worker_id else None
    # From the stored spec as it is: runs from before load_format existed loaded "auto".
    load_format = effective_load_format(run.model, run.spec.get("engine", {}).get("load_format", "auto"))
    return templates.TemplateResponse(
        request,
        "run.html",
        {
            "load_format": load_format,
            "charts": chart_list,
            "server_view": server_view(store.server_points(engine, run_id), every),
            "worker": worker,
            "run": run,
            "summary": run.summary or {},
            "connector": connector_totals((run.connector or {}).get("ranks", {})),
            "groups": METRIC_GROUPS,
            "latencies": LATENCIES,
            "stats": STATS,
        },
    )


def server_view(points: Sequence[Mapping[str, Any]], samples: Sequence[SampleData]) -> Markup | None:
    """The server's running/waiting requests and KV cache use next to the requests the client
    had in flight, on one time line (seconds since the first request); None with no points.

    ``points`` are stored scrapes, ``t`` on the samples' clock."""
    if not points:
        return None
    starts = np.array([s.start_time for s in samples], dtype=np.float64)
    origin = float(starts.min()) if starts.size else float(points[0]["t"])

    def gauge(name: str, scale: float = 1.0) -> list[tuple[float, float]]:
        return [(p["t"] - origin, p["values"][name] * scale) for p in points if name in p["values"]]

    times, counts = server_metrics.in_flight(starts, [s.latency for s in samples])
    return charts.timeline(
        [
            ("requests", {
                "running (server)": gauge(server_metrics.RUNNING),
                "waiting (server)": gauge(server_metrics.WAITING),
                "in flight (client)": list(zip((times - origin).tolist(), counts.tolist(), strict=True)),
            }),
            ("KV cache used (%)", {"KV cache used (server)": gauge(server_metrics.KV_USAGE, 100.0)}),
        ],
        "Server view", "seconds since the run's first request",
        sampled={"running (server)", "waiting (server)", "KV cache used (server)"},
    )


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, sweep_id: str, engine: DB) -> HTMLResponse:
    """One sweep: its grid and every run's headline numbers."""
    sweep = store.sweep_public(engine, sweep_id)
    keys = list(sweep.grid)

    def value(spec: dict[str, Any], key: str) -> Any:
        for part in key.split("."):
            spec = spec[part]
        return spec

    rows = [({k: value(r.spec, k) for k in keys}, r) for r in sweep.runs]
    done = [r for r in sweep.runs if r.summary and r.status == "succeeded"]

    def by(label: str, x: str, y: str, mode: str | None = None) -> dict[str, list[tuple[float, float]]]:
        series: dict[str, list[tuple[float, float]]] = {}
        for r in done:
            if mode is not None and r.spec["mode"] != mode:
                continue
            name = f"{label}={r.spec[label] if r.spec[label] is not None else 'inf'}"
            assert r.summary is not None
            if r.summary.get(y) is None:
                continue  # a key an older run's summary does not have
            series.setdefault(name, []).append((float(r.spec[x]), float(r.summary[y])))
        return series

    chart_list = [
        charts.lines(by("max_concurrency", "input_len", "median_tpot_ms", "fill"),
                     "Median TPOT against input length (fill runs)", "input_len (tokens)", "ms"),
        charts.lines(by("max_concurrency", "input_len", "decode_median_tpot_ms", "fill"),
                     "Decode-only median TPOT (steady window) against input length (fill runs)",
                     "input_len (tokens)", "ms"),
        charts.lines(by("max_concurrency", "input_len", "p99_tpot_ms", "fill"),
                     "p99 TPOT against input length (fill runs)", "input_len (tokens)", "ms"),
        charts.lines(
            {k: v for k, v in by("input_len", "max_concurrency", "output_throughput").items()
             if all(x > 0 for x, _ in v)},
            "Output throughput against concurrency", "max_concurrency", "tokens/s"),
    ]
    # Fill and real-prefill runs of the same point, side by side.
    pairs = []
    if "mode" in keys:
        others = [k for k in keys if k != "mode"]
        fills = {tuple(p[k] for k in others): r for p, r in rows if p["mode"] == "fill"}
        for point, run in rows:
            twin = fills.get(tuple(point[k] for k in others))
            if point["mode"] == "prefill" and twin is not None:
                pairs.append(({k: point[k] for k in others}, twin, run))
    return templates.TemplateResponse(
        request, "sweep.html",
        {"sweep": sweep, "keys": keys, "rows": rows, "charts": chart_list, "pairs": pairs},
    )


COMPARE_KEYS = [
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
    "p99_itl_ms", "median_e2el_ms", "output_throughput", "request_throughput",
    "total_token_throughput", "completed", "failed", "duration",
]


@router.get("/compare", response_class=HTMLResponse)
def compare_page(
    request: Request, engine: DB, ids: Annotated[str, Query(min_length=1, max_length=2000)]
) -> HTMLResponse:
    """Chosen runs side by side, metric by metric, with the change against the first."""
    run_ids = [i for i in (part.strip() for part in ids.split(",")) if i][:12]
    runs = [store.get_run(engine, run_id) for run_id in run_ids]
    table = []
    for key in COMPARE_KEYS:
        values = [(r.summary or {}).get(key) for r in runs]
        first = values[0]
        deltas = [
            (v / first - 1) * 100 if isinstance(v, (int, float)) and isinstance(first, (int, float))
            and first else None
            for v in values
        ]
        table.append((key, values, deltas))
    return templates.TemplateResponse(request, "compare.html", {"runs": runs, "table": table})


def _safe_next(target: str) -> str:
    # Only paths on this site: never an open redirect.
    return target if target.startswith("/") and not target.startswith("//") else "/"


@login_router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: Annotated[str, Query(max_length=2000)] = "/") -> HTMLResponse:
    """Ask for the API token."""
    return templates.TemplateResponse(request, "login.html", {"next": _safe_next(next), "error": ""})


@login_router.post("/login", response_model=None)
def login(
    request: Request,
    token: Annotated[str, Form(max_length=512)],
    next: Annotated[str, Form(max_length=2000)] = "/",
) -> HTMLResponse | RedirectResponse:
    """Check the API token and keep it in a same-site, HTTP-only cookie."""
    if not is_admin(request, token):
        return templates.TemplateResponse(
            request, "login.html", {"next": _safe_next(next), "error": "wrong token"}, status_code=401
        )
    response = RedirectResponse(_safe_next(next), status_code=303)
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", max_age=30 * 24 * 3600)
    return response
