"""Scheduler side: decides per request whether to fill, and with which values.

Builds on vLLM's ``DecodeBenchConnectorScheduler``, which already selects the
right blocks per KV cache group (prefix-cache hits, null blocks, circular
buffers). What we add: the run id in a request's ``kv_transfer_params`` picks
that run's parameters, pulled from the service; ``prefill`` and ``seeded`` runs
claim no tokens; and each request's values travel to the worker side in the metadata.

A tagged request is never decided on values other than its run's. While the
run's pull is in flight, ``get_num_new_matched_tokens`` answers ``None`` (vLLM
0.32: "ask again later"), so the request waits in vLLM's queue and no other
request waits for it. When the values cannot be had (see ``connector.params``)
the request is not filled: vLLM prefills it, and the run is reported as
``unresolved`` with the reason, which fails it in the service.

Per run, every admitted request lands in exactly one of these counters:

- ``filled_requests``: filled with the run's values (mode ``fill``);
- ``prefill_requests``: left to vLLM's prefill or prefix cache (modes ``prefill``, ``seeded``);
- ``seeding_requests``: a seeded run's seeding pass (tagged ``decodebench_seeding``), left
  to vLLM's prefill as well, and counted apart from the run's measured requests;
- ``cached_requests``: nothing to fill, its prompt was in the run's own prefix
  cache (the run's ``cache_salt`` keeps other runs' blocks out);
- ``unresolved_requests``: the run's values could not be had; prefilled;
- ``dropped_requests``: a fill was claimed but vLLM did not take it (for example
  a request that skips the prefix cache); prefilled.

Re-admissions after a preemption are ``recomputed_requests`` (vLLM recomputes
them with a real prefill, as its own connector does); ``waited_requests`` counts
requests that waited for their run's values at least once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnectorScheduler,
)

from connector.metadata import FillConnectorMetadata
from connector.params import DEFAULT_ATTEMPT_TIMEOUT_S, DEFAULT_DEADLINE_S, FillParams, ParamsClient
from connector.provenance import build as build_provenance
from connector.report import Reporter
from connector.steps import StepTracker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

RUN_ID_KEY = "decodebench_run_id"
SEEDING_KEY = "decodebench_seeding"


def run_id_of(request: Request) -> str | None:
    """The decodebench run a request belongs to, if it was tagged."""
    params = request.kv_transfer_params
    if isinstance(params, dict):
        run_id = params.get(RUN_ID_KEY)
        if isinstance(run_id, str) and run_id:
            return run_id
    return None


def seeding(request: Request) -> bool:
    """Whether a request is of a seeded run's seeding pass (not measured)."""
    params = request.kv_transfer_params
    return isinstance(params, dict) and params.get(SEEDING_KEY) is True


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
            attempt_timeout_s=float(config.get_from_extra_config(
                "pull_attempt_timeout_s", DEFAULT_ATTEMPT_TIMEOUT_S)),
            deadline_s=float(config.get_from_extra_config("pull_deadline_s", DEFAULT_DEADLINE_S)),
        )
        self.reporter = Reporter(
            config.get_from_extra_config("control_url", None),
            config.get_from_extra_config("worker_token", None),
            role="scheduler",
            rank=0,
        )
        try:
            self.reporter.provenance(build_provenance(
                vllm_config, kv_cache_config, config.get_from_extra_config("worker_token", None)))
        except Exception:
            # What the server is must never stop it from serving: the runs then say unknown.
            log.exception("could not describe this server for the decodebench service")
        # Parameters decided for a request, from its first look until it finishes.
        self._decided: dict[str, FillParams] = {}
        # Tokens this side claimed for a request on its last look.
        self._claimed: dict[str, int] = {}
        # Requests admitted at least once (a second admission follows a preemption).
        self._admitted: set[str] = set()
        # Requests told to wait for their run's values at least once.
        self._waited: set[str] = set()
        # Values of requests whose blocks were selected this step, for the metadata.
        self._pending_values: dict[str, tuple[float, float]] = {}
        self._pending_runs: dict[str, str] = {}
        # What each engine step holds, for the worker side to time (``connector.steps``),
        # and per run how many steps it had alone (timed) and shared (not timed).
        self.steps = StepTracker()
        self.timing = bool(config.get_from_extra_config("step_timing", True))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens to fill for a new request: none for prefill runs and for runs whose
        values cannot be had, else as vLLM does; ``None`` while the run's values are
        on their way."""
        req_id = request.request_id
        if req_id in self._filled_requests:
            return 0, False  # re-admitted after a preemption: vLLM recomputes it
        params = self._decided.get(req_id)
        if params is None:
            params = self.params.lookup(run_id_of(request))
            if params is None:
                self._waited.add(req_id)
                return None, False
            self._decided[req_id] = params
        if params.mode != "fill":
            self._claimed[req_id] = 0
            return 0, False
        tokens, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._claimed[req_id] = tokens
        return tokens, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Select the blocks (vLLM's rules), remember this request's values, count it."""
        req_id = request.request_id
        readmitted = req_id in self._admitted
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        params = self._decided.get(req_id)
        run_id = run_id_of(request)
        if (self.startup_fill and num_external_tokens > 0 and req_id not in self._pending_fills
                and req_id in self._filled_requests):
            # Every group of this request was filled at start: nothing to write, but the
            # worker side still accounts for the request (no blocks, no bytes).
            self._pending_fills[req_id] = (tuple([] for _ in self.kv_cache_groups), num_external_tokens)
        if req_id in self._pending_fills:
            assert params is not None and params.mode == "fill", "a fill without the run's values"
            self._pending_values[req_id] = (params.mean, params.std)
            if run_id is not None:
                self._pending_runs[req_id] = run_id
        self._admitted.add(req_id)
        self.steps.admitted(request, run_id)
        if run_id is None or params is None:
            return
        if readmitted:
            self.reporter.add(run_id, recomputed_requests=1)
            return
        counts = {"requests_seen": 1, "waited_requests": int(req_id in self._waited)}
        if params.mode == "unresolved":
            counts["unresolved_requests"] = 1
            self.reporter.note(run_id, params.error)
        elif params.mode in ("prefill", "seeded"):
            # A seeded run's prompts come from vLLM's prefix cache (or its prefill while
            # seeding): the connector leaves them to vLLM.
            counts["seeding_requests" if seeding(request) else "prefill_requests"] = 1
        elif num_external_tokens > 0:
            counts["filled_requests"] = 1
        elif self._claimed.get(req_id, 0) == 0:
            counts["cached_requests"] = 1
        else:
            counts["dropped_requests"] = 1
            self.reporter.note(run_id, f"vLLM did not take the fill of request {req_id}; "
                               "it was prefilled")
        self.reporter.add(run_id, **counts)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FillConnectorMetadata:
        """Blocks to fill this step, the values for each request, and what the step holds."""
        meta = FillConnectorMetadata(
            reqs_to_fill=dict(self._pending_fills),
            fill_values=dict(self._pending_values),
            run_ids=dict(self._pending_runs),
            step=self.steps.observe(scheduler_output),
        )
        step = meta.step
        if self.timing and step is not None:
            if step.run_id is not None:
                self.reporter.add(step.run_id, steps_tagged=1)
            for run_id in self.steps.shared:
                self.reporter.add(run_id, steps_shared=1)
        self._pending_fills.clear()
        self._pending_values.clear()
        self._pending_runs.clear()
        return meta

    def request_finished(self, request: Request) -> None:
        """Forget a finished (or aborted) request."""
        super().request_finished(request)
        req_id = request.request_id
        self._decided.pop(req_id, None)
        self._claimed.pop(req_id, None)
        self._admitted.discard(req_id)
        self._waited.discard(req_id)
        self._pending_values.pop(req_id, None)
        self._pending_runs.pop(req_id, None)
        self.steps.finished(req_id)
        run_id = run_id_of(request)
        if run_id is not None:
            # The service reads a run's counters once its last request is done: send soon.
            self.reporter.add(run_id, requests_finished=1)
            self.reporter.soon()

    def tracked_requests(self) -> int:
        """How many requests the scheduler side holds state for (0 when idle)."""
        return (len(self._decided) + len(self._filled_requests) + len(self._pending_fills)
                + len(self._claimed) + len(self._admitted) + len(self._waited))

    def shutdown(self) -> None:
        """Stop the pull threads and send the last report."""
        self.params.close()
        self.reporter.close()
