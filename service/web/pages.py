"""Server-rendered HTML pages: the runs table and one run's numbers."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from markupsafe import Markup
from pydantic import ValidationError
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from service.analysis import comparison, server_metrics
from service.analysis.metrics import peak_in_flight
from service.control.procs import log_tail
from service.core.protocol import connector_totals
from service.core.sample import Sample
from service.core.spec import EngineSpec, effective_load_format, worker_key
from service.core.status import FINISHED, RunStatus
from service.storage import store
from service.storage.tables import Run, Worker
from service.web import charts
from service.web.auth import (
    COOKIE,
    LEGACY_COOKIE,
    SESSION_MAX_AGE_S,
    is_admin,
    new_session,
    require_page_reader,
    session_state,
)
from service.web.deps import DB

# HTML for people, not part of the REST API's schema.
router = APIRouter(dependencies=[Depends(require_page_reader)], include_in_schema=False)
# The login page itself is open.
login_router = APIRouter(include_in_schema=False)


def _login_context(request: Request) -> dict[str, Any]:
    # The header offers "log out" to a browser with a live session.
    return {"logged_in": session_state(request) == "valid"}


templates = Jinja2Templates(directory=str(Path(__file__).parent / "templates"),
                            context_processors=[_login_context])

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


def _with_ci(value: Any, ci: Any) -> Markup:
    """``12.30 [12.00, 12.70]``: a value with its 95% interval when it has one."""
    text = _fmt(value)
    if isinstance(ci, list | tuple) and len(ci) == 2 and all(isinstance(v, int | float) for v in ci):
        return Markup('{} <span class="ci">[{}, {}]</span>').format(text, _fmt(float(ci[0])),
                                                                     _fmt(float(ci[1])))
    return Markup("{}").format(text)


def _figure(fig: Mapping[str, Any] | None) -> Markup:
    """A point's figure (``service.analysis.comparison.figure``) with its interval and spread."""
    if not fig:
        return Markup("-")
    out = _with_ci(fig["value"], fig.get("ci"))
    if fig.get("cv") is not None:
        out += Markup(' <span class="muted">CV {:.1%}</span>').format(fig["cv"])
    return out


templates.env.filters["with_ci"] = _with_ci
templates.env.filters["figure"] = _figure

# Units of the numbers a page shows by key; keys ending in ``_ms`` are ms.
UNITS = {"request_throughput": "req/s", "request_goodput": "req/s", "output_throughput": "tok/s",
         "total_token_throughput": "tok/s", "max_output_tokens_per_s": "tok/s", "duration": "s",
         "total_input_tokens": "tokens", "total_output_tokens": "tokens", "completed": "requests",
         "failed": "requests", "max_concurrent_requests": "requests", "decode_gaps": "gaps"}


def _unit(key: str) -> str:
    return "ms" if key.endswith("_ms") else UNITS.get(key, "")


def _aware(value: datetime) -> datetime:
    # SQLite hands datetimes back without their zone; every stored one is UTC.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _utc(value: datetime | None) -> str:
    """``2026-11-23 22:15:16 UTC``."""
    return _aware(value).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if value else "-"


def _duration(seconds: float | None) -> str:
    """``44 s``, ``3 min 05 s``, ``2 h 01 min``."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def _between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (_aware(end) - _aware(start)).total_seconds()


templates.env.filters["unit"] = _unit
templates.env.filters["utc"] = _utc
templates.env.filters["duration"] = _duration


def spec_facts(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A run's setup as ``(label, value)`` pairs a reader scans: model, ISL, OSL, load, prompts,
    mode and fill, engine."""
    isl = f"{spec.get('input_len')} tokens"
    if spec.get("range_ratio"):
        isl += f" ±{spec['range_ratio']:.0%}"
    rate, cap = spec.get("request_rate"), spec.get("max_concurrency")
    if rate is not None:
        load = ("rate", f"{rate:g} req/s" + (f" (burstiness {spec['burstiness']:g})"
                                             if spec.get("burstiness", 1.0) != 1.0 else "")
                + (f", at most {cap} at once" if cap is not None else ""))
    else:
        load = ("concurrency", str(cap) if cap is not None else "unlimited (all at once)")
    prompts = str(spec.get("num_prompts"))
    if spec.get("warmup_prompts"):
        prompts += f" + {spec['warmup_prompts']} warmup"
    fill = spec.get("fill") or {}
    mode = (f"fill (mean {fill.get('mean')}, std {fill.get('std')})" if spec.get("mode", "fill") == "fill"
            else "prefill (real)")
    engine = spec.get("engine") or {}
    shown = [f"TP {engine.get('tensor_parallel_size', 1)}"]
    shown += [f"{k} {v}" for k, v in engine.items()
              if k not in ("tensor_parallel_size", "extra_args") and v not in (None, "auto")]
    shown += [str(a) for a in engine.get("extra_args") or []]
    return [("model", str(spec.get("model"))), ("ISL", isl), ("OSL", f"{spec.get('output_len')} tokens"),
            load, ("prompts", prompts), ("mode", mode), ("engine", ", ".join(shown))]


# A line of a log or traceback that names what went wrong.
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception|Exit)\b:|\berror:|\bfailed\b|\bnot found\b", re.I)
# What says the model itself is the problem (missing, not a model, not reachable).
_MODEL_PROBLEM = re.compile(
    r"config\.json|not a valid model|model identifier|repo(sitory)?[ _]?(id|not found)|"
    r"does not appear to have|no such file|gated repo|huggingface|hf_hub|tokenizer", re.I)
CAUSE_CHARS = 300


def failure_cause(error: str | None, model: str) -> tuple[str, str]:
    """A failed run's cause in one line (the error line of the worker's log first, the model
    named when it is the problem) and the rest of the message (the log tail), for folding."""
    lines = [line.strip() for line in (error or "").strip().splitlines() if line.strip()]
    if not lines:
        return "", ""
    head = re.sub(r";?\s*last log lines:\s*$", "", lines[0])
    found = next((line for line in reversed(lines[1:]) if _ERROR_LINE.search(line)), None)
    cause = f"{found} · {head}" if found else head
    if model and model not in cause and _MODEL_PROBLEM.search(cause):
        cause = f"model {model}: {cause}"
    if len(cause) > CAUSE_CHARS:
        cause = cause[:CAUSE_CHARS - 1] + "…"
    return cause, "\n".join(lines[1:])




def _run_cause(run: Any) -> str:
    return failure_cause(run.error, run.model)[0]


templates.env.filters["cause"] = _run_cause
LOG_LINE_CHARS = 400


def starting_view(engine: Engine, run: Run) -> dict[str, Any] | None:
    """While a run is ``starting``: the server being started for it, how long that has taken
    against the last start of the same model (and engine, where one is known), and the last
    line of its log."""
    if run.status != RunStatus.starting.value:
        return None
    try:
        key: str | None = worker_key(run.model, EngineSpec.model_validate(run.spec.get("engine", {})))
    except ValidationError:
        key = None
    with Session(engine) as session:
        workers = list(session.exec(select(Worker).where(Worker.model == run.model)
                                    .order_by(col(Worker.created_at).desc()).limit(100)).all())
    current = next((w for w in workers if w.status == "starting" and (key is None or w.key == key)),
                   next((w for w in workers if w.status == "starting"), None))
    if current is None:
        return {"worker": None}
    earlier = [w for w in workers if w.ready_at is not None and not w.external
               and _aware(w.created_at) < _aware(current.created_at)]
    last = next((w for w in earlier if w.key == current.key), earlier[0] if earlier else None)
    line = log_tail(Path(current.log_path), 1)
    return {
        "worker": current,
        "elapsed_s": _between(current.created_at, datetime.now(UTC)),
        "last_start_s": _between(last.created_at, last.ready_at) if last else None,
        "last_same_engine": last is not None and last.key == current.key,
        "last_line": line if len(line) <= LOG_LINE_CHARS else line[:LOG_LINE_CHARS - 1] + "…",
    }


RECENT_ENDED_WORKERS = 10


def ended_workers(engine: Engine, limit: int = RECENT_ENDED_WORKERS) -> list[Worker]:
    """The servers that ended last (failed or stopped), with their reasons."""
    with Session(engine) as session:
        return list(session.exec(
            select(Worker).where(col(Worker.status).in_(("failed", "stopped")))
            .order_by(col(Worker.stopped_at).desc(), col(Worker.created_at).desc()).limit(limit)
        ).all())


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
            "ended_workers": ended_workers(engine) if page == 1 else [],
        },
    )


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str, engine: DB) -> HTMLResponse:
    """One run: its spec, status, and every summary number."""
    run = store.get_run(engine, run_id)
    every = store.get_samples(engine, run_id)
    samples = [s for s in every if s.success]
    origin = min((s.start_time for s in samples), default=0.0)
    tpots = [t * 1000 for s in samples if (t := s.tpot()) is not None]
    # Every gap of every request: one array (a run can hold millions), binned by numpy.
    gaps_ms = np.concatenate([np.asarray(s.itl, dtype=np.float64) for s in samples] or [np.empty(0)]) * 1000
    chart_list = [
        charts.histogram(tpots, "TPOT per request", "TPOT (ms)", "requests"),
        charts.histogram(gaps_ms, "Inter-token latency", "ITL (ms)", "gaps"),
        charts.scatter([(s.start_time - origin, s.ttft * 1000) for s in samples],
                       "TTFT over the run", "request start (s)", "TTFT (ms)"),
    ]
    worker = store.get_worker(engine, run.worker_id) if run.worker_id else None
    group = store.arm_runs(engine, run.group_id) if run.group_id else []
    baseline = comparison.against_baseline(engine, run) if run.status in FINISHED else None
    # From the stored spec as it is: runs from before load_format existed loaded "auto".
    load_format = effective_load_format(run.model, run.spec.get("engine", {}).get("load_format", "auto"))
    cause, log_lines = failure_cause(run.error, run.model) if run.status == "failed" else ("", "")
    ended = run.finished_at if run.finished_at else (datetime.now(UTC) if run.started_at else None)
    return templates.TemplateResponse(
        request,
        "run.html",
        {
            "facts": spec_facts(run.spec),
            "took_s": _between(run.started_at, ended),
            "cause": cause,
            "log_lines": log_lines,
            "starting": starting_view(engine, run),
            "peak_in_flight": peak_in_flight(every) if every else None,
            "load_format": load_format,
            "group": group,
            "baseline": baseline,
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


def server_view(points: Sequence[Mapping[str, Any]], samples: Sequence[Sample]) -> Markup | None:
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
    """One sweep: its points with their intervals, curves, fill against prefill, runs."""
    sweep = comparison.sweep_public(engine, sweep_id)
    keys = list(sweep.grid)
    runs_by_id = {r.id: r for r in sweep.runs}
    rows = [({k: comparison.spec_value(r.spec, k) for k in keys}, r) for r in sweep.runs]
    points = sweep.points
    both_modes = len({p["point"].get("mode", "fill") for p in points}) > 1
    href = {p["arm"]: f"/groups/{p['arm']}" if p["arm"].startswith("g-") else f"/runs/{p['arm']}"
            for p in points}

    def curve(key: str, x: str, label: str) -> dict[str, list[charts.Point]]:
        series: dict[str, list[charts.Point]] = {}
        for p in points:
            fig = p["figures"].get(key)
            if not fig or fig["value"] is None:
                continue
            spec = runs_by_id[p["runs"][0]].spec
            other = spec[label]
            name = f"{label}={other if other is not None else 'inf'}"
            if both_modes:
                name += f" {spec['mode']}"
            ci = fig.get("ci") or [None, None]
            # A latency or a rate is never below 0: a t interval over two or three trials
            # can reach there; the band stops at 0, the hover text keeps the interval.
            drawn_lo = max(ci[0], 0.0) if ci[0] is not None else None
            what = ", ".join(f"{k}={v}" for k, v in p["point"].items())
            spread = f" [{ci[0]:.3g}, {ci[1]:.3g}]" if ci[0] is not None else ""
            trials = f"; {fig['n']} trials" if fig["n"] > 1 else ""
            series.setdefault(name, []).append(charts.Point(
                float(spec[x]), float(fig["value"]), drawn_lo, ci[1], href[p["arm"]],
                f"{what}: {fig['value']:.3g}{spread}{trials}"))
        return series

    x_key = "input_len" if "input_len" in keys or "max_concurrency" not in keys else "max_concurrency"
    line_key = "max_concurrency" if x_key == "input_len" else "input_len"
    log2 = x_key == "input_len"
    xlabel = "input length (tokens, log-2 scale)" if log2 else "max_concurrency"
    chart_list = [
        charts.lines(curve("median_tpot_ms", x_key, line_key), "Median TPOT (ms) with its 95% interval",
                     xlabel, "ms", log2_x=log2),
        charts.lines(curve("decode_median_tpot_ms", x_key, line_key),
                     "Decode-only median TPOT (steady window, ms)", xlabel, "ms", log2_x=log2),
        charts.lines(curve("p99_tpot_ms", x_key, line_key), "p99 TPOT (ms)", xlabel, "ms", log2_x=log2),
        charts.lines(curve("output_throughput", "max_concurrency", "input_len"),
                     "Output throughput against concurrency", "max_concurrency", "tokens/s"),
    ]
    baselines = {}
    for p in points:
        first = runs_by_id[p["runs"][0]]
        if p["succeeded"] and all(runs_by_id[i].status in FINISHED for i in p["runs"]):
            baselines[p["arm"]] = comparison.against_baseline(engine, store.get_run(engine, first.id))
    return templates.TemplateResponse(
        request, "sweep.html",
        {"sweep": sweep, "keys": keys, "rows": rows, "charts": chart_list, "points": points,
         "pairs": sweep.fill_vs_prefill, "href": href, "baselines": baselines,
         "base_shown": base_not_swept(sweep.base, keys)},
    )


def base_not_swept(base: Mapping[str, Any], grid_keys: Sequence[str]) -> dict[str, Any]:
    """The base spec without the fields the grid sets (dotted keys reach into nested specs):
    what every point really shares."""
    shown = {k: v for k, v in base.items() if k not in grid_keys}
    for key in grid_keys:
        head, _, tail = key.partition(".")
        if tail and isinstance(shown.get(head), dict):
            shown[head] = {k: v for k, v in shown[head].items() if k != tail}
    return shown


@router.get("/groups/{group_id}", response_class=HTMLResponse)
def group_page(request: Request, group_id: str, engine: DB) -> HTMLResponse:
    """The trials of one point and every figure over them."""
    view = comparison.group_view(engine, group_id)
    points = []
    for r in view["runs"]:
        value = (r.summary or {}).get("median_tpot_ms") if r.status == "succeeded" else None
        if value is None:
            continue
        lo, hi = (r.summary or {}).get("median_tpot_ms_ci") or [None, None]
        points.append(charts.Point(float(r.trial or 0) + 1, float(value), lo, hi, f"/runs/{r.id}",
                                   f"trial {(r.trial or 0) + 1} ({r.id}): {value:.3g} ms"))
    trial_chart = charts.lines({"median TPOT": points},
                               "Median TPOT per trial (ms) with its interval over requests", "trial", "ms")
    return templates.TemplateResponse(
        request, "group.html", {"group": view, "chart": trial_chart,
                                "shown": [k for k in comparison.POINT_FIGURES if k in view["figures"]]
                                + [k for k in view["figures"] if k not in comparison.POINT_FIGURES]})


@router.get("/compare", response_class=HTMLResponse)
def compare_page(
    request: Request, engine: DB,
    ids: Annotated[list[str] | None, Query(max_length=comparison.MAX_COMPARED)] = None,
) -> HTMLResponse:
    """Chosen runs or groups against the first: distributions, each metric's change with
    its interval and a verdict."""
    chosen = comparison.split_ids(ids or [])[:comparison.MAX_COMPARED]
    if len(chosen) < 2:
        return templates.TemplateResponse(request, "compare.html", {"result": None, "chosen": chosen,
                                                                    "charts": []})
    result = comparison.compare(engine, chosen)
    arms = [comparison.load_arm(engine, a["id"]) for a in result["arms"]]
    names = {}
    facts = {arm.id: spec_facts(arm.spec) for arm in arms}
    for arm in arms:
        spec = arm.spec
        names[arm.id] = f"{arm.id} ({spec['mode']}, ISL {spec['input_len']}, c={spec['max_concurrency']})"
    chart_list = []
    for title, values, xlabel in (("TTFT", "ttft", "TTFT (ms)"), ("TPOT", "tpot", "TPOT (ms)"),
                                  ("ITL", "itl", "ITL (ms)")):
        series = {}
        for arm in arms:
            groups = arm.request_groups(engine, values)
            if groups:
                series[names[arm.id]] = np.concatenate(groups) * 1000
        chart_list.append(charts.cdf(series, f"{title}: share of values at or below", xlabel))
    return templates.TemplateResponse(
        request, "compare.html",
        {"result": result, "chosen": chosen, "charts": chart_list, "names": names, "facts": facts},
    )


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
    """Check the API token and open a signed, expiring session (the cookie never holds the token)."""
    if not is_admin(request, token):
        return templates.TemplateResponse(
            request, "login.html", {"next": _safe_next(next), "error": "wrong token"}, status_code=401
        )
    response = RedirectResponse(_safe_next(next), status_code=303)
    # SameSite=Strict keeps the cookie off cross-site requests: the CSRF defence of the
    # mutating API calls the pages make with it.
    response.set_cookie(COOKIE, new_session(request), max_age=SESSION_MAX_AGE_S, path="/",
                        httponly=True, samesite="strict", secure=request.url.scheme == "https")
    if LEGACY_COOKIE in request.cookies:
        _clear_cookie(request, response, LEGACY_COOKIE)
    return response


@login_router.post("/logout")
def logout(request: Request) -> RedirectResponse:
    """End the browser's login session and go to the login page."""
    response = RedirectResponse("/login", status_code=303)
    _clear_cookie(request, response, COOKIE)
    if LEGACY_COOKIE in request.cookies:
        _clear_cookie(request, response, LEGACY_COOKIE)
    return response


def _clear_cookie(request: Request, response: RedirectResponse, name: str) -> None:
    response.delete_cookie(name, path="/", httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")
