"""Scheduler side: decides per request whether to fill, and with which values.

Builds on vLLM's ``DecodeBenchConnectorScheduler``, which already selects the
right blocks per KV cache group (prefix-cache hits, null blocks, circular
buffers). What we add: the run id in a request's ``kv_transfer_params`` picks
that run's parameters, pulled from the service; ``prefill`` runs claim no
tokens; and each request's values travel to the worker side in the metadata.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnectorScheduler,
)

from connector.metadata import FillConnectorMetadata
from connector.params import FillParams, ParamsClient
from connector.report import Reporter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

RUN_ID_KEY = "decodebench_run_id"


def run_id_of(request: Request) -> str | None:
    """The decodebench run a request belongs to, if it was tagged."""
    params = request.kv_transfer_params
    if isinstance(params, dict):
        run_id = params.get(RUN_ID_KEY)
        if isinstance(run_id, str) and run_id:
            return run_id
    return None


class FillConnectorScheduler(DecodeBenchConnectorScheduler):  # type: ignore[misc]
    """Per-run fill decisions on top of vLLM's block selection."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, kv_cache_config)
        config = vllm_config.kv_transfer_config
        self.params = ParamsClient(
            control_url=config.get_from_extra_config("control_url", None),
            token=config.get_from_extra_config("worker_token", None),
            default_mean=float(config.get_from_extra_config("fill_mean", 0.015)),
            default_std=float(config.get_from_extra_config("fill_std", 0.0)),
            timeout_s=float(config.get_from_extra_config("pull_timeout_s", 0.05)),
        )
        self.reporter = Reporter(
            config.get_from_extra_config("control_url", None),
            config.get_from_extra_config("worker_token", None),
            role="scheduler",
            rank=0,
        )
        # Parameters decided for a request, from its first look until it finishes.
        self._decided: dict[str, FillParams] = {}
        # Values of requests whose blocks were selected this step, for the metadata.
        self._pending_values: dict[str, tuple[float, float]] = {}
        self._pending_runs: dict[str, str] = {}

    def _params_for(self, request: Request) -> FillParams:
        decided = self._decided.get(request.request_id)
        if decided is None:
            decided = self.params.get(run_id_of(request))
            self._decided[request.request_id] = decided
        return decided

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens to fill for a new request: none for prefill runs, else as vLLM does."""
        if request.request_id in self._filled_requests:
            return 0, False
        if self._params_for(request).mode == "prefill":
            return 0, False
        result: tuple[int, bool] = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return result

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Select the blocks (vLLM's rules) and remember this request's values."""
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        params = self._decided.get(request.request_id)
        run_id = run_id_of(request)
        if request.request_id in self._pending_fills:
            mean, std = (params.mean, params.std) if params else (self.params.default.mean,
                                                                  self.params.default.std)
            self._pending_values[request.request_id] = (mean, std)
            if run_id is not None:
                self._pending_runs[request.request_id] = run_id
        if run_id is not None and params is not None:
            self.reporter.add(
                run_id,
                requests_seen=1,
                prefill_requests=int(params.mode == "prefill"),
                fallback_requests=int(params.source == "fallback"),
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FillConnectorMetadata:
        """Blocks to fill this step and the values for each request."""
        meta = FillConnectorMetadata(
            reqs_to_fill=dict(self._pending_fills),
            fill_values=dict(self._pending_values),
            run_ids=dict(self._pending_runs),
        )
        self._pending_fills.clear()
        self._pending_values.clear()
        self._pending_runs.clear()
        return meta

    def request_finished(self, request: Request) -> None:
        """Forget a finished (or aborted) request."""
        super().request_finished(request)
        self._decided.pop(request.request_id, None)
        self._pending_values.pop(request.request_id, None)
        self._pending_runs.pop(request.request_id, None)

    def tracked_requests(self) -> int:
        """How many requests the scheduler side holds state for (0 when idle)."""
        return len(self._decided) + len(self._filled_requests) + len(self._pending_fills)

    def shutdown(self) -> None:
        """Stop the pull threads and send the last report."""
        self.params.close()
        self.reporter.close()
