"""A capacity search as a client asks for it: a base ``RunSpec``, the input lengths, the
latency limit (SLA) and the bounds; and the fill run that probes one concurrency.

The search itself (which concurrency to probe next, when the boundary is decided) is
``service.analysis.capacity``; its runs are queued by ``service.control.capacity``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from service.core.mode import Mode
from service.core.spec import MAX_INPUT_LEN, MAX_PROMPTS, Int, RunSpec, Strict, bounded_int

# The summary's steady-window decode figures a limit may be put on (``service.analysis.metrics``).
SLA_METRICS = ("decode_median_itl_ms", "decode_p99_itl_ms", "decode_median_tpot_ms",
               "decode_p99_tpot_ms")
SlaMetric = Literal["decode_median_itl_ms", "decode_p99_itl_ms", "decode_median_tpot_ms",
                    "decode_p99_tpot_ms"]

# The highest concurrency a search may probe (``RunSpec.max_concurrency``'s own bound), and
# the one it plans for when the body gives none: vLLM's largest default ``max_num_seqs``.
MAX_CEILING = 100_000
DEFAULT_CEILING = 1024
# Runs one search may queue in all; by default this many per input length.
MAX_CAPACITY_RUNS = 256
DEFAULT_RUNS_PER_CONTEXT = 32
MAX_INPUT_LENS = 16

# A probe at concurrency C sends max(MIN_PROBE_PROMPTS, PROBE_WAVES * C) requests, C at a
# time: its streams start together and, with one output length, end together, so the batch
# is full for PROBE_WAVES waves of C; the figure is taken over the gaps while all C decoded
# (``service.analysis.capacity.sla_figure``), whose units are the waves' engine steps (ITL)
# or the waves themselves (TPOT), never a wave's requests apart. At C <= 4 the floor gives
# 16 requests: 16 / C waves.
PROBE_WAVES = 4
MIN_PROBE_PROMPTS = 16
# Trials of a search's first probe, queued together at its start: the drift between runs
# is measured before any verdict (``service.analysis.probe_units``).
FIRST_PROBE_TRIALS = 2

# RunSpec fields the search sets on every probe: a base that sets them is refused.
PROBE_FIELDS = ("input_len", "max_concurrency", "num_prompts", "request_rate", "ramp_up",
                "repeats", "stop")


class Sla(Strict):
    """The latency limit: a steady-window decode figure of the summary, at most ``max_ms``."""

    metric: SlaMetric
    # At least a microsecond: the planner divides by it and takes logarithms of the ratio,
    # which a subnormal float would turn into a division by zero.
    max_ms: float = Field(ge=0.001, le=1e7, allow_inf_nan=False)


# A prefill rate's run lasts this long and sends at least this many requests.
DEFAULT_RATE_DURATION_S = 60.0
DEFAULT_RATE_MIN_PROMPTS = 100


# The lowest request rate a prefill search takes (requests/s).
MIN_RATE = 0.001


class PrefillSearch(Strict):
    """Measure what a prefill server sustains: per input length, real-prefill runs of one
    output token at rising request rates, each lasting ``duration_s``, up to the highest
    whose p99 TTFT is at most ``ttft_p99_max_ms`` and does not climb through the run:
    doubling from ``start_rate`` to the first failing rate (or ``max_rate``), then
    bisecting (geometric mean) until the failing rate is within ``precision`` of the
    passing one."""

    # Floors where a smaller figure means nothing a server can show (a TTFT under a
    # millisecond, a request every 17 minutes), and where the doublings from start_rate to
    # max_rate stay countable (a rate of 1e-323 made their number infinite).
    ttft_p99_max_ms: float = Field(ge=1, le=1e7, allow_inf_nan=False)
    start_rate: float = Field(default=1.0, ge=MIN_RATE, le=1e5, allow_inf_nan=False)
    max_rate: float = Field(default=1024.0, ge=MIN_RATE, le=1e5, allow_inf_nan=False)
    # How long each rate's run sends (rate x duration_s requests, at least min_prompts):
    # above the server's rate mu its queue grows by (rate - mu) requests a second, and a
    # run must last long enough for that to show in its TTFT (see ``rate_prompts``).
    duration_s: float = Field(default=DEFAULT_RATE_DURATION_S, ge=1, le=3600, allow_inf_nan=False)
    min_prompts: Int = Field(default=DEFAULT_RATE_MIN_PROMPTS, ge=8, le=MAX_PROMPTS)
    # Stop bisecting once first failing rate <= last passing rate x (1 + precision).
    precision: float = Field(default=0.25, ge=0.01, le=1.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _rates_in_order(self) -> PrefillSearch:
        if self.max_rate < self.start_rate:
            raise ValueError(f"max_rate ({self.max_rate:g}) is below start_rate ({self.start_rate:g})")
        return self

    def prompts_at(self, rate: float) -> int:
        """Requests a run at ``rate`` sends (``rate_prompts``)."""
        return rate_prompts(rate, self.duration_s, self.min_prompts)


class CapacityCreate(Strict):
    """A capacity search: per input length, the largest concurrency whose SLA holds."""

    base: RunSpec = Field(default_factory=RunSpec)
    input_lens: list[bounded_int(1, MAX_INPUT_LEN)] = Field(  # type: ignore[valid-type]
        min_length=1, max_length=MAX_INPUT_LENS)
    sla: Sla
    # The highest concurrency to probe; DEFAULT_CEILING when not given.
    max_concurrency: Int | None = Field(default=None, ge=1, le=MAX_CEILING)
    # Runs the search may spend in all; DEFAULT_RUNS_PER_CONTEXT per input length when not given.
    max_runs: Int | None = Field(default=None, ge=1, le=MAX_CAPACITY_RUNS)
    # A prefill server's prefill tokens/s, to size decode servers per prefill server against.
    prefill_tokens_per_s: float | None = Field(default=None, gt=0, le=1e12, allow_inf_nan=False)
    # Or measure it: real-prefill runs at each input length against a TTFT limit.
    prefill: PrefillSearch | None = None

    @field_validator("base")
    @classmethod
    def _base_leaves_the_probe_alone(cls, base: RunSpec) -> RunSpec:
        owned = [f for f in PROBE_FIELDS if f in base.model_fields_set]
        if owned:
            raise ValueError(f"base sets {', '.join(owned)}, which the search sets on each probe "
                             f"(it sets {', '.join(PROBE_FIELDS)}): leave them out")
        if base.mode.prefills_measured:
            raise ValueError('a probe is a fill run or a seeded one: base.mode must be "fill" or "seeded"')
        return base

    @field_validator("input_lens")
    @classmethod
    def _distinct(cls, lens: list[int]) -> list[int]:
        twice = sorted({n for n in lens if lens.count(n) > 1})
        if twice:
            raise ValueError(f"input_lens names {', '.join(map(str, twice))} more than once")
        return lens

    @model_validator(mode="after")
    def _one_prefill_source(self) -> CapacityCreate:
        if self.prefill is not None and self.prefill_tokens_per_s is not None:
            raise ValueError("prefill_tokens_per_s gives the prefill rate and prefill measures it: "
                             "give one of them, not both")
        return self

    @model_validator(mode="after")
    def _probes_are_runs(self) -> CapacityCreate:
        if self.max_runs is not None and self.max_runs < len(self.input_lens):
            raise ValueError(f"max_runs ({self.max_runs}) is below one run per input length "
                             f"({len(self.input_lens)})")
        for input_len in self.input_lens:
            try:
                probe_spec(self.base, input_len, 1, 0)
            except ValueError as exc:
                raise ValueError(f"input_lens: {input_len} makes no valid run: {exc}") from exc
            if self.prefill is not None:
                try:
                    prefill_spec(self.base, input_len, self.prefill.start_rate,
                                 self.prefill.prompts_at(self.prefill.start_rate))
                except ValueError as exc:
                    raise ValueError(f"prefill: input_len {input_len} makes no valid prefill run: "
                                     f"{exc}") from exc
        return self

    def ceiling(self) -> int:
        """The highest concurrency the search plans for."""
        return self.max_concurrency or DEFAULT_CEILING

    def runs_budget(self) -> int:
        """Runs the search may spend in all."""
        if self.max_runs is not None:
            return self.max_runs
        return min(MAX_CAPACITY_RUNS, DEFAULT_RUNS_PER_CONTEXT * len(self.input_lens))


def probe_prompts(concurrency: int) -> int:
    """Requests a probe at ``concurrency`` sends (see ``PROBE_WAVES``)."""
    return min(MAX_PROMPTS, max(MIN_PROBE_PROMPTS, PROBE_WAVES * concurrency))


def probe_spec(base: RunSpec | Mapping[str, Any], input_len: int, concurrency: int, trial: int,
               stored: bool = False) -> RunSpec:
    """The fill run (seeded, when ``base.mode`` says so: trial ``k`` of every probe of an
    input length shares one seed set, so each probe seeds only the prompts the ones before it
    did not) of trial ``trial`` (seed ``base.seed + trial``) of the probe at
    ``concurrency`` requests in flight and ``input_len``; ``base``: a spec, or one as a
    search stores it (without the fields a probe sets); ``stored``: checked as a spec read
    back from the database (no look at the filesystem). A ValueError if it is no valid run."""
    data = base.model_dump() if isinstance(base, RunSpec) else dict(base)
    seed = int(data.get("seed", 0))
    data.update(input_len=input_len, max_concurrency=concurrency,
                num_prompts=probe_prompts(concurrency), request_rate=None, ramp_up=None,
                repeats=1, stop=None, mode=Mode.seeded if Mode.of(data).seeds else Mode.fill,
                seed=(seed + trial) % 2**32)
    return RunSpec.stored(data) if stored else RunSpec.model_validate(data)


def rate_prompts(rate: float, duration_s: float, min_prompts: int) -> int:
    """Requests a prefill rate's run sends: ``rate`` x ``duration_s``, at least
    ``min_prompts`` (and at most a run's ``MAX_PROMPTS``)."""
    return min(MAX_PROMPTS, max(min_prompts, math.ceil(rate * duration_s)))


def prefill_spec(base: RunSpec | Mapping[str, Any], input_len: int, rate: float, num_prompts: int,
                 trial: int = 0, stored: bool = False) -> RunSpec:
    """The real-prefill run that measures TTFT at ``input_len`` and ``rate`` requests/s
    (one output token, no concurrency limit, ``num_prompts`` requests), trial ``trial`` of
    that rate (seed ``base.seed + trial``: its own prompts and arrivals); ``base`` and
    ``stored`` as for ``probe_spec``. A ValueError if it is no valid run.

    At least one warm-up request goes first: a run's first request waits for the
    connector's pull of the run's parameters, and with few requests its TTFT would be the p99."""
    data = base.model_dump() if isinstance(base, RunSpec) else dict(base)
    data.update(input_len=input_len, output_len=1, max_concurrency=None, num_prompts=num_prompts,
                request_rate=rate, ramp_up=None, repeats=1, stop=None, mode=Mode.prefill,
                warmup_prompts=max(1, int(data.get("warmup_prompts", 0))),
                seed=(int(data.get("seed", 0)) + trial) % 2**32)
    return RunSpec.stored(data) if stored else RunSpec.model_validate(data)
