"""A sweep: one base ``RunSpec`` and a grid of values, expanded into one run per point."""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    model_validator,
)

from service.core.spec import MAX_INPUT_LEN, MAX_OUTPUT_LEN, MAX_REPEATS, Int, RunSpec, Strict, bounded_int

MAX_SWEEP_RUNS = 256

# Fields a sweep may vary; dotted names reach into nested specs.
SWEEP_KEYS = ("input_len", "output_len", "max_concurrency", "request_rate", "mode", "fill.mean",
              "fill.std")


class SweepGrid(Strict):
    """The values to sweep, per field; dotted names reach into nested specs."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    input_len: list[bounded_int(1, MAX_INPUT_LEN)] | None = Field(  # type: ignore[valid-type]
        default=None, min_length=1, max_length=64)
    output_len: list[bounded_int(1, MAX_OUTPUT_LEN)] | None = Field(  # type: ignore[valid-type]
        default=None, min_length=1, max_length=64)
    max_concurrency: list[bounded_int(1, 100_000) | None] | None = Field(  # type: ignore[valid-type]
        default=None, min_length=1, max_length=64)
    request_rate: list[Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)] | None] | None = (
        Field(default=None, min_length=1, max_length=64))
    # Two modes with fill make pairs: fill against prefill, or fill against seeded.
    mode: list[Literal["fill", "prefill", "seeded"]] | None = Field(default=None, min_length=1, max_length=2)
    fill_mean: list[Annotated[float, Field(ge=-1e4, le=1e4, allow_inf_nan=False)]] | None = Field(
        default=None, min_length=1, max_length=64, alias="fill.mean")
    fill_std: list[Annotated[float, Field(ge=0, le=1e4, allow_inf_nan=False)]] | None = Field(
        default=None, min_length=1, max_length=64, alias="fill.std")

    def axes(self) -> dict[str, list[Any]]:
        """The swept fields by their spec names, in declaration order."""
        return self.model_dump(by_alias=True, exclude_none=True)


class UntilDecided(Strict):
    """Run fill/prefill pairs until every point is decided or ``max_pairs`` pairs per point
    are spent (see ``service.analysis.pairs``)."""

    max_pairs: Int = Field(ge=2, le=MAX_REPEATS)


class TrialsCreate(Strict):
    """More trials for a sweep: ``count`` more pairs per point of a sweep over ``mode``
    (trials otherwise), at the points whose grid values ``point`` names (every point
    when it is left out)."""

    count: Int = Field(default=1, ge=1, le=MAX_REPEATS)
    point: dict[str, Any] | None = None


class SweepCreate(Strict):
    """A base spec and the values to sweep; one run per point of the grid."""

    base: RunSpec = Field(default_factory=RunSpec)
    grid: SweepGrid
    # Trials of every point; the same as ``base.repeats``, which it sets when given.
    repeats: Int | None = Field(default=None, ge=1, le=MAX_REPEATS)
    # Pairs until every fill verdict is decided; needs ``mode: [fill, prefill]`` (or seeded).
    until_decided: UntilDecided | None = None

    @model_validator(mode="after")
    def _grid(self) -> SweepCreate:
        axes = self.grid.axes()
        if not axes:
            raise ValueError(f"the grid sweeps nothing; sweepable: {', '.join(SWEEP_KEYS)}")
        if self.until_decided is not None:
            if sorted(axes.get("mode", [])) not in (["fill", "prefill"], ["fill", "seeded"]):
                raise ValueError("until_decided runs fill/prefill (or fill/seeded) pairs: the grid "
                                 'must sweep mode over ["fill", "prefill"] or ["fill", "seeded"]')
            first = max(self.repeats or self.base.repeats, 2)
            if first > self.until_decided.max_pairs:
                raise ValueError(f"until_decided.max_pairs ({self.until_decided.max_pairs}) is "
                                 f"below the pairs the sweep starts with ({first})")
            if self.repeats is None and "repeats" not in self.base.model_fields_set:
                self.repeats = first  # the rule's first look is at two pairs at least
            elif (self.repeats or self.base.repeats) < 2:
                raise ValueError("until_decided needs two pairs or more to start with (repeats >= 2)")
        if self.repeats is not None:
            if "repeats" in self.base.model_fields_set and self.base.repeats != self.repeats:
                raise ValueError(
                    f"repeats ({self.repeats}) and base.repeats ({self.base.repeats}) disagree: "
                    "give one of them")
            self.base = self.base.model_copy(update={"repeats": self.repeats})
        size = 1
        for values in axes.values():
            size *= len(values)
        if size * self.base.repeats > MAX_SWEEP_RUNS:
            raise ValueError(
                f"the grid makes {size} points x {self.base.repeats} repeats = "
                f"{size * self.base.repeats} runs, more than the cap of {MAX_SWEEP_RUNS}")
        return self

    def options(self) -> dict[str, Any] | None:
        """What the sweep keeps beside its grid: ``{"until_decided": {"max_pairs": n}}``."""
        if self.until_decided is None:
            return None
        return {"until_decided": self.until_decided.model_dump()}

    def points(self) -> list[tuple[dict[str, Any], RunSpec]]:
        """Every grid point with its full spec; a point that is not a valid spec is a ValueError."""
        axes = self.grid.axes()
        keys = list(axes)
        out = []
        for combo in itertools.product(*(axes[k] for k in keys)):
            point = dict(zip(keys, combo, strict=True))
            data = self.base.model_dump()
            for key, value in point.items():
                target = data
                *parents, leaf = key.split(".")
                for parent in parents:
                    target = target[parent]
                target[leaf] = value
            try:
                out.append((point, RunSpec.model_validate(data)))
            except ValueError as exc:
                raise ValueError(f"grid point {point} is not a valid run: {exc}") from exc
        return out
