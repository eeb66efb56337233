"""Tables and API schemas: RunSpec (what to measure), Run, Sample, Worker.

The ladder is the usual one: a spec the user sends, a table row that stores it
with its state, and a public shape the API returns.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import re
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from sqlalchemy import JSON, Column, Index
from sqlmodel import Field as SQLField
from sqlmodel import SQLModel

from service.tinymodel import MAX_MODEL_LEN, TINY_MODEL_NAME

MAX_INPUT_LEN = 1 << 20
MAX_OUTPUT_LEN = 1 << 16
MAX_PROMPTS = 100_000
# Trials of one point; a sweep's runs (points x repeats) stay under MAX_SWEEP_RUNS.
MAX_REPEATS = 32
# One stored sample per (run, request index); older databases get it in ``db.make_engine``.
SAMPLE_UNIQUE_INDEX = "uq_sample_run_index"

# org/name with the hub's character rules, or a bare name; no "..", no leading "-".
_REPO_ID = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,95})(?:/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,95}))?$")


def utcnow() -> datetime:
    """Now, in UTC."""
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """A short random id with a readable prefix."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# --- the spec -------------------------------------------------------------------------


def _whole_number(value: Any) -> Any:
    # JSON has one number type: 7.0 is the integer 7. Other floats, strings and booleans
    # still fail the strict integer check.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_whole_number)]


def bounded_int(ge: int, le: int) -> Any:
    """An Int with bounds that show in the JSON schema (bounds before the validator)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_whole_number)]


class Strict(BaseModel):
    """Unknown fields are a 422, not silently dropped; no coercion ("5" or true is not 5)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class FillSpec(Strict):
    """Values the connector writes into the pretended-prefilled KV cache."""

    mean: float = Field(default=0.015, ge=-1e4, le=1e4, allow_inf_nan=False)
    std: float = Field(default=0.0, ge=0.0, le=1e4, allow_inf_nan=False)


# Allowed ``engine.extra_args`` options and the type of their value (None: a flag).
EXTRA_ARGS: dict[str, type | tuple[str, ...] | None] = {
    "--max-num-seqs": int,
    "--max-num-batched-tokens": int,
    # A small KV cache on purpose (to see where preemption starts): blocks, not bytes.
    "--num-gpu-blocks-override": int,
    "--block-size": int,
    "--seed": int,
    "--kv-cache-dtype": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"),
    "--enable-prefix-caching": None,
    "--no-enable-prefix-caching": None,
    "--enable-chunked-prefill": None,
    "--no-enable-chunked-prefill": None,
}


def _check_extra_arg(arg: str) -> str:
    name, eq, value = arg.partition("=")
    if name not in EXTRA_ARGS:
        allowed = ", ".join(sorted(EXTRA_ARGS))
        raise ValueError(f"option {name!r} is not allowed in extra_args (allowed: {allowed})")
    kind = EXTRA_ARGS[name]
    if kind is None:
        if eq:
            raise ValueError(f"option {name!r} is a flag and takes no value")
        return name
    if not eq or not value:
        raise ValueError(f"option {name!r} needs a value, written as {name}=VALUE")
    if kind is int:
        if not value.isdigit() or not 0 < int(value) <= 1 << 24:
            raise ValueError(f"option {name!r} needs a positive integer, got {value!r}")
        return f"{name}={int(value)}"
    if isinstance(kind, tuple) and value not in kind:
        raise ValueError(f"option {name!r} must be one of {', '.join(kind)}, got {value!r}")
    return f"{name}={value}"


class EngineSpec(Strict):
    """How the vLLM server is configured; runs with equal engine specs share a server."""

    tensor_parallel_size: Int = Field(default=1, ge=1, le=64)
    max_model_len: Int | None = Field(default=None, ge=16, le=MAX_INPUT_LEN + MAX_OUTPUT_LEN)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    extra_args: list[str] = Field(default_factory=list, max_length=16)
    # "dummy": random weights (vLLM's --load-format dummy), the model from its config.json
    # and tokenizer alone; decode speed depends on the architecture, not the weight values.
    load_format: Literal["auto", "dummy"] = "auto"

    @field_validator("extra_args")
    @classmethod
    def _allowed(cls, args: list[str]) -> list[str]:
        return [_check_extra_arg(a) for a in args]


# What vLLM's default loader looks for in a local model directory (top level only).
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


def effective_load_format(model: str, load_format: str = "auto") -> str:
    """The weights a server of this model loads: the bundled tiny model has none, so it is
    always "dummy"; any other model loads what ``engine.load_format`` asks for."""
    return "dummy" if model == TINY_MODEL_NAME else load_format


def has_weight_files(model_dir: Path) -> bool:
    """Whether a local model directory holds weight files vLLM can load."""
    return any(next(model_dir.glob(pattern), None) is not None for pattern in WEIGHT_FILES)


class GoodputSpec(Strict):
    """Service-level objectives; a request counts for goodput when it meets all given."""

    ttft_ms: float | None = Field(default=None, gt=0, le=1e9)
    tpot_ms: float | None = Field(default=None, gt=0, le=1e9)
    e2el_ms: float | None = Field(default=None, gt=0, le=1e9)


class RampUpSpec(Strict):
    """A request rate growing from ``start_rps`` (first request) to ``end_rps`` (last), like
    ``vllm bench serve --ramp-up-strategy/--ramp-up-start-rps/--ramp-up-end-rps``."""

    strategy: Literal["linear", "exponential"]
    # vLLM's CLI lets a linear ramp start at 0, then fails on the first request's rate.
    start_rps: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    end_rps: float = Field(gt=0, le=1e6, allow_inf_nan=False)

    @model_validator(mode="after")
    def _rising(self) -> RampUpSpec:
        if self.start_rps > self.end_rps:
            raise ValueError(
                f"ramp_up.start_rps ({self.start_rps:g}) must not be above ramp_up.end_rps "
                f"({self.end_rps:g})"
            )
        return self


class StopSpec(Strict):
    """When a run stops sending: once the 95% interval of its median decode ITL is within
    +-``itl_ci_pct`` percent of the median (checked from ``min_prompts`` answered requests
    on), after ``duration_s`` seconds of measurement, or at ``max_prompts`` requests
    (default: the run's ``num_prompts``), whichever comes first. Requests already sent
    are awaited and measured."""

    itl_ci_pct: float | None = Field(default=None, gt=0, le=100, allow_inf_nan=False)
    min_prompts: Int | None = Field(default=None, ge=2, le=MAX_PROMPTS)
    max_prompts: Int | None = Field(default=None, ge=1, le=MAX_PROMPTS)
    duration_s: float | None = Field(default=None, gt=0, le=7 * 86400, allow_inf_nan=False)

    @model_validator(mode="after")
    def _a_rule(self) -> StopSpec:
        if self.itl_ci_pct is None and self.duration_s is None:
            raise ValueError(
                "stop needs a rule: stop.itl_ci_pct (stop once the median decode ITL is known "
                "to +-this percent) and/or stop.duration_s (a time box); without one, "
                "num_prompts is the fixed count"
            )
        if (self.min_prompts is not None and self.max_prompts is not None
                and self.min_prompts > self.max_prompts):
            raise ValueError(
                f"stop.min_prompts ({self.min_prompts}) must not be above stop.max_prompts "
                f"({self.max_prompts})"
            )
        return self


# Validation context of specs read back from the database (``RunSpec.stored``).
STORED = {"stored": True}


def _is_stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))


def describe(exc: ValidationError) -> str:
    """A validation error in one line: each problem's place and message."""
    return "; ".join(
        ".".join(str(p) for p in e["loc"]) + ": " + str(e["msg"]).removeprefix("Value error, ")
        if e["loc"] else str(e["msg"]).removeprefix("Value error, ")
        for e in exc.errors()
    )


class RunSpec(Strict):
    """What one benchmark run measures; see DESIGN.md "RunSpec"."""

    model: str = Field(default=TINY_MODEL_NAME, min_length=1, max_length=512)
    input_len: Int = Field(default=1024, ge=1, le=MAX_INPUT_LEN)
    output_len: Int = Field(default=128, ge=1, le=MAX_OUTPUT_LEN)
    range_ratio: float = Field(default=0.0, ge=0.0, lt=1.0)
    num_prompts: Int = Field(default=64, ge=1, le=MAX_PROMPTS)
    max_concurrency: Int | None = Field(default=8, ge=1, le=100_000)
    request_rate: float | None = Field(default=None, gt=0, le=1e6, allow_inf_nan=False)
    burstiness: float = Field(default=1.0, gt=0, le=1e3, allow_inf_nan=False)
    warmup_prompts: Int = Field(default=0, ge=0, le=MAX_PROMPTS)
    mode: Literal["fill", "prefill"] = "fill"
    fill: FillSpec = Field(default_factory=FillSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    goodput: GoodputSpec = Field(default_factory=GoodputSpec)
    seed: Int = Field(default=0, ge=0, le=2**32 - 1)
    repeats: Int = Field(default=1, ge=1, le=MAX_REPEATS)
    ramp_up: RampUpSpec | None = None
    stop: StopSpec | None = None

    @classmethod
    def stored(cls, data: dict[str, Any]) -> RunSpec:
        """A spec read back from the database: checked like a submitted one except
        against the filesystem (a model directory that went away fails the run when its
        worker starts, with that reason, instead of failing every read of the spec)."""
        return cls.model_validate(data, context=STORED)

    @field_validator("model")
    @classmethod
    def _model_name(cls, value: str, info: ValidationInfo) -> str:
        if value == TINY_MODEL_NAME:
            return value
        if value.startswith("/"):
            path = Path(value)
            if ".." in path.parts or any(c in value for c in "\0\n\r"):
                raise ValueError("a local model path may not contain '..' or control characters")
            if _is_stored(info):
                return value
            if not (path / "config.json").is_file():
                raise ValueError(f"no model directory with a config.json at {value!r}")
            return value
        if "://" in value or ".." in value or not _REPO_ID.match(value):
            raise ValueError(
                "model must be the bundled tiny model, a Hugging Face repo id like "
                "'org/name', or an absolute path to a local model directory"
            )
        return value

    @model_validator(mode="after")
    def _weights(self, info: ValidationInfo) -> RunSpec:
        if (self.model.startswith("/") and self.engine.load_format == "auto" and not _is_stored(info)
                and not has_weight_files(Path(self.model))):
            raise ValueError(
                f"the model directory {self.model!r} has no weight files "
                f"({', '.join(WEIGHT_FILES)}); engine.load_format \"dummy\" runs it without "
                "them, from its config.json and tokenizer (random weights: decode speed "
                "depends on the architecture, not the weight values)"
            )
        return self

    @model_validator(mode="after")
    def _one_rate(self) -> RunSpec:
        if self.ramp_up is not None and self.request_rate is not None:
            raise ValueError(
                "ramp_up sets the request rate: leave request_rate null when ramp_up is given "
                "(vllm bench serve refuses --request-rate with --ramp-up-strategy)"
            )
        return self

    @model_validator(mode="after")
    def _fits(self) -> RunSpec:
        longest_prompt = math.floor(self.input_len * (1 + self.range_ratio))
        longest_output = math.floor(self.output_len * (1 + self.range_ratio))
        limit = self.engine.max_model_len
        if limit is None and self.model == TINY_MODEL_NAME:
            limit = MAX_MODEL_LEN
        if limit is not None and longest_prompt + longest_output > limit:
            raise ValueError(
                f"input_len {self.input_len} plus output_len {self.output_len} (with range_ratio "
                f"{self.range_ratio}) needs {longest_prompt + longest_output} tokens, more than "
                f"the model's max length {limit}"
            )
        return self

    @model_validator(mode="after")
    def _stop_bounds(self) -> RunSpec:
        stop = self.stop
        if stop is not None and stop.min_prompts is not None and stop.min_prompts > self.prompt_budget():
            raise ValueError(
                f"stop.min_prompts ({stop.min_prompts}) must not be above the most "
                f"requests the run may send ({self.prompt_budget()}: stop.max_prompts, or "
                "num_prompts when that is not given)"
            )
        return self

    def prompt_budget(self) -> int:
        """The most measured requests this run may send: ``num_prompts``, or with a stop
        rule ``stop.max_prompts`` when given."""
        if self.stop is not None and self.stop.max_prompts is not None:
            return self.stop.max_prompts
        return self.num_prompts

    def stop_min_prompts(self) -> int:
        """Answered requests before the interval rule is first checked: ``stop.min_prompts``,
        or twice the concurrency (at least 8), so the interval is not taken over the first
        batch alone; never above the budget."""
        if self.stop is not None and self.stop.min_prompts is not None:
            return self.stop.min_prompts
        return min(self.prompt_budget(), max(8, 2 * (self.max_concurrency or 0)))

    def longest_request_tokens(self) -> int:
        """KV cache tokens the longest request of this run needs (prompt plus output)."""
        return math.floor(self.input_len * (1 + self.range_ratio)) + math.floor(
            self.output_len * (1 + self.range_ratio)
        )

    def worker_key(self) -> str:
        """Runs with equal keys can share one vLLM server."""
        return worker_key(self.model, self.engine)

    def trials(self) -> list[RunSpec]:
        """The spec of each of the ``repeats`` trials: trial ``k`` runs with seed
        ``seed + k`` (so no two trials send the same prompts), the rest unchanged."""
        return [self.model_copy(update={"seed": (self.seed + k) % 2**32}) for k in range(self.repeats)]


# The fields that make runs measurements of the same thing: one model on one engine under
# one load, whatever the seed, the number of requests or the stop rule.
POINT_FIELDS = ("model", "engine", "input_len", "output_len", "range_ratio", "max_concurrency",
                "request_rate", "burstiness", "ramp_up", "mode", "fill")


def point_key(spec: dict[str, Any]) -> str:
    """A stable key for the point a stored spec measures (see ``POINT_FIELDS``): runs
    stored before a field of the engine existed have the same key as runs that leave it
    at its default."""
    engine = spec.get("engine") or {}
    # A stored spec an older version accepted but this one refuses is keyed as it is.
    with contextlib.suppress(ValueError):
        engine = EngineSpec.model_validate(engine).model_dump()
    point = {k: spec.get(k) for k in POINT_FIELDS} | {"engine": engine}
    text = json.dumps(point, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# --- status machine -------------------------------------------------------------------


class RunStatus(StrEnum):
    """Where a run is in its life."""

    queued = "queued"
    starting = "starting"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.queued: frozenset({RunStatus.starting, RunStatus.cancelled}),
    RunStatus.starting: frozenset({RunStatus.running, RunStatus.failed, RunStatus.cancelled}),
    RunStatus.running: frozenset({RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled}),
    RunStatus.succeeded: frozenset(),
    RunStatus.failed: frozenset(),
    RunStatus.cancelled: frozenset(),
}

FINISHED = frozenset({RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled})


def sources_of(target: RunStatus) -> frozenset[RunStatus]:
    """The states a run may move to ``target`` from."""
    return frozenset(s for s, targets in TRANSITIONS.items() if target in targets)


# --- tables ---------------------------------------------------------------------------


class Run(SQLModel, table=True):
    """One benchmark run and its state."""

    id: str = SQLField(primary_key=True)
    spec: dict[str, Any] = SQLField(sa_column=Column(JSON, nullable=False))
    model: str = SQLField(index=True)
    status: str = SQLField(default=RunStatus.queued, index=True)
    created_at: datetime = SQLField(default_factory=utcnow, index=True)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    worker_id: str | None = SQLField(default=None, index=True)
    completed: int = 0
    failed: int = 0
    total: int = 0
    summary: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))
    connector: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))
    connector_pulls: int = 0
    error: str | None = None
    # [{code, message, figure}]: what makes the run's numbers mean less than they seem.
    warnings: list[dict[str, Any]] | None = SQLField(default=None, sa_column=Column(JSON))
    # The CPU thread layout of the worker that served it (None on a GPU or registered server).
    cpu_binding: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))
    # Why the run stopped sending (``{rule, message, requests, median_itl_ms, itl_ci_ms,
    # itl_ci_pct}``; see ``service.stopping``).
    stopped_by: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))
    idempotency_key: str | None = SQLField(default=None, unique=True)
    request_hash: str | None = None
    sweep_id: str | None = SQLField(default=None, index=True)
    # The trials of one point (``spec.repeats`` > 1) share a group id; ``trial`` counts from 0.
    group_id: str | None = SQLField(default=None, index=True)
    trial: int | None = None
    # ``point_key`` of the spec: runs of the same point, for baselines.
    point: str | None = SQLField(default=None, index=True)
    # The setup its numbers came from (see ``service.provenance.snapshot``), taken when it
    # got its worker.
    provenance: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))


class Baseline(SQLModel, table=True):
    """The run or group later runs of its point are compared against."""

    point: str = SQLField(primary_key=True)
    # A group id (``g-...``) or a run id (``r-...``).
    arm: str = SQLField(index=True)
    model: str
    created_at: datetime = SQLField(default_factory=utcnow)


class Sweep(SQLModel, table=True):
    """A grid of runs over one base spec, kept together."""

    id: str = SQLField(primary_key=True)
    base: dict[str, Any] = SQLField(sa_column=Column(JSON, nullable=False))
    grid: dict[str, Any] = SQLField(sa_column=Column(JSON, nullable=False))
    created_at: datetime = SQLField(default_factory=utcnow, index=True)


class Sample(SQLModel, table=True):
    """One request's raw measurement, as the client saw it; one row per (run, index)."""

    __table_args__ = (Index(SAMPLE_UNIQUE_INDEX, "run_id", "index", unique=True),)

    id: int | None = SQLField(default=None, primary_key=True)
    run_id: str = SQLField(foreign_key="run.id", index=True)
    index: int
    prompt_len: int
    output_tokens: int
    ttft: float
    itl: list[float] = SQLField(sa_column=Column(JSON, nullable=False))
    latency: float
    start_time: float
    due_time: float | None = None
    sent_time: float | None = None
    success: bool
    error: str = ""
    generated_text: str = ""


class Worker(SQLModel, table=True):
    """A vLLM server the service started, or one registered from elsewhere (``external``).

    Statuses: a started server goes ``starting -> ready -> stopped | failed``; a
    registered one is ``unavailable`` or ``ready`` as its health probes say, until it
    is ``removed``.
    """

    id: str = SQLField(primary_key=True)
    key: str = SQLField(index=True)
    model: str
    engine: dict[str, Any] = SQLField(sa_column=Column(JSON, nullable=False))
    url: str
    port: int
    pid: int | None = None
    status: str = SQLField(default="starting", index=True)
    token_hash: str = SQLField(index=True)
    log_path: str
    gpus: str = ""
    kv_tokens: int | None = None
    runs_served: int = 0
    created_at: datetime = SQLField(default_factory=utcnow)
    ready_at: datetime | None = None
    stopped_at: datetime | None = None
    error: str | None = None
    external: bool = False
    vocab_size: int | None = None
    last_seen_at: datetime | None = None
    # CPU workers: {"env": the binding variables it ran with, "omp_cores", "reserved_cores"}.
    cpu_binding: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))
    # {"launch": {argv, env} as this service started it, "reported": what its connector
    # said of it (``WorkerProvenance``)}; see ``service.provenance``.
    provenance: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))


# --- public shapes --------------------------------------------------------------------


class Progress(BaseModel):
    """How far a run got."""

    completed: int
    failed: int
    total: int


class RunWarning(BaseModel):
    """Something that makes a run's numbers mean less than they seem, with the figure that shows it."""

    code: str
    message: str
    figure: float | None = None


class RunPublic(BaseModel):
    """A run as the API returns it."""

    id: str
    spec: dict[str, Any]
    status: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    worker_id: str | None
    progress: Progress
    summary: dict[str, Any] | None
    connector: dict[str, Any] | None
    warnings: list[RunWarning]
    cpu_binding: dict[str, Any] | None
    stopped_by: dict[str, Any] | None = None
    error: str | None
    sweep_id: str | None = None
    group_id: str | None = None
    trial: int | None = None
    provenance: dict[str, Any] | None = None

    @classmethod
    def of(cls, run: Run) -> RunPublic:
        """Build from a table row."""
        connector = connector_totals((run.connector or {}).get("ranks", {}))
        connector["pulls"] = run.connector_pulls
        return cls(
            id=run.id,
            spec=run.spec,
            status=run.status,
            created_at=run.created_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
            worker_id=run.worker_id,
            progress=Progress(completed=run.completed, failed=run.failed, total=run.total),
            summary=run.summary,
            connector=connector,
            warnings=[RunWarning(**w) for w in run.warnings or []],
            cpu_binding=run.cpu_binding,
            stopped_by=run.stopped_by,
            error=run.error,
            sweep_id=run.sweep_id,
            group_id=run.group_id,
            trial=run.trial,
            provenance=run.provenance,
        )


class RunList(BaseModel):
    """A page of runs."""

    runs: list[RunPublic]
    total: int
    limit: int
    offset: int


class SamplePublic(BaseModel):
    """One request's raw sample (seconds, client clock)."""

    index: int
    prompt_len: int
    output_tokens: int
    ttft: float
    itl: list[float]
    latency: float
    start_time: float
    due_time: float | None
    sent_time: float | None
    success: bool
    error: str
    generated_text: str


class WorkerPublic(BaseModel):
    """A vLLM server as the API returns it."""

    id: str
    model: str
    engine: dict[str, Any]
    url: str
    pid: int | None
    status: str
    external: bool
    gpus: str
    kv_tokens: int | None
    runs_served: int
    created_at: datetime
    ready_at: datetime | None
    last_seen_at: datetime | None
    stopped_at: datetime | None
    error: str | None
    log_path: str
    cpu_binding: dict[str, Any] | None = None
    provenance: dict[str, Any] | None = None


_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*|[0-9A-Fa-f:.]+)$")


def _base_url(value: str) -> str:
    """An http(s) base URL without credentials, query or fragment, with no trailing slash."""
    problem = (
        "must be an http:// or https:// base URL such as http://10.0.0.5:8000 "
        "(no user, query or fragment)"
    )
    if any(c.isspace() or not c.isprintable() for c in value) or "?" in value or "#" in value:
        raise ValueError(problem)
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or parts.username is not None or not parts.hostname:
        raise ValueError(problem)
    if not _HOST.match(parts.hostname):
        raise ValueError(f"{parts.hostname!r} is not a host name or IP address")
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when asked
    except ValueError as exc:
        raise ValueError(f"bad port: {exc}") from exc
    return value.rstrip("/")


def worker_key(model: str, engine: EngineSpec) -> str:
    """Runs and servers with equal keys belong together: one model, one engine configuration."""
    config = engine.model_dump(exclude={"load_format"})
    # The load format is in the key only where it changes the server: the tiny model loads
    # dummy weights whatever is asked, and keys stored before the field existed (registered
    # servers) still match runs with real weights.
    if effective_load_format(model, engine.load_format) != effective_load_format(model):
        config["load_format"] = engine.load_format
    return json.dumps({"model": model, "engine": config}, sort_keys=True)


class WorkerRegister(Strict):
    """A vLLM server started elsewhere (a pod, a Slurm job, another host), to be driven
    by this service; it must load the connector with the token this call returns."""

    url: str = Field(max_length=512, description="Base URL of the vLLM server, as this service reaches it")
    model: str = Field(
        min_length=1, max_length=512,
        description="The model name the server serves (its --served-model-name); runs ask for it",
    )
    engine: EngineSpec = Field(default_factory=EngineSpec)
    vocab_size: Int | None = Field(
        default=None, ge=16, le=1 << 24,
        description="Prompt token ids are drawn below this; default 32000 (8192 for the tiny model)",
    )
    control_url: str | None = Field(
        default=None, max_length=512,
        description="This service's URL as the server's host reaches it, for the command shown",
    )
    token: str | None = Field(
        default=None, min_length=32, max_length=256, pattern=r"^[A-Za-z0-9._~+/=-]+$",
        description="A worker token you chose (e.g. from a Kubernetes Secret); made for you if left out",
    )

    @field_validator("url", "control_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else _base_url(value)

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        if value != TINY_MODEL_NAME and ("://" in value or ".." in value or not _REPO_ID.match(value)):
            raise ValueError(
                "model must be the name the server serves: a Hugging Face repo id like 'org/name' "
                "or a bare name (start the server with --served-model-name NAME)"
            )
        return value

    def worker_key(self) -> str:
        """The key of the runs this server can take."""
        return worker_key(self.model, self.engine)


class WorkerRegistered(WorkerPublic):
    """A registered worker, with what its vLLM server must be started with (shown once)."""

    token: str
    kv_transfer_config: dict[str, Any]
    vllm_serve: str


MAX_SWEEP_RUNS = 256
# Fields a sweep may vary; dotted names reach into nested specs.
SWEEP_KEYS = ("input_len", "output_len", "max_concurrency", "request_rate", "mode", "fill.mean",
              "fill.std")


class SweepGrid(Strict):
    """The values to sweep, per field; dotted names reach into nested specs."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    input_len: list[bounded_int(1, MAX_INPUT_LEN)] | None = Field(  # type: ignore[valid-type]
        default=None, min_length=1, max_length=64)
    output_len: list[bounded_int(1, MAX_OUTPUT_LEN)] | None = Field(  # type: ignore[valid-type]
        default=None, min_length=1, max_length=64)
    max_concurrency: list[bounded_int(1, 100_000) | None] | None = Field(  # type: ignore[valid-type]
        default=None, min_length=1, max_length=64)
    request_rate: list[Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)] | None] | None = (
        Field(default=None, min_length=1, max_length=64))
    mode: list[Literal["fill", "prefill"]] | None = Field(default=None, min_length=1, max_length=2)
    fill_mean: list[Annotated[float, Field(ge=-1e4, le=1e4, allow_inf_nan=False)]] | None = Field(
        default=None, min_length=1, max_length=64, alias="fill.mean")
    fill_std: list[Annotated[float, Field(ge=0, le=1e4, allow_inf_nan=False)]] | None = Field(
        default=None, min_length=1, max_length=64, alias="fill.std")

    def axes(self) -> dict[str, list[Any]]:
        """The swept fields by their spec names, in declaration order."""
        return self.model_dump(by_alias=True, exclude_none=True)


class SweepCreate(Strict):
    """A base spec and the values to sweep; one run per point of the grid."""

    base: RunSpec = Field(default_factory=RunSpec)
    grid: SweepGrid
    # Trials of every point; the same as ``base.repeats``, which it sets when given.
    repeats: Int | None = Field(default=None, ge=1, le=MAX_REPEATS)

    @model_validator(mode="after")
    def _grid(self) -> SweepCreate:
        axes = self.grid.axes()
        if not axes:
            raise ValueError(f"the grid sweeps nothing; sweepable: {', '.join(SWEEP_KEYS)}")
        if self.repeats is not None:
            if "repeats" in self.base.model_fields_set and self.base.repeats != self.repeats:
                raise ValueError(
                    f"repeats ({self.repeats}) and base.repeats ({self.base.repeats}) disagree: "
                    "give one of them")
            self.base = self.base.model_copy(update={"repeats": self.repeats})
        size = 1
        for values in axes.values():
            size *= len(values)
        if size * self.base.repeats > MAX_SWEEP_RUNS:
            raise ValueError(
                f"the grid makes {size} points x {self.base.repeats} repeats = "
                f"{size * self.base.repeats} runs, more than the cap of {MAX_SWEEP_RUNS}")
        return self

    def points(self) -> list[tuple[dict[str, Any], RunSpec]]:
        """Every grid point with its full spec; a point that is not a valid spec is a ValueError."""
        axes = self.grid.axes()
        keys = list(axes)
        out = []
        for combo in itertools.product(*(axes[k] for k in keys)):
            point = dict(zip(keys, combo, strict=True))
            data = self.base.model_dump()
            for key, value in point.items():
                target = data
                *parents, leaf = key.split(".")
                for parent in parents:
                    target = target[parent]
                target[leaf] = value
            try:
                out.append((point, RunSpec.model_validate(data)))
            except ValueError as exc:
                raise ValueError(f"grid point {point} is not a valid run: {exc}") from exc
        return out


class SweepPublic(BaseModel):
    """A sweep as the API returns it."""

    id: str
    base: dict[str, Any]
    grid: dict[str, Any]
    created_at: datetime
    progress: dict[str, int]
    runs: list[RunPublic]
    repeats: int = 1
    # One entry per point: ``{arm, point, runs, succeeded, figures: {key: {value, ci, cv, n,
    # method}}}`` (see ``service.comparison``).
    points: list[dict[str, Any]] = Field(default_factory=list)
    # Per point with both modes finished: fill/prefill of decode ITL and TPOT with verdicts.
    fill_vs_prefill: list[dict[str, Any]] = Field(default_factory=list)


class SweepSummary(BaseModel):
    """A sweep in a list: what it varies and how far its runs got."""

    id: str
    created_at: datetime
    model: str
    grid_keys: list[str]
    # Grid points, and runs (points x repeats).
    points: int
    runs: int
    repeats: int = 1
    # Its runs by status (only the statuses it has).
    status: dict[str, int]


class SweepList(BaseModel):
    """A page of sweeps."""

    sweeps: list[SweepSummary]
    total: int
    limit: int
    offset: int


class GroupPublic(BaseModel):
    """The trials of one point (a run with ``repeats``) and every figure over them: the
    mean with a Student-t 95% interval and the CV with two or more succeeded trials."""

    id: str
    spec: dict[str, Any]
    runs: list[RunPublic]
    succeeded: int
    figures: dict[str, dict[str, Any] | None]


Counter = Annotated[float, Field(ge=0, le=1e18, allow_inf_nan=False)]


class RunCounters(Strict):
    """One run's cumulative counters from one connector side."""

    requests_seen: Counter | None = None
    filled_requests: Counter | None = None
    prefill_requests: Counter | None = None
    cached_requests: Counter | None = None
    unresolved_requests: Counter | None = None
    dropped_requests: Counter | None = None
    recomputed_requests: Counter | None = None
    waited_requests: Counter | None = None
    error: Annotated[str, Field(max_length=1000)] | None = None
    requests_filled: Counter | None = None
    blocks_filled: Counter | None = None
    bytes_filled: Counter | None = None
    fill_seconds: Counter | None = None


class ConnectorReport(Strict):
    """Cumulative counters one connector side (role, rank) keeps per run."""

    role: Literal["scheduler", "worker"]
    rank: Int = Field(ge=0, le=1024)
    runs: dict[Annotated[str, Field(max_length=64)], RunCounters] = Field(max_length=4096)

    def counters(self) -> dict[str, dict[str, float | str]]:
        """Per run, the counters that were sent."""
        return {run: c.model_dump(exclude_none=True) for run, c in self.runs.items()}


SCHEDULER_COUNTERS = ("requests_seen", "filled_requests", "prefill_requests", "cached_requests",
                      "unresolved_requests", "dropped_requests", "recomputed_requests",
                      "waited_requests")


def connector_totals(ranks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One run's connector report. The scheduler side decides per request (its counters
    add up); every worker rank fills the same blocks of its own heads, so requests and
    blocks are per rank: ``requests_filled`` is the rank that filled fewest (a rank that
    missed a fill shows), bytes add up, and time is the slowest rank's.
    ``other_requests`` (not treated as the run's mode says) must be 0 for a run to succeed."""
    workers = [c for key, c in ranks.items() if key.startswith("worker:")]
    schedulers = [c for key, c in ranks.items() if key.startswith("scheduler:")]
    total: dict[str, Any] = {}
    for name in SCHEDULER_COUNTERS:
        total[name] = int(sum(c.get(name, 0) for c in schedulers))
    total["other_requests"] = total["unresolved_requests"] + total["dropped_requests"]
    total["requests_filled"] = int(min((c.get("requests_filled", 0) for c in workers), default=0))
    total["blocks_filled"] = int(max((c.get("blocks_filled", 0) for c in workers), default=0))
    total["bytes_filled"] = int(sum(c.get("bytes_filled", 0) for c in workers))
    total["fill_seconds"] = max((c.get("fill_seconds", 0.0) for c in workers), default=0.0)
    total["worker_ranks"] = len(workers)
    errors = [str(c["error"]) for c in schedulers if c.get("error")]
    total["error"] = errors[0] if errors else None
    return total


Scalar = str | int | float | bool | None


class WorkerProvenance(BaseModel):
    """What a worker's connector reports of the server it runs in, once at its start (see
    ``connector.provenance``). Fields a newer connector adds are ignored, not refused."""

    model_config = ConfigDict(extra="ignore")

    versions: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=200)] | None] = (
        Field(default_factory=dict, max_length=32))
    engine: dict[Annotated[str, Field(max_length=64)], Scalar] = Field(default_factory=dict, max_length=128)
    kv_cache: dict[Annotated[str, Field(max_length=64)], Scalar] = Field(default_factory=dict, max_length=32)
    hardware: dict[Annotated[str, Field(max_length=64)], Any] = Field(default_factory=dict, max_length=32)
    argv: list[Annotated[str, Field(max_length=8192)]] = Field(default_factory=list, max_length=512)
    env: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=256)


class FillAnswer(BaseModel):
    """What the connector pulls for one run."""

    run_id: str
    mode: Literal["fill", "prefill"]
    mean: float
    std: float


# --- server metrics (vLLM's /metrics, scraped during a run) -----------------------------

SERVER_POINT_INDEX = "uq_server_metric_point_run_t"


class ServerMetricPoint(SQLModel, table=True):
    """One scrape of a run's vLLM server, ``t`` in seconds on the clock of the run's samples
    (``time.perf_counter``, where the runner puts it), ``values`` as ``server_metrics.parse``
    keeps them."""

    # Unique: a point handed over twice (a periodic save that resends) is stored once.
    __table_args__ = (Index(SERVER_POINT_INDEX, "run_id", "t", unique=True),)

    id: int | None = SQLField(default=None, primary_key=True)
    run_id: str = SQLField(foreign_key="run.id")
    t: float
    values: dict[str, float] = SQLField(sa_column=Column(JSON, nullable=False))


class ServerPointPublic(BaseModel):
    """One scrape: seconds since the run's first scrape, and the values kept."""

    t: float
    values: dict[str, float]


class ServerMetricsSummary(BaseModel):
    """Counter deltas over the run (null: the counter went down, the server restarted),
    gauge max and time-weighted mean, how many points and the seconds they span."""

    deltas: dict[str, float | None]
    max: dict[str, float]
    mean: dict[str, float]
    points: int
    span_s: float


class ServerMetricsPublic(BaseModel):
    """The server's own view of a run, as scraped from its ``/metrics``."""

    run_id: str
    points: list[ServerPointPublic]
    summary: ServerMetricsSummary
