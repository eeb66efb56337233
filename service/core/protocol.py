"""The connector's wire protocol, service side: what the connector pulls (``FillAnswer``),
the counters it reports per run (``ConnectorReport``) and how they add up over ranks
(``connector_totals``), and what it reports of the server it runs in (``WorkerProvenance``).
The connector speaks the same JSON from its side (``connector.params``, ``connector.report``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from service.core.spec import Int, Strict
from service.core.steps import MAX_REPORT_STEPS, STEP_FIELDS, StepRow

Counter = Annotated[float, Field(ge=0, le=1e18, allow_inf_nan=False)]
# One engine step on the wire: its numbers in the order of ``steps.STEP_FIELDS``.
StepWire = Annotated[list[Annotated[float, Field(ge=0, le=1e15, allow_inf_nan=False)]],
                     Field(min_length=len(STEP_FIELDS), max_length=len(STEP_FIELDS))]


class RunCounters(Strict):
    """One run's cumulative counters from one connector side."""

    requests_seen: Counter | None = None
    filled_requests: Counter | None = None
    prefill_requests: Counter | None = None
    seeding_requests: Counter | None = None
    cached_requests: Counter | None = None
    unresolved_requests: Counter | None = None
    dropped_requests: Counter | None = None
    recomputed_requests: Counter | None = None
    waited_requests: Counter | None = None
    # Requests of the run that finished (or were aborted); engine steps that held only the
    # run's requests (the worker times those), and steps it shared with other requests
    # (not timed: their time is not the run's alone). The scheduler side, with step timing.
    requests_finished: Counter | None = None
    steps_tagged: Counter | None = None
    steps_shared: Counter | None = None
    error: Annotated[str, Field(max_length=1000)] | None = None
    requests_filled: Counter | None = None
    blocks_filled: Counter | None = None
    bytes_filled: Counter | None = None
    fill_seconds: Counter | None = None
    # Blocks filled per KV cache group (its index as a string, JSON's key type).
    group_blocks: dict[Annotated[str, Field(pattern=r"^[0-9]{1,4}$")], Counter] | None = Field(
        default=None, max_length=256)
    # Engine steps timed for the run, and steps the connector could not keep (its buffer
    # full while the service did not answer): the worker side of TP rank 0.
    steps_timed: Counter | None = None
    steps_dropped: Counter | None = None


class ConnectorReport(Strict):
    """Cumulative counters one connector side (role, rank) keeps per run."""

    role: Literal["scheduler", "worker"]
    rank: Int = Field(ge=0, le=1024)
    runs: dict[Annotated[str, Field(max_length=64)], RunCounters] = Field(max_length=4096)
    # Engine steps timed since the last report, per run: rows of ``steps.STEP_FIELDS``.
    steps: dict[Annotated[str, Field(max_length=64)],
                Annotated[list[StepWire], Field(max_length=MAX_REPORT_STEPS)]] | None = Field(
        default=None, max_length=4096)

    def counters(self) -> dict[str, dict[str, Any]]:
        """Per run, the counters that were sent."""
        return {run: c.model_dump(exclude_none=True) for run, c in self.runs.items()}

    def step_rows(self) -> dict[str, list[StepRow]]:
        """Per run, the steps that were sent."""
        return {run: [StepRow.from_wire(row) for row in rows] for run, rows in (self.steps or {}).items()}


SCHEDULER_COUNTERS = ("requests_seen", "filled_requests", "prefill_requests", "seeding_requests",
                      "cached_requests",
                      "unresolved_requests", "dropped_requests", "recomputed_requests",
                      "waited_requests", "requests_finished", "steps_tagged", "steps_shared")


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
    groups: dict[str, int] = {}
    for c in workers:
        for index, blocks in (c.get("group_blocks") or {}).items():
            groups[index] = max(groups.get(index, 0), int(blocks))
    total["group_blocks"] = dict(sorted(groups.items(), key=lambda kv: int(kv[0])))
    total["worker_ranks"] = len(workers)
    # Engine steps timed (TP rank 0 times them) and lost before the service had them.
    total["steps_timed"] = int(sum(c.get("steps_timed", 0) for c in workers))
    total["steps_dropped"] = int(sum(c.get("steps_dropped", 0) for c in workers))
    errors = [str(c["error"]) for c in schedulers if c.get("error")]
    total["error"] = errors[0] if errors else None
    return total


Scalar = str | int | float | bool | None


Bytes = Annotated[int, Field(ge=0, le=10**16)]
Rate = Annotated[float, Field(gt=0, le=1e16, allow_inf_nan=False)]
Words = Annotated[str, Field(max_length=500)]


class Bandwidth(BaseModel):
    """One device's memory bandwidth: as measured at the server's start (``how``: by what),
    the rate of the connector's own fills, and the specified one where the device is known."""

    model_config = ConfigDict(extra="ignore")

    measured_bytes_per_s: Rate
    how: Words = ""
    fill_bytes_per_s: Rate | None = None
    spec_bytes_per_s: Rate | None = None
    spec_how: Words | None = None


class WindowedKV(BaseModel):
    """The KV bytes per token of the layers that attend over a window: a step reads at most
    ``window`` tokens of them (``sliding``), or those of the current chunk (``chunked``)."""

    model_config = ConfigDict(extra="ignore")

    kind: Literal["sliding", "chunked"]
    window: Annotated[int, Field(ge=1, le=1 << 40)]
    bytes_per_token: Bytes


class RooflineFacts(BaseModel):
    """What a decode step must read, per tensor-parallel rank, and how fast one device reads
    it (``service.analysis.roofline``)."""

    model_config = ConfigDict(extra="ignore")

    weight_bytes: Bytes
    weight_params: Bytes
    kv_bytes_per_token: Bytes
    kv_dtype: Words
    weight_dtype: Words
    tensor_parallel_size: Annotated[int, Field(ge=1, le=1024)]
    bandwidth: Bandwidth
    device: Words
    # A mixture of experts: the routed experts' share of ``weight_bytes``, of which a step
    # reads only the experts its tokens go to (``service.analysis.roofline``).
    expert_weight_bytes: Bytes | None = None
    num_experts: Annotated[int, Field(ge=1, le=1 << 16)] | None = None
    experts_per_token: Annotated[int, Field(ge=1, le=1 << 16)] | None = None
    # The part of ``kv_bytes_per_token`` in windowed layers (sliding, chunked local), and the
    # fixed state one sequence holds (Mamba, gated DeltaNet): absent where the model has none.
    windowed_kv: Annotated[list[WindowedKV], Field(max_length=64)] | None = None
    state_bytes_per_sequence: Bytes | None = None


class KVCacheGroup(BaseModel):
    """One KV cache group of a server, as its connector saw it: the kind of its layers
    (``FullAttention``, ``SlidingWindow``, ``Mamba``, ...), and how the connector fills its
    blocks: ``at start`` (startup fill), ``per request``, or ``zeroed per request``."""

    model_config = ConfigDict(extra="ignore")

    index: Annotated[int, Field(ge=0, le=1024)]
    kind: Words
    block_size: Annotated[int, Field(ge=1, le=1 << 24)] | None = None
    sliding_window: Annotated[int, Field(ge=1, le=1 << 30)] | None = None
    layers: Annotated[int, Field(ge=0, le=100_000)]
    fill: Literal["at start", "per request", "zeroed per request"]


class WorkerProvenance(BaseModel):
    """What a worker's connector reports of the server it runs in, once at its start (see
    ``connector.provenance``). Each side sends its part: the scheduler side everything but
    ``roofline``, TP rank 0 of the worker side only ``roofline`` (``connector.roofline``:
    weight bytes and parameters read per decode step, KV bytes per token, measured and rated
    bandwidth); the service merges the parts it was sent. Fields a newer connector adds are
    ignored, not refused."""

    model_config = ConfigDict(extra="ignore")

    versions: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=200)] | None] = (
        Field(default_factory=dict, max_length=32))
    engine: dict[Annotated[str, Field(max_length=64)], Scalar] = Field(default_factory=dict, max_length=128)
    kv_cache: dict[Annotated[str, Field(max_length=64)], Scalar] = Field(default_factory=dict, max_length=32)
    hardware: dict[Annotated[str, Field(max_length=64)], Any] = Field(default_factory=dict, max_length=32)
    argv: list[Annotated[str, Field(max_length=8192)]] = Field(default_factory=list, max_length=512)
    env: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=256)
    kv_cache_groups: list[KVCacheGroup] = Field(default_factory=list, max_length=256)
    # Sizes and bandwidth for the run's roofline; left out of the record when not reported.
    roofline: RooflineFacts | None = Field(default=None, exclude_if=lambda v: v is None)

    @field_validator("roofline", mode="wrap")
    @classmethod
    def _roofline_or_none(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> RooflineFacts | None:
        # Facts that do not make sense are dropped, not the whole report with them.
        try:
            facts: RooflineFacts | None = handler(value)
        except ValidationError:
            return None
        return facts


class FillAnswer(BaseModel):
    """What the connector pulls for one run."""

    run_id: str
    mode: Literal["fill", "prefill", "seeded"]
    mean: float
    std: float
