"""The one record of a measured request: made by a load driver, streamed to the service,
stored as a row (``service.storage.tables.SampleRow`` maps it), shown by the API, and
turned into numbers by ``service.analysis``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Sample:
    """One request's raw measurement (seconds, ``time.perf_counter`` clock of the client)."""

    index: int
    prompt_len: int
    output_tokens: int
    ttft: float
    itl: list[float]
    latency: float
    start_time: float
    success: bool
    error: str = ""
    due_time: float | None = None
    sent_time: float | None = None
    generated_text: str = field(default="", repr=False)

    def counted_output_tokens(self) -> int:
        """Output tokens as counted for the summary: the server's usage, else one per streamed chunk."""
        if not self.success:
            return 0
        if self.output_tokens:
            return self.output_tokens
        # Without usage, vLLM re-tokenizes the text; we have no tokenizer, and with
        # one token per chunk (vLLM's server streams that way) the count is the same.
        return len(self.itl) + 1

    def tpot(self) -> float | None:
        """Time per output token after the first, or None when there is at most one."""
        n = self.counted_output_tokens()
        if n <= 1:
            return None
        return (self.latency - self.ttft) / (n - 1)

    def as_dict(self) -> dict[str, Any]:
        """Its fields by name, for a row or a message. The ``itl`` list is shared, not
        copied: ``dataclasses.asdict`` copies it element by element, 1.1 s for 4,000
        samples of 512 tokens, paid where a run's samples are stored and per request in
        the load driver."""
        return {name: getattr(self, name) for name in FIELD_NAMES}


# The fields of a sample, in their order.
FIELD_NAMES = tuple(f.name for f in fields(Sample))
