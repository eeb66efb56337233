"""A seeded run's arithmetic and proof: does its seed set fit, was it reused, and did every
measured request find its prompt in vLLM's prefix cache.

A seeded run prefills its prompts once (the seeding pass, one output token each) and then
sends the same prompts measured. vLLM serves a prompt from its prefix cache in whole blocks
and always computes the last token again, so a request of ``L`` prompt tokens hits at most
``(L - 1) // B * B`` of them (``B``, the block size): "all but the last block".

Why the fit counts every measured request's fresh blocks, not only a batch's: vLLM hands
out free blocks oldest first and puts a finished request's blocks at the back of that
queue. After seeding, the queue holds the never used blocks, then the seed set. Each
measured request takes fresh blocks (its last prompt block and its output) from the front;
the blocks it frees go to the back, behind the seed set's. So the measured requests use up
the never used blocks one after another, and once those are gone vLLM evicts the seed
set's oldest blocks, which are prompts still to be measured.

The proof reads vLLM's own counters (``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``,
counted once per request as the scheduler admits it; a request re-admitted after a
preemption counts apart) over the measured phase: the run's requests queried exactly the
tokens they sent, and the hits add up to the most each request can hit. As no request hits
more than its most, every one hit its most.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from service.analysis.checks import Point, value_of

QUERIES = ("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
HITS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")


def most_hit(length: int, block: int) -> int:
    """Prompt tokens of a request of ``length`` vLLM can serve from its prefix cache."""
    return max(0, (length - 1) // block * block)


@dataclass(frozen=True)
class Fit:
    """What a seeded run needs of a server's KV cache, in tokens."""

    kv_tokens: int
    block: int
    prompts: int
    # The seed set: every prompt's full blocks, cached.
    seed_set: int
    # Fresh blocks the measured requests (warmups too) take, one after another.
    fresh: int

    @property
    def needed(self) -> int:
        """Tokens of KV cache the run needs so that no seed block is evicted."""
        return self.seed_set + self.fresh

    def problem(self) -> str | None:
        """Why the seed set cannot stay cached through the measured requests, or None."""
        if self.needed <= self.kv_tokens:
            return None
        # "infeasible" like ``checks.infeasible``: a capacity search reads it as a bound.
        return (f"infeasible: the seed set does not fit: the KV cache holds {self.kv_tokens:,} tokens; the "
                f"seed set needs {self.seed_set:,} ({self.prompts} prompts, their full "
                f"{self.block}-token blocks) and the measured requests another {self.fresh:,} "
                f"(each one's last prompt block and its output, in fresh blocks), "
                f"{self.needed:,} in all: vLLM would evict prompts before they are measured. "
                "Lower num_prompts (or use a stop rule), input_len or output_len, or give the "
                "server more KV cache")


def fit(kv_tokens: int, block: int, input_lens: Sequence[int], output_lens: Sequence[int]) -> Fit:
    """The fit of a seed set of prompts ``input_lens`` measured with ``output_lens``."""
    seed_set = sum(length // block * block for length in input_lens)
    fresh = 0
    for length, out in zip(input_lens, output_lens, strict=True):
        blocks = -(-(length + out) // block) - most_hit(length, block) // block
        fresh += blocks * block
    return Fit(kv_tokens, block, len(input_lens), seed_set, fresh)


def counters(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> tuple[int, int] | None:
    """Prefix-cache queries and hits between two scrapes (None: a counter missing or reset)."""
    if before is None or after is None:
        return None
    out = []
    for names in (QUERIES, HITS):
        first, last = value_of(before, names), value_of(after, names)
        if first is None or last is None or last < first:
            return None
        out.append(round(last - first))
    return out[0], out[1]


def seeding_record(seconds: float, block: int, input_lens: Sequence[int],
                   delta: tuple[int, int] | None, salt: str) -> dict[str, Any]:
    """What the run records of its seeding pass: how long it took, and from the counters
    whether the seed set was already cached (``reused``: every prompt hit its most;
    ``reused_tokens``, the prompt tokens that did)."""
    most = sum(most_hit(length, block) for length in input_lens)
    record: dict[str, Any] = {
        "seconds": round(seconds, 4), "prompts": len(input_lens), "prompt_tokens": int(sum(input_lens)),
        "block_size": block, "cache_salt": salt, "reused": None, "reused_tokens": None,
    }
    if delta is not None:
        _queries, hits = delta
        record["reused_tokens"] = hits
        record["reused"] = most > 0 and hits >= most
        record["computed_tokens"] = int(sum(input_lens)) - hits
    return record


def replay_problem(delta: tuple[int, int] | None, block: int, lengths: Sequence[int],
                   fit: Fit | None = None) -> tuple[str | None, dict[str, Any]]:
    """Whether every measured request (``lengths``: warmups and measured, as sent) hit the
    prefix cache for its whole prompt but the last block, from the counters over the
    measured phase: the reason the run fails (None: proven), and the figures."""
    sent = int(sum(lengths))
    most = sum(most_hit(length, block) for length in lengths)
    figures: dict[str, Any] = {"requests": len(lengths), "prompt_tokens": sent, "most_hits": most}
    if delta is None:
        return ("the server's /metrics gave no prefix-cache counters (vllm:prefix_cache_queries, "
                "vllm:prefix_cache_hits) around the measured requests: nothing proves they "
                "decoded on the seeded KV, so the run is not counted"), figures
    queries, hits = delta
    figures |= {"queries": queries, "hits": hits}
    if queries != sent:
        return (f"the server's prefix cache was queried for {queries:,} prompt tokens while the "
                f"run sent {sent:,} in {len(lengths)} requests: other traffic on the server (or "
                "requests it did not admit) leaves the replay unproven"), figures
    if hits < most:
        missed = most - hits
        why = f"; {fit.problem()}" if fit is not None and fit.problem() else (
            f" (the KV cache holds {fit.kv_tokens:,} tokens, the seed set needs {fit.seed_set:,} "
            f"and the measured requests another {fit.fresh:,})" if fit is not None else "")
        return (f"{missed:,} prompt tokens the seed set held were computed again: of "
                f"{len(lengths)} requests some did not find their prompt in the prefix cache "
                f"(hits {hits:,} of the {most:,} possible): the seed set was evicted{why}"), figures
    return None, figures


def replay_point(points: Sequence[Point]) -> tuple[Mapping[str, float] | None, Mapping[str, float] | None]:
    """The first and last scrape of the measured phase."""
    if len(points) < 2:
        return None, None
    return points[0][1], points[-1][1]
