"""How a run's prompts get their KV cache: the one place the three modes and what each
implies are written, read through properties rather than compared as strings."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class Mode(StrEnum):
    """A run's mode. A member equals its string (``Mode.fill == "fill"``), which is what
    a stored spec holds."""

    # The connector writes dummy values into the prompt's KV cache blocks: no prefill.
    fill = "fill"
    # Every measured request is prefilled for real, inside the measured run.
    prefill = "prefill"
    # The prompts are prefilled once, unmeasured; the measured requests replay that KV
    # cache from vLLM's prefix cache.
    seeded = "seeded"

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> Mode:
        """The mode of a stored spec (a dict; ``fill`` where it says none)."""
        return cls(spec.get("mode") or cls.fill)

    @property
    def fills(self) -> bool:
        """The connector fills the measured requests' KV cache."""
        return self is Mode.fill

    @property
    def prefills_measured(self) -> bool:
        """The measured requests themselves are prefilled for real (their TTFT is a prefill)."""
        return self is Mode.prefill

    @property
    def engine_writes_kv(self) -> bool:
        """The KV cache the run decodes on was written by the model (a real prefill, now or
        in a seeding pass), so the connector must fill none of it."""
        return self is not Mode.fill

    @property
    def seeds(self) -> bool:
        """A seeding pass prefills the prompts before the measured requests, which need
        vLLM's prefix cache to find them."""
        return self is Mode.seeded
