"""The one record of a measured request: made by a load driver, streamed to the service,
stored as a row (``service.storage.tables.SampleRow`` maps it), shown by the API, and
turned into numbers by ``service.analysis``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
