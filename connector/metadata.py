"""The per-step metadata passed from the scheduler side to the worker side (pickled)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnectorMetadata,
)

from connector.steps import StepInfo


@dataclass
class FillConnectorMetadata(DecodeBenchConnectorMetadata):  # type: ignore[misc]
    """vLLM's blocks-to-fill per request, plus each request's (mean, std)."""

    # request_id -> (mean, std); a request missing here uses the worker's defaults.
    fill_values: dict[str, tuple[float, float]] = field(default_factory=dict)
    # request_id -> decodebench run id, for the per-run fill report.
    run_ids: dict[str, str] = field(default_factory=dict)
    # What this engine step holds, for the worker side's step clock (None: nothing computed).
    step: StepInfo | None = None
