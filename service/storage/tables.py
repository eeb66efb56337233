"""The database tables: runs, samples, sweeps, capacity searches, baselines, workers,
scraped server metrics."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Column, Index
from sqlmodel import Field as SQLField
from sqlmodel import SQLModel

from service.core.capacity import Sla
from service.core.capacity_records import SearchLooks, SearchPlan
from service.core.ids import utcnow
from service.core.status import RunStatus

# One stored sample per (run, request index); older databases get it in ``db.make_engine``.
SAMPLE_UNIQUE_INDEX = "uq_sample_run_index"


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
    # itl_ci_pct}``; see ``service.analysis.stopping``).
    stopped_by: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))
    idempotency_key: str | None = SQLField(default=None, unique=True)
    request_hash: str | None = None
    sweep_id: str | None = SQLField(default=None, index=True)
    # The trials of one point (``spec.repeats`` > 1) share a group id; ``trial`` counts from 0.
    group_id: str | None = SQLField(default=None, index=True)
    trial: int | None = None
    # The fill and the prefill trial of one sweep point that ran back to back share a pair
    # id; ``pair_order`` 0 ran first (the order is drawn per pair).
    pair_id: str | None = SQLField(default=None, index=True)
    pair_order: int | None = None
    # The capacity search the run is a probe of (``CapacitySearch``).
    capacity_id: str | None = SQLField(default=None, index=True)
    # ``point_key`` of the spec: runs of the same point, for baselines.
    point: str | None = SQLField(default=None, index=True)
    # The setup its numbers came from (see ``service.core.provenance.snapshot``), taken when it
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
    # ``{"until_decided": {"max_pairs": n}}``: run pairs until every point is decided.
    options: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))
    created_at: datetime = SQLField(default_factory=utcnow, index=True)


class CapacitySearch(SQLModel, table=True):
    """A capacity search: per input length, the largest concurrency whose SLA holds
    (``service.analysis.capacity``); its probes are runs with its ``capacity_id``."""

    __tablename__ = "capacity_search"

    id: str = SQLField(primary_key=True)
    # The run fields every probe shares (a ``RunSpec``), the input lengths and the SLA
    # (``{"metric", "max_ms"}``), as asked.
    base: dict[str, Any] = SQLField(sa_column=Column(JSON, nullable=False))
    input_lens: list[int] = SQLField(sa_column=Column(JSON, nullable=False))
    sla: dict[str, Any] = SQLField(sa_column=Column(JSON, nullable=False))
    max_concurrency: int | None = None
    max_runs: int
    # The plan fixed at its start (``capacity_records.SearchPlan``: ceiling, looks, confidence
    # per look, the prefill side's), read by ``read_plan``.
    plan: dict[str, Any] = SQLField(sa_column=Column(JSON, nullable=False))
    # Each probe's and prefill rate's latest look (``capacity_records.SearchLooks``), read by
    # ``read_looks``; and why input lengths stopped undecided, by input length.
    looks: dict[str, Any] = SQLField(default_factory=dict, sa_column=Column(JSON, nullable=False))
    ended: dict[str, Any] = SQLField(default_factory=dict, sa_column=Column(JSON, nullable=False))
    # "active" until it ends "succeeded" (every input length decided), "failed" or "cancelled".
    status: str = SQLField(default="active", index=True)
    error: str | None = None
    created_at: datetime = SQLField(default_factory=utcnow, index=True)
    finished_at: datetime | None = None

    # Its JSON columns as typed records, validated on each read (a ValueError when this
    # version cannot read them).

    def read_sla(self) -> Sla:
        """The latency limit as asked."""
        return Sla.model_validate(self.sla, strict=False)

    def read_plan(self) -> SearchPlan:
        """The plan fixed at its start."""
        return SearchPlan.read(self.plan)

    def read_looks(self) -> SearchLooks:
        """Every look it took so far."""
        return SearchLooks.read(self.looks)


class SampleRow(SQLModel, table=True):
    """A ``service.core.sample.Sample`` as stored: one row per (run, index)."""

    __tablename__ = "sample"

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
    # The longest sequence it takes, as its /v1/models said once it was ready (a started
    # server's: what vLLM fitted to its KV cache memory unless engine.max_model_len was given).
    max_model_len: int | None = None
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
    # said of it (``WorkerProvenance``)}; see ``service.control.provenance``.
    provenance: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))
    # Who runs it: "local" (a process group of this service), "registered" (started
    # elsewhere) or "ray" (a Ray actor on ``node``: {"id", "address", "gpu_ids"}).
    backend: str = SQLField(default="local", sa_column_kwargs={"server_default": "local"})
    node: dict[str, Any] | None = SQLField(default=None, sa_column=Column(JSON))


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


class StepTiming(SQLModel, table=True):
    """One engine step of a run's server as its connector timed it
    (``service.core.steps``): the first ``MAX_STEP_ROWS`` of a run, keyed by the step's
    number on the server, so a report sent twice is stored once."""

    __tablename__ = "step_timing"

    run_id: str = SQLField(foreign_key="run.id", primary_key=True)
    step: int = SQLField(primary_key=True)
    decode_requests: int
    prefill_tokens: int
    kv_tokens: int
    first: int
    forward_ms: float


class StepBin(SQLModel, table=True):
    """A run's steps past ``MAX_STEP_ROWS``, summed by kind, batch (decode requests) and
    KV tokens within 1% (``kv_bin``); ``last_step`` is the newest step in it, so a report
    sent again adds nothing."""

    __tablename__ = "step_bin"

    run_id: str = SQLField(foreign_key="run.id", primary_key=True)
    kind: str = SQLField(primary_key=True)
    decode_requests: int = SQLField(primary_key=True)
    kv_bin: int = SQLField(primary_key=True)
    count: int
    prefill_tokens_sum: float
    kv_tokens_sum: float
    first_sum: float
    forward_ms_sum: float
    forward_ms_sq_sum: float
    last_step: int
