"""Engine steps as the connector timed them: one record per forward pass of a run's server.

The connector's scheduler side knows what each engine step held (its number on the server,
the requests decoding, the prompt tokens computed, the KV tokens its attention reads, the
requests in their first decode step); its worker side times the forward pass. TP rank 0
reports them, per run, as rows of ``STEP_FIELDS`` (``ConnectorReport.steps``). The store
keeps a run's first ``MAX_STEP_ROWS`` steps as they are and bins the rest
(``StepRow.count`` > 1: the means of the steps it stands for), so a long run's memory is
bounded.

A step is one of three kinds, and only ``decode`` steps fit the step model:

- ``prefill``: it computed prompt tokens (a real prefill, or a prefill chunk beside decodes);
- ``first``: no prompt tokens, but a request's first decode step (after its fill, its
  prefill or its prefix-cache hit: the KV it reads arrived just now);
- ``decode``: every request in it was decoding, none for the first time.

A request *decodes* in a step when at most its last prompt token is left to compute: a
filled request's first step computes that one token over the filled KV, as a decode does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The order of a step row's numbers on the wire (``ConnectorReport.steps``).
STEP_FIELDS = ("step", "decode_requests", "prefill_tokens", "kv_tokens", "first", "forward_ms")
# Per run, steps stored one by one before the rest are binned.
MAX_STEP_ROWS = 20_000
# Most step rows one report may carry for one run.
MAX_REPORT_STEPS = 20_000

StepKind = Literal["decode", "first", "prefill"]
KINDS: tuple[StepKind, ...] = ("decode", "first", "prefill")


def step_kind(prefill_tokens: float, first: float) -> StepKind:
    """What a step was, from what it held."""
    if prefill_tokens > 0:
        return "prefill"
    return "first" if first > 0 else "decode"


@dataclass(frozen=True)
class StepRow:
    """One engine step of a run, or (``count`` > 1) a bin of steps of one kind and batch
    with nearby KV tokens: then every figure is the mean over its steps, ``step`` the last
    of them and ``forward_ms_var`` their variance."""

    step: int
    decode_requests: int
    prefill_tokens: float
    kv_tokens: float
    first: float
    forward_ms: float
    count: int = 1
    forward_ms_var: float = 0.0

    @property
    def kind(self) -> StepKind:
        return step_kind(self.prefill_tokens, self.first)

    @classmethod
    def from_wire(cls, row: list[float]) -> StepRow:
        step, decode, prefill, kv, first, ms = row
        return cls(step=int(step), decode_requests=int(decode), prefill_tokens=prefill,
                   kv_tokens=kv, first=first, forward_ms=ms)
