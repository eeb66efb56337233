"""Engine steps timed where they happen: what each step held, and how long its forward took.

The scheduler side (``StepTracker``) sees every step's ``SchedulerOutput`` as it builds the
connector metadata: it numbers the step and counts what it holds, and sends that to the
workers in the metadata (``StepInfo``). The worker side (``StepClock``) brackets the forward
pass between the two hooks vLLM calls around it, ``bind_connector_metadata`` before and
``wait_for_save`` after, less the time this connector's own fill took in ``start_load_kv``
(which vLLM calls inside the bracket). On a CPU that is the monotonic clock; on CUDA three
pairs of events recorded on the current stream, read once they are done (``query``), never
with a synchronisation, so the engine's asynchronous launches stay asynchronous. Only TP
rank 0 times and reports (every rank runs the same steps).

A request *decodes* in a step when at most its last prompt token is left to compute and the
step computes one token of it (plus its speculative tokens): a filled request's first step,
which computes its last prompt token over the filled KV, is a decode step, as is one whose
prompt came from the prefix cache. Anything else a step computes is prompt (prefill) tokens.
A request's first decode step is counted as ``first``. A step's KV tokens are what its
attention reads: the computed plus scheduled tokens of every request in it.

The rows go to the service in the order of ``STEP_FIELDS``; the service reads them in the
same order (``service.core.steps.STEP_FIELDS``, held equal by a test).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

STEP_FIELDS = ("step", "decode_requests", "prefill_tokens", "kv_tokens", "first", "forward_ms")
# CUDA steps launched but not yet done, at most: a step whose events stay pending past this
# (a stream that never drains) is dropped and counted, never waited for.
MAX_PENDING_EVENTS = 1024


@dataclass(frozen=True)
class StepInfo:
    """What one engine step held (picklable: it travels in the connector metadata)."""

    step: int
    # The run every request of the step belongs to; None for a step that mixes runs or
    # holds untagged requests (it is not reported).
    run_id: str | None
    decode_requests: int
    prefill_tokens: int
    kv_tokens: int
    first: int

    def row(self, forward_ms: float) -> list[float]:
        return [self.step, self.decode_requests, self.prefill_tokens, self.kv_tokens, self.first,
                round(forward_ms, 4)]


class StepTracker:
    """The scheduler side: numbers steps and counts what each holds."""

    def __init__(self) -> None:
        self.step = 0
        self._prompt_len: dict[str, int] = {}
        self._run: dict[str, str | None] = {}
        self._decoded: set[str] = set()
        # The runs of the last step observed, when it mixed runs (or untagged requests).
        self.shared: frozenset[str] = frozenset()

    def admitted(self, request: Request, run_id: str | None) -> None:
        """A request was scheduled from the waiting queue (first time or after a preemption)."""
        self._prompt_len[request.request_id] = int(request.num_prompt_tokens)
        self._run[request.request_id] = run_id

    def finished(self, req_id: str) -> None:
        self._prompt_len.pop(req_id, None)
        self._run.pop(req_id, None)
        self._decoded.discard(req_id)

    def observe(self, out: SchedulerOutput) -> StepInfo | None:
        """The step ``out`` schedules; None when it computes nothing."""
        if not out.total_num_scheduled_tokens:
            return None
        self.step += 1
        scheduled = out.num_scheduled_tokens
        spec = out.scheduled_spec_decode_tokens
        cached = out.scheduled_cached_reqs
        prompt_len, run_of, decoded = self._prompt_len, self._run, self._decoded
        decode = prefill = kv = first = 0
        # The run of the step's first request; ``mixed`` once another (or none) shows.
        run_id: str | None = None
        seen = mixed = False
        new = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        for req_id, done in (*new, *zip(cached.req_ids, cached.num_computed_tokens, strict=False)):
            tokens = scheduled.get(req_id, 0)
            prompt = prompt_len.get(req_id)
            run = run_of.get(req_id)
            if not seen:
                run_id, seen = run, True
            elif run != run_id:
                mixed = True
            kv += done + tokens
            if prompt is not None and done >= prompt - 1 and (
                    tokens == 1 or tokens <= 1 + len(spec.get(req_id, ()))):
                decode += 1
                if req_id not in decoded:
                    decoded.add(req_id)
                    first += 1
            else:
                prefill += tokens
        if mixed:
            run_id = None
            self.shared = frozenset(
                r for r in map(run_of.get, (*(n for n, _ in new), *cached.req_ids)) if r is not None)
        else:
            self.shared = frozenset()
        return StepInfo(self.step, run_id, decode, prefill, kv, first)


class StepClock:
    """The worker side: times each step's forward pass and hands finished rows to ``sink``
    (``sink(run_id, row)``); ``dropped(run_id)`` counts a step it could not time."""

    def __init__(self, sink: Any, dropped: Any, device: Any = None) -> None:
        self.sink = sink
        self.dropped = dropped
        # torch.device of the caches: "cuda" times with events, anything else with the clock.
        self.cuda = device is not None and getattr(device, "type", None) == "cuda"
        self._info: StepInfo | None = None
        self._t0 = 0.0
        self._load_s = 0.0
        self._load_t0 = 0.0
        self._events: dict[str, Any] = {}
        self._pending: deque[tuple[StepInfo, dict[str, Any]]] = deque()

    def begin(self, info: StepInfo | None) -> None:
        """``bind_connector_metadata``: the step's forward is about to run."""
        if self.cuda:
            self._collect()
        self._info = info if info is not None and info.run_id is not None else None
        if self._info is None:
            return
        self._load_s = 0.0
        if self.cuda:
            self._events = {"start": self._record()}
        else:
            self._t0 = time.perf_counter()

    def load_begin(self) -> None:
        """``start_load_kv`` begins: this connector's fill, not the model's forward."""
        if self._info is None:
            return
        if self.cuda:
            self._events["load_start"] = self._record()
        else:
            self._load_t0 = time.perf_counter()

    def load_end(self) -> None:
        if self._info is None:
            return
        if self.cuda:
            self._events["load_end"] = self._record()
        else:
            self._load_s += time.perf_counter() - self._load_t0

    def end(self) -> None:
        """``wait_for_save``: the step's forward has run (on CUDA: has been launched)."""
        info, self._info = self._info, None
        if info is None:
            return
        if not self.cuda:
            self.sink(info.run_id, info.row((time.perf_counter() - self._t0 - self._load_s) * 1e3))
            return
        self._events["end"] = self._record()
        self._pending.append((info, self._events))
        self._events = {}
        while len(self._pending) > MAX_PENDING_EVENTS:
            lost, _ = self._pending.popleft()
            self.dropped(lost.run_id)
        self._collect()

    def flush(self) -> None:
        """Hand over every CUDA step already done (the rest stay pending)."""
        if self.cuda:
            self._collect()

    @staticmethod
    def _record() -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _collect(self) -> None:
        """Rows of the oldest pending steps whose last event is done, in step order."""
        while self._pending and self._pending[0][1]["end"].query():
            info, events = self._pending.popleft()
            ms = events["start"].elapsed_time(events["end"])
            if "load_start" in events and "load_end" in events:
                ms -= events["load_start"].elapsed_time(events["load_end"])
            self.sink(info.run_id, info.row(ms))
