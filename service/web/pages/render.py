"""What every page is drawn with: the templates and the filters they use, and the plain
wording of a run's setup and of why it failed."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Depends, Request
from fastapi.templating import Jinja2Templates
from markupsafe import Markup

from service.analysis.metrics import measured
from service.core.shapes import shape_of
from service.core.spec import effective_load_format
from service.web.auth import require_page_reader, session_state

# A page router's ``dependencies``: pages are for readers (the login page itself is open).
PAGE: list[Any] = [Depends(require_page_reader)]


def _login_context(request: Request) -> dict[str, Any]:
    # The header offers "log out" to a browser with a live session.
    return {"logged_in": session_state(request) == "valid"}


templates = Jinja2Templates(directory=str(Path(__file__).parent.parent / "templates"),
                            context_processors=[_login_context])


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


templates.env.filters["fmt"] = _fmt
# A run's summary with None for figures over no values (``metrics.measured``).
templates.env.filters["measured"] = lambda summary: measured(summary) or {}


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


def aware(value: datetime) -> datetime:
    # SQLite hands datetimes back without their zone; every stored one is UTC.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _utc(value: datetime | None) -> str:
    """``2026-11-23 22:15:16 UTC``."""
    return aware(value).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if value else "-"


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


def between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (aware(end) - aware(start)).total_seconds()


def _per_second(value: Any) -> str:
    """Bytes per second in the unit its magnitude reads in: ``3.35 TB/s`` on a GPU, ``41.2 GB/s``
    on a CPU, never ``0.00 TB/s``."""
    return _bytes(value) + "/s"


def _bytes(value: Any) -> str:
    """A byte count in the unit its magnitude reads in (decimal units, 3 significant digits)."""
    if not isinstance(value, int | float):
        return "-"
    for factor, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {unit}"
    return f"{value:.3g} B"


def _depth(spec: Mapping[str, Any]) -> str:
    """How deep a run's (or a search's base's) model was built: ``2 of 16 layers`` for a
    bundled shape with fewer layers, ``2 layers`` for another model; empty at full depth."""
    layers = (spec.get("engine") or {}).get("num_layers")
    if not layers:
        return ""
    model = str(spec.get("model", ""))
    try:
        return f"{layers} of {shape_of(model).layers} layers"
    except KeyError:  # not a bundled shape (or one this version does not know)
        return f"{layers} layers"


def _model_name(model: str) -> Markup:
    """A model's whole name, free to wrap after each ``/`` (a shape's or a repo's prefix)."""
    return Markup("/<wbr>").join(str(model).split("/"))


templates.env.filters["depth"] = _depth
templates.env.filters["model_name"] = _model_name
templates.env.filters["unit"] = _unit
templates.env.filters["per_second"] = _per_second
templates.env.filters["bytes"] = _bytes
templates.env.filters["utc"] = _utc
templates.env.filters["duration"] = _duration


def spec_facts(spec: Mapping[str, Any], imported: Mapping[str, Any] | None = None) -> list[tuple[str, str]]:
    """A run's setup as ``(label, value)`` pairs a reader scans: model, ISL, OSL, load, prompts,
    mode and fill, engine. ``imported``: an imported run's record of its file (its
    provenance's ``imported``), whose mode is what the file says, or unknown."""
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
    mode = {"fill": f"fill (mean {fill.get('mean')}, std {fill.get('std')})",
            "seeded": "seeded (decode on KV a real prefill wrote, from the prefix cache)"}.get(
        str(spec.get("mode", "fill")), "prefill (real)")
    if imported is not None:
        said = (imported.get("metadata") or {}).get("decodebench")
        mode = (f"{mode}, as its decodebench export says" if isinstance(said, Mapping) and said.get("mode")
                else "unknown: imported from a vllm bench serve result file, which does not say how "
                     "its KV cache was made")
    engine = spec.get("engine") or {}
    shown = [f"TP {engine.get('tensor_parallel_size', 1)}"]
    shown += [f"{k} {v}" for k, v in engine.items()
              if k not in ("tensor_parallel_size", "extra_args", "load_format") and v not in (None, "auto")]
    if imported is None:
        # The weights as the server loads them: a bundled model has none, so "dummy" whatever was asked.
        load_format = effective_load_format(str(spec.get("model")), engine.get("load_format") or "auto")
        if load_format != "auto":
            shown.append(f"load_format {load_format}")
    shown += [str(a) for a in engine.get("extra_args") or []]
    return [("model", str(spec.get("model"))), ("ISL", isl), ("OSL", f"{spec.get('output_len')} tokens"),
            load, ("prompts", prompts), ("mode", mode), ("engine", ", ".join(shown))]


# A line of a log or traceback that names what went wrong.
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception|Exit)\b:|\berror:|\bfailed\b|\bnot found\b", re.I)
# What says the model itself is the problem (missing, not a model, not reachable).
_MODEL_PROBLEM = re.compile(
    r"config\.json|not a valid model|model identifier|repo(sitory)?[ _]?(id|not found)|"
    r"does not appear to have|no such file|gated repo|huggingface|hf_hub|tokenizer", re.I)
# A failed start's error begins with the exception its server's engine raised, and the
# fix decodebench knows on the next line (``service.control.startup_errors``).
_ROOT_CAUSE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)(?::|$)")
FIX = "Fix: "
CAUSE_CHARS = 300


def failure_cause(error: str | None, model: str) -> tuple[str, str]:
    """A failed run's cause in one line (the root cause and its fix where the error begins
    with them, else the error line of the worker's log first; the model named when it is
    the problem) and the rest of the message (the log tail), for folding."""
    lines = [line.strip() for line in (error or "").strip().splitlines() if line.strip()]
    if not lines:
        return "", ""
    head = re.sub(r";?\s*last log lines:\s*$", "", lines[0])
    fix = ""
    if _ROOT_CAUSE.match(head):
        cause = head
        if len(lines) > 1 and lines[1].startswith(FIX):
            fix = lines.pop(1)
    else:
        found = next((line for line in reversed(lines[1:]) if _ERROR_LINE.search(line)), None)
        cause = f"{found} · {head}" if found else head
    if model and model not in cause and _MODEL_PROBLEM.search(cause):
        cause = f"model {model}: {cause}"
    room = CAUSE_CHARS - (len(fix) + 3 if fix else 0)  # a long cause is cut, never its fix
    if len(cause) > room:
        cause = cause[:room - 1] + "…"
    return (f"{cause} · {fix}" if fix else cause), "\n".join(lines[1:])


def _run_cause(run: Any) -> str:
    return failure_cause(run.error, run.model)[0]


templates.env.filters["cause"] = _run_cause
