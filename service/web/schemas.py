"""The shapes the REST API answers with (a table row, or a computed view of it)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
)

from service.analysis.metrics import measured
from service.core.protocol import connector_totals
from service.storage.tables import Run


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
    pair_id: str | None = None
    pair_order: int | None = None
    provenance: dict[str, Any] | None = None
    # The capacity search the run is a probe of.
    capacity_id: str | None = None

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
            summary=measured(run.summary),
            connector=connector,
            warnings=[RunWarning(**w) for w in run.warnings or []],
            cpu_binding=run.cpu_binding,
            stopped_by=run.stopped_by,
            error=run.error,
            sweep_id=run.sweep_id,
            group_id=run.group_id,
            trial=run.trial,
            pair_id=run.pair_id,
            pair_order=run.pair_order,
            provenance=run.provenance,
            capacity_id=run.capacity_id,
        )


class RunLive(BaseModel):
    """A run as a progress display follows it (``GET /api/runs/{id}/live``)."""
    id: str
    status: str
    completed: int
    failed: int
    total: int
    # Seconds since it started (to its end once it ended); null while queued.
    elapsed_s: float | None
    # Seconds left at the pace so far; null before the first request ends and once it ended.
    eta_s: float | None
    # Over the requests finished so far; null while none has a steady decode gap.
    decode_median_itl_ms: float | None
    decode_gaps: int
    error: str | None
    # While the run waits for its server: what for and how long ("starting vLLM server
    # w-...: 1m20s, loading weights"); null otherwise.
    waiting: str | None = None


class RunList(BaseModel):
    """A page of runs."""

    runs: list[RunPublic]
    total: int
    limit: int
    offset: int


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
    # The longest sequence (prompt plus output) it takes, as its /v1/models said.
    max_model_len: int | None = None
    runs_served: int
    created_at: datetime
    ready_at: datetime | None
    last_seen_at: datetime | None
    stopped_at: datetime | None
    error: str | None
    log_path: str
    cpu_binding: dict[str, Any] | None = None
    provenance: dict[str, Any] | None = None
    # "local", "registered" or "ray"; for "ray" the node Ray put it on.
    backend: str = "local"
    node: dict[str, Any] | None = None


class ClusterNode(BaseModel):
    """A host servers and drivers run on (a Ray node, or this machine)."""

    id: str
    address: str | None
    cpus: float | None
    gpus: float | None
    # False: a node that left the cluster while something of ours was on it.
    alive: bool
    servers: list[dict[str, Any]]
    drivers: list[dict[str, Any]]


class ClusterPublic(BaseModel):
    """Where servers and load drivers run (``GET /api/cluster``)."""

    backend: str
    nodes: list[ClusterNode]


class WorkerRegistered(WorkerPublic):
    """A registered worker, with what its vLLM server must be started with (shown once)."""

    token: str
    kv_transfer_config: dict[str, Any]
    vllm_serve: str


class SweepPublic(BaseModel):
    """A sweep as the API returns it."""

    id: str
    base: dict[str, Any]
    grid: dict[str, Any]
    created_at: datetime
    progress: dict[str, int]
    runs: list[RunPublic]
    repeats: int = 1
    # ``{"until_decided": {"max_pairs": n}}`` when the sweep runs pairs until decided.
    options: dict[str, Any] | None = None
    # One entry per point: ``{arm, point, runs, succeeded, figures: {key: {value, ci, cv, n,
    # method}}}`` (see ``service.analysis.comparison``).
    points: list[dict[str, Any]] = Field(default_factory=list)
    # Per point with both modes finished: fill/prefill of decode ITL and TPOT with verdicts,
    # the pairs, how many would decide (``needed``, ``more``) and a one-line ``line``.
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


class StepPoint(BaseModel):
    """One engine step of a run (``count`` > 1: a bin of steps, with their means)."""

    step: int
    kind: Literal["decode", "first", "prefill"]
    decode_requests: int
    kv_tokens: float
    forward_ms: float
    count: int = 1


class StepModelPublic(BaseModel):
    """A run's step model (``service.analysis.step_model``): forward time (ms) = ``fixed_ms``
    + ``ns_per_kv_token`` x KV tokens / 1e6 + ``ms_per_request`` x decode requests, fitted to
    its ``steps`` decode steps. Each figure is ``[value, lo, hi]`` (95%), or null where the run
    cannot tell it (``notes`` say why; ``batch``: where the batch never moved, the one
    ``fixed_ms`` holds at). ``first_step_ratio``: first steps' time over the model's
    prediction. ``points``: up to 2,000 decode steps and 500 first steps, evenly spaced."""

    steps: int
    first_steps: int
    prefill_steps: int
    fixed_ms: list[float] | None
    ns_per_kv_token: list[float] | None
    ms_per_request: list[float] | None
    first_step_ratio: list[float] | None
    batch: int | None = None
    prefill_ms: float | None = None
    scale_ms: float | None = None
    method: str
    notes: list[str]
    points: list[StepPoint]


class Figure(BaseModel):
    """A figure with its interval and the interval's confidence."""

    value: float
    ci: list[float]
    confidence: float


class CapacityProbe(BaseModel):
    """One concurrency a capacity search probed: its trials, its SLA figure (ms) with the
    interval of its latest look (``ci_ms`` null while nothing bounds it), and its verdict:
    ``pass``, ``fail``, ``undecided``, ``capped`` (the server ran fewer at once: ``capped``
    says why), ``refused`` (the batch does not fit the KV cache: ``refused`` gives the
    arithmetic), ``queued``, ``running``, ``failed`` or ``unmeasured``."""

    concurrency: int
    trials: int
    run_ids: list[str]
    # The group its trials share (``/groups/{id}`` shows them side by side).
    group_id: str | None = None
    figure_ms: float | None
    ci_ms: list[float] | None
    confidence: float | None
    verdict: str
    # "interval", or "point estimate" for a verdict at the trial cap.
    decided_by: str | None
    capped: str | None
    refused: str | None
    # Decode output tokens/s of one stream while it decodes (1 / the median full-batch TPOT)
    # and of the server (times ``concurrency``) at its latest look, 95% intervals: the
    # frontier's points, and what a planner sizes by. Null while nothing bounds the interval
    # (few full-batch waves, trials that drift apart).
    tokens_per_s_per_user: Figure | None = None
    tokens_per_s_per_server: Figure | None = None
    # Output tokens/s over the whole run divided by ``concurrency`` (mean over its succeeded
    # trials; null for a capped probe): what vLLM's ``plot_pareto`` calls tokens/s/user in
    # the vllm-sweep export. Below the decode rate: it counts time to first token and gaps.
    output_tokens_per_s_per_user: float | None = None
    # How its figure and verdict were found (the units, how drift between runs is carried).
    method: str | None = None
    # Independent units its latest look rests on (engine steps for ITL, waves for TPOT).
    units: int | None = None
    # A tail limit's attainment: the share of units meeting it with its bounds at
    # ``confidence`` ([share, lo, hi]), the share it must reach, and the units that could
    # show that share at all (every one of them meeting the limit).
    attainment: list[float] | None = None
    attainment_target: float | None = None
    units_needed: int | None = None
    # What a reader must know beside the figure: drift between its trials, too few units.
    notes: list[str] = Field(default_factory=list)


class ServersRatioPublic(BaseModel):
    """Decode servers per prefill server at one input length, with the formula's inputs:
    P = prefill_tokens_per_s / input_len requests/s a prefill server admits; D =
    max_concurrency / (output_len x mean TPOT) requests/s a decode server finishes at the
    boundary (request throughput: the mean TPOT, per trial, with a 95% Student-t interval
    over the boundary's trials); ``ratio`` = P / D. The prefill rate is ``given`` (exact:
    its range is one value) or ``measured`` (its range the bracket of the prefill search,
    its top null where the highest rate asked passed: at least). ``ratio_range`` carries
    P's range, D's interval and the boundary's own range (``concurrency_range``); a null
    top is open. No single confidence is stated for it (``confidence`` null):
    ``holds_if`` says what it rests on. ``sentence``: the answer in a planner's words."""

    sentence: str
    formula: str
    holds_if: str
    prefill_source: Literal["given", "measured"]
    prefill_tokens_per_s: float
    prefill_tokens_per_s_range: list[float | None]
    input_len: int
    prefill_requests_per_s: float
    prefill_requests_per_s_range: list[float | None]
    output_len: int
    max_concurrency: int
    concurrency_range: list[int]
    tpot_ms: Figure | None
    tpot_trials: int
    decode_requests_per_s: float
    decode_requests_per_s_range: list[float | None]
    ratio: float
    ratio_range: list[float | None]
    confidence: float | None = None


class PrefillProbe(BaseModel):
    """One request rate the prefill search ran: its runs (``run_id`` the latest, or the
    one that ended without numbers), the p99 TTFT (ms) over their requests pooled with its
    exact interval at the search's per-look ``confidence``, and its verdict (``pass``,
    ``fail``, ``undecided``: another run comes),
    or ``pending`` / ``failed`` (a run ended without numbers); ``decided_by``: the
    ``interval``, a ``backlog`` (TTFT climbed through a run: a queue that grows), or, at
    the trial cap, the ``point estimate``."""

    request_rate: float
    run_id: str
    run_ids: list[str]
    trials: int
    status: str
    p99_ttft_ms: float | None
    # Its top null where the requests are too few to bound a p99 at this confidence.
    ci_ms: list[float | None] | None
    confidence: float | None
    # How much TTFT rose through its steepest run (ms), with its 95% interval.
    climb_ms: list[float] | None
    verdict: str
    decided_by: str | None


class PrefillPublic(BaseModel):
    """The prefill side measured at one input length: real-prefill runs of one output
    token at rising request rates against a p99 TTFT limit. ``max_rate``: the highest
    rate that passed (requests/s); ``first_failing_rate``: the lowest that failed (null:
    none below the asked maximum, ``bound_reached``); prefill tokens/s per server is
    ``max_rate`` x input_len, given with the bracket up to the failing rate."""

    ttft_p99_max_ms: float
    # "measuring", "decided" or "stopped" (``error`` says why).
    state: str
    max_rate: float | None
    first_failing_rate: float | None
    bound_reached: bool
    tokens_per_s: float | None
    tokens_per_s_range: list[float] | None
    # Where the crossing lies by the verdicts that carry a confidence alone (intervals,
    # backlogs): wider than the bracket where point estimates decided; top null: open.
    sure_tokens_per_s_range: list[float | None] | None = None
    method: str
    statement: str
    probes: list[PrefillProbe]
    runs: int
    error: str | None


class CapacityContext(BaseModel):
    """One input length of a capacity search: the boundary found (or so far), how sure it
    is, its probes, the decode rates at the boundary, the runs it spent and its wall time."""

    input_len: int
    # "probing", "decided" or "stopped" (undecided; ``error`` says why).
    state: str
    decided: bool
    # The last passing concurrency (0: none passed) and the first failing one (null: none
    # failed below the bound).
    max_concurrency: int
    first_failing: int | None
    # What stopped the upward search: "sla" (a probe failed), or the bound it reached:
    # "max_concurrency", "kv_cache", "max_num_seqs", "capped", "refused"; and why.
    limited_by: str
    limit_reason: str
    # With this confidence the boundary lies in ``boundary_range`` (see ``statement``).
    confidence: float
    boundary_range: list[int]
    # The asked ceiling passed: the boundary is only bounded below (at least max_concurrency).
    at_least: bool = False
    decided_by_point_estimate: list[int]
    statement: str
    probes: list[CapacityProbe]
    # Decode output tokens/s at ``max_concurrency``: one stream's while it decodes (1 / its
    # median TPOT over the full-batch window) and the server's (max_concurrency streams),
    # 95% intervals; not output throughput / concurrency (``CapacityProbe``).
    tokens_per_s_per_user: Figure | None
    tokens_per_s_per_server: Figure | None
    # With a prefill rate (the query's, the search's, or the one it measured): decode
    # servers per prefill server.
    decode_servers_per_prefill_server: ServersRatioPublic | None = None
    # When the search measures the prefill side: what it found at this input length.
    prefill: PrefillPublic | None = None
    runs: int
    wall_s: float | None
    error: str | None


class Caveat(BaseModel):
    """A warning the runs of a capacity search carry: its code, its first message, and how
    many of the search's runs carry it."""

    code: str
    message: str
    runs: int


class CapacityPublic(BaseModel):
    """A capacity search as the API returns it."""

    id: str
    # queued, running, succeeded, failed or cancelled.
    status: str
    created_at: datetime
    finished_at: datetime | None
    base: dict[str, Any]
    input_lens: list[int]
    sla: dict[str, Any]
    max_concurrency: int | None
    max_runs: int
    # Fixed at its start: ceiling, trial cap, looks planned, confidence of each and of the answer.
    plan: dict[str, Any]
    runs: int
    wall_s: float | None
    error: str | None
    # What the probes ran on, in a line (model and its depth, dtype, weights, hardware),
    # and every warning its runs carry (once per code, with how many runs carry it): the
    # caveats travel with the answer.
    ran_on: str | None = None
    caveats: list[Caveat] = Field(default_factory=list)
    contexts: list[CapacityContext]


class CapacitySummary(BaseModel):
    """A capacity search in a list."""

    id: str
    status: str
    created_at: datetime
    model: str
    input_lens: list[int]
    sla: dict[str, Any]
    # Its runs by status (only the statuses it has).
    runs: dict[str, int]


class CapacityList(BaseModel):
    """A page of capacity searches."""

    searches: list[CapacitySummary]
    total: int
    limit: int
    offset: int


class FidelityRow(BaseModel):
    """The fidelity ledger of one model (``model`` null: of a family, pooling its models'
    rows): fill against real prefill on their step models at matched decode steps
    (``service.analysis.fidelity_ledger``). ``ratio`` is ``[value, lo, hi]`` of predicted
    step time fill/prefill, 95%; ``within_5pct`` True when the interval lies inside [0.95,
    1.05], False when wholly outside, null with ``decided`` false when it straddles an edge.
    ``runs``: the pairs' run ids (fill, prefill); ``sweep``: the sweep they came from
    (a model's newest with step timings). ``mape_median_itl_pct``: the client-side error,
    mean over pairs of |fill - prefill| / prefill of vLLM's median ITL, in percent.
    ``pairs_needed``: while undecided, about how many pairs would decide it at the spread
    between its pairs so far (null when decided, with one pair, or past 1000)."""

    model: str | None
    family: str
    sweep: str | None
    ratio: list[float] | None
    decided: bool
    within_5pct: bool | None
    runs: list[str]
    pairs: int
    pairs_needed: int | None = None
    mape_median_itl_pct: float | None
    method: str
    notes: list[str]


class ReferenceFigure(BaseModel):
    """A published figure the ledger's error can be set against: its source's, not ours."""

    source: str
    figure: str
    what: str


class FidelityPublic(BaseModel):
    """The fidelity ledger per model and per family, the band it decides against and the
    reference figures others publish."""

    band: list[float]
    models: list[FidelityRow]
    families: list[FidelityRow]
    reference: list[ReferenceFigure]
