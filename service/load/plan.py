"""What a run sends, planned before it starts: per request position (warmups first) its
input and output length, and the measured requests' arrival offsets; each prompt's ids.

Memory stays flat at any context length: a plan holds only lengths and arrival offsets
(numpy arrays); each prompt is drawn when its request is sent, from (seed, request
position), in fixed blocks (``Plan.prompt_blocks``). The same seed gives the same prompts
and schedule.

Arrivals are those ``vllm bench serve`` (vLLM 0.32) makes for the same seed, request
rate, burstiness and ramp-up: gamma gaps from the legacy global numpy stream seeded with
the seed (so they do not depend on the length draws), the first request waiting its own
gap, and, at a fixed rate, the schedule stretched so the last request is due at exactly
``num_prompts / request_rate``. See ``arrival_offsets``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel

from service.core.tinymodel import FIRST_ORDINARY_ID

if TYPE_CHECKING:
    from service.core.spec import RunSpec

# Without a known vocabulary, draw ids below this bound: every current LLM vocabulary is larger.
DEFAULT_VOCAB_BOUND = 32_000
# Prompt ids are drawn, encoded and sent this many at a time. Part of what a seed means:
# changing it changes every prompt longer than one block.
PROMPT_BLOCK = 8192


@dataclass(frozen=True, eq=False)
class Plan:
    """What to send: per request position (warmups first, then measured requests) its
    input and output length, and the measured requests' arrival offsets (s)."""

    seed: int
    vocab_high: int
    input_lens: np.ndarray
    output_lens: np.ndarray
    offsets: np.ndarray
    warmups: int

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (
            (self.seed, self.vocab_high, self.warmups) == (other.seed, other.vocab_high, other.warmups)
            and all(np.array_equal(getattr(self, k), getattr(other, k))
                    for k in ("input_lens", "output_lens", "offsets"))
        )

    @property
    def measured(self) -> int:
        """How many measured requests the plan has."""
        return len(self.input_lens) - self.warmups

    def prompt_blocks(self, position: int) -> Iterator[np.ndarray]:
        """The prompt of the request at ``position``, drawn block by block."""
        rng = np.random.default_rng([self.seed, position])
        n = int(self.input_lens[position])
        for start in range(0, n, PROMPT_BLOCK):
            yield rng.integers(FIRST_ORDINARY_ID, self.vocab_high,
                               size=min(PROMPT_BLOCK, n - start), dtype=np.int64)

    def prompt(self, position: int) -> list[int]:
        """The whole prompt of the request at ``position`` (for checks; sending streams it)."""
        return [int(t) for block in self.prompt_blocks(position) for t in block]


class RampUp(BaseModel):
    """A request rate that grows from ``start_rps`` to ``end_rps`` over the requests, like
    ``vllm bench serve --ramp-up-strategy``; checked in ``RunSpec``, taken as given here."""

    strategy: Literal["linear", "exponential"]
    start_rps: float
    end_rps: float

    def rates(self, n: int) -> np.ndarray:
        """The request rate of each of ``n`` requests: the start rate for the first, the
        end rate for the last."""
        progress = np.arange(n) / max(n - 1, 1)
        if self.strategy == "linear":
            return self.start_rps + (self.end_rps - self.start_rps) * progress
        ratio = self.end_rps / self.start_rps
        # Python's float power, not numpy's: numpy may use a SIMD power that differs from
        # libm's in the last bit, and vLLM computes the rate with Python floats.
        return np.array([self.start_rps * ratio ** float(p) for p in progress])


class LoadShape(BaseModel):
    """What decides which requests are sent when: the part of a ``RunSpec`` a load
    driver needs (the driver does not import the service's models and database layer)."""

    seed: int
    input_len: int
    output_len: int
    range_ratio: float
    num_prompts: int
    warmup_prompts: int
    request_rate: float | None
    burstiness: float
    max_concurrency: int | None
    ramp_up: RampUp | None = None

    @classmethod
    def of(cls, spec: RunSpec | LoadShape) -> LoadShape:
        """The load shape of a run's spec."""
        return cls.model_validate(
            {name: getattr(spec, name) for name in cls.model_fields}, from_attributes=True
        )


def _lengths(rng: np.random.Generator, center: int, ratio: float, n: int) -> np.ndarray:
    low = max(1, math.floor(center * (1 - ratio)))
    high = max(low, math.floor(center * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def arrival_offsets(
    n: int, request_rate: float | None, burstiness: float, seed: int, ramp_up: RampUp | None = None
) -> np.ndarray:
    """When each of ``n`` requests is due (s from the schedule's start), exactly as
    ``vllm bench serve`` (vLLM 0.32) schedules them for the same arguments and ``--seed``.

    ``request_rate`` None or inf: all due at 0 (unless ``ramp_up`` sets the rates).
    Request i waits a gamma gap of mean 1/rate_i and shape ``burstiness`` (1.0 is Poisson,
    inf a constant 1/rate_i) after request i-1, the first one after the start. Without a
    ramp-up the schedule is then stretched so the last request is due at n/request_rate,
    as vLLM does to keep throughput comparable across seeds.
    """
    if n <= 0:
        return np.zeros(0)
    rate = math.inf if request_rate is None else float(request_rate)
    if ramp_up is not None:
        rates = ramp_up.rates(n)
    elif math.isinf(rate):
        return np.zeros(n)
    else:
        rates = np.full(n, rate)
    if math.isinf(burstiness):
        gaps = 1.0 / rates
    else:
        # The stream ``np.random.seed(seed)`` starts, drawn one gap per request in order;
        # vLLM's random-dataset sampling does not touch it.
        gaps = np.random.RandomState(seed).gamma(burstiness, 1.0 / (rates * burstiness))
    offsets = np.cumsum(gaps)
    if ramp_up is None and offsets[-1] != 0:
        offsets = offsets * ((n / rate) / offsets[-1])
    return offsets


def make_plan(spec: RunSpec | LoadShape, vocab_size: int | None) -> Plan:
    """Build the seeded request schedule for ``spec``; the same seed gives the same plan."""
    shape = LoadShape.of(spec)
    rng = np.random.default_rng(shape.seed)
    total = shape.warmup_prompts + shape.num_prompts
    input_lens = _lengths(rng, shape.input_len, shape.range_ratio, total)
    output_lens = _lengths(rng, shape.output_len, shape.range_ratio, total)
    offsets = arrival_offsets(shape.num_prompts, shape.request_rate, shape.burstiness, shape.seed,
                              shape.ramp_up)
    return Plan(
        seed=shape.seed,
        vocab_high=vocab_size if vocab_size is not None else DEFAULT_VOCAB_BOUND,
        input_lens=input_lens,
        output_lens=output_lens,
        offsets=offsets,
        warmups=shape.warmup_prompts,
    )
