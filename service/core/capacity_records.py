"""What a capacity search keeps beside its runs, as typed records validated on read: the
plan it made before it started (``SearchPlan``, with a prefill search's ``PrefillPlan``)
and the looks it took (``ProbeLook`` per decode probe, ``RateLook`` per prefill rate, held
together by ``SearchLooks``).

They are stored as JSON in the search's row (``storage.tables.CapacitySearch``): written
by ``stored()``, read back by ``read()``, which raises a ValueError (pydantic's
``ValidationError``) on a record this version cannot read. A record stored by an earlier
version lacks the fields added since and reads with their defaults; fields it has that
this version no longer knows are ignored. An interval is kept as ``[value, lo, hi]``, an
end nothing bounds yet as null (JSON has no infinity).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from service.core.capacity import rate_prompts

# A stored interval: its value and its ends, an end nothing bounds as None.
Triple = tuple[float, float | None, float | None]


class Record(BaseModel):
    """A stored record: immutable, validated on read, fields it does not know ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    def stored(self) -> dict[str, Any]:
        """As kept in the search's row (JSON)."""
        return self.model_dump(mode="json")


# --- the plan --------------------------------------------------------------------------


class PrefillPlan(Record):
    """A prefill search as asked (``core.capacity.PrefillSearch``) with the looks planned for
    it (``analysis.prefill_rate.rate_plan``). A search stored before runs had a duration sent
    ``num_prompts`` at every rate; one stored before rates had planned looks has no
    ``per_look_confidence``, and its single runs are read from their summaries."""

    ttft_p99_max_ms: float
    start_rate: float
    max_rate: float
    precision: float
    duration_s: float | None = None
    min_prompts: int | None = None
    num_prompts: int | None = None
    looks: int | None = None
    per_look_confidence: float | None = None
    method: str | None = None

    def prompts_at(self, rate: float) -> int:
        """Requests a run at ``rate`` sends (``core.capacity.rate_prompts``)."""
        if self.duration_s is None or self.min_prompts is None:
            if self.num_prompts is None:
                raise ValueError("a stored prefill plan has neither duration_s and min_prompts "
                                 "nor num_prompts")
            return self.num_prompts
        return rate_prompts(rate, self.duration_s, self.min_prompts)

    @property
    def legacy(self) -> bool:
        """Stored before every rate was looked at (its looks were not planned)."""
        return self.per_look_confidence is None


class SearchPlan(Record):
    """What a search planned before it started (``analysis.capacity.Plan``): the highest
    concurrency, the trials a probe may get, the looks at an interval and each one's
    confidence; the prefill rate it sizes decode servers against, given or measured."""

    ceiling: int
    trial_cap: int
    boundary_trials: int | None = None
    looks: int
    per_look_confidence: float
    confidence: float
    method: str | None = None
    prefill_tokens_per_s: float | None = None
    prefill: PrefillPlan | None = None

    @classmethod
    def read(cls, stored: Mapping[str, Any]) -> SearchPlan:
        """A plan as the search's row keeps it."""
        return cls.model_validate(stored)

    def stored(self) -> dict[str, Any]:
        """As kept in the search's row, without the fields it does not have."""
        return self.model_dump(mode="json", exclude_none=True)


# --- the looks -------------------------------------------------------------------------


class ProbeLook(Record):
    """A decode probe's latest look over its succeeded trials
    (``analysis.capacity_runs.take_look``): the runs it took, the SLA figure (ms) with its
    interval at ``confidence``, a tail limit's attainment, what they rest on (units, each
    trial's level and its variance within the trial, the drift between runs) and the
    per-stream decode rate (tokens/s) with its 95% interval. ``figure`` None: the trials
    showed no full batch to judge."""

    runs: tuple[str, ...]
    confidence: float
    figure: Triple | None = None
    per_user: Triple | None = None
    method: str | None = None
    units: int | None = None
    levels: tuple[float, ...] = ()
    within: tuple[float, ...] = ()
    drift_sd: float | None = None
    drift_df: float | None = None
    disagreement_p: float | None = None
    drifts: bool = False
    attainment: Triple | None = None
    target: float | None = None
    units_needed: int | None = None

    @property
    def typical_ms(self) -> float | None:
        """The figure its trials' levels put it at (the geometric mean of their medians, ms)."""
        return 1000.0 * math.exp(sum(self.levels) / len(self.levels)) if self.levels else None


class RateLook(Record):
    """A prefill rate's look over its runs pooled (``analysis.prefill_rate.take_look``): the
    p99 TTFT (ms) with its exact interval at ``confidence`` (its top None where the requests
    cannot bound it), the requests and their independent worth, the steepest climb of TTFT
    through one run (ms, with its 95% interval) and whether that climb is a backlog."""

    runs: tuple[str, ...]
    confidence: float
    figure: Triple | None = None
    requests: int = 0
    effective_requests: float | None = None
    climb_ms: tuple[float, float, float] | None = None
    backlog: bool = False

    @property
    def independent_requests(self) -> int:
        """Independent requests' worth (all of them for a look stored before that was counted)."""
        return int(self.requests if self.effective_requests is None else self.effective_requests)


def probe_key(input_len: int, concurrency: int) -> str:
    """Where a decode probe's latest look is kept in the search's looks."""
    return f"{input_len}:{concurrency}"


def rate_key(input_len: int, rate: float) -> str:
    """Where the pooled look at a prefill rate's runs is kept in the search's looks."""
    return f"prefill {input_len}@{rate:g}"


PROBE_KEY = re.compile(r"\d+:\d+")
RATE_KEY = re.compile(r"prefill \d+@[0-9.e+-]+")


@dataclass
class SearchLooks:
    """Every look a search took, by key (``probe_key``, ``rate_key``)."""

    probes: dict[str, ProbeLook] = field(default_factory=dict)
    rates: dict[str, RateLook] = field(default_factory=dict)

    @classmethod
    def read(cls, stored: Mapping[str, Any]) -> SearchLooks:
        """The looks as the search's row keeps them; a ValueError on a key or look this
        version cannot read."""
        looks = cls()
        for key, look in stored.items():
            if PROBE_KEY.fullmatch(key):
                looks.probes[key] = ProbeLook.model_validate(look)
            elif RATE_KEY.fullmatch(key):
                looks.rates[key] = RateLook.model_validate(look)
            else:
                raise ValueError(f"a stored look has the key {key!r}, neither a probe's nor a rate's")
        return looks

    def stored(self) -> dict[str, Any]:
        """As kept in the search's row."""
        return {**{k: v.stored() for k, v in self.probes.items()},
                **{k: v.stored() for k, v in self.rates.items()}}

    def copy(self) -> SearchLooks:
        """Another holder of the same looks (each look is immutable)."""
        return SearchLooks(dict(self.probes), dict(self.rates))

    def probe(self, input_len: int, concurrency: int) -> ProbeLook | None:
        """The latest look at a decode probe, if any."""
        return self.probes.get(probe_key(input_len, concurrency))

    def rate(self, input_len: int, rate: float) -> RateLook | None:
        """The latest look at a prefill rate, if any."""
        return self.rates.get(rate_key(input_len, rate))
