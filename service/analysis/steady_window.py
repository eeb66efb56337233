"""The steady decode window: the gaps between a request's tokens during which no request
of the run was waiting for its first token.

At concurrency above one a real-prefill run's decode steps also carry other requests'
prefills (chunked prefill); the summary's ``decode_*`` keys (``service.analysis.metrics``)
are taken over this window, so they compare decode with decode. ``prefill_stall`` (the
summary's ``prefill_stall``) is the share of decode time outside it, paused by other
requests' prefills: expected of real prefill, not a warning.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.core.mode import Mode
from service.core.sample import Sample


def token_times(sample: Sample) -> np.ndarray:
    """When each token of a request reached the client (start + ttft, then each gap added)."""
    # Same order of additions as vLLM (and the summary's peaks): first token, then each gap.
    return np.cumsum(np.array([sample.start_time + sample.ttft, *sample.itl], dtype=np.float64))


Waits = tuple[np.ndarray, np.ndarray]


def wait_windows(start_times: Sequence[float], ttfts: Sequence[float]) -> Waits:
    """The times some request of a run waited for its first token (``start`` to ``start +
    ttft`` of each successful request), merged into disjoint, sorted intervals: their
    starts and ends."""
    windows = sorted((lo, lo + ttft) for lo, ttft in zip(start_times, ttfts, strict=True))
    starts: list[float] = []
    ends: list[float] = []
    for lo, hi in windows:
        if ends and lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return np.asarray(starts), np.asarray(ends)


def steady_masks(samples: Sequence[Sample], min_decoding: int = 0,
                 waits: Waits | None = None) -> list[np.ndarray]:
    """Per successful request (in order), which of its gaps (``itl``) lie in the steady
    decode window: a boolean mask per request; ``steady_gaps`` says which gaps those are."""
    ok = [s for s in samples if s.success]
    if not ok:
        return []
    if waits is None:
        waits = wait_windows([s.start_time for s in ok], [s.ttft for s in ok])
    w_start, w_end = waits
    all_times = [token_times(s) for s in ok]
    first = np.array([t[0] for t in all_times])
    last = np.array([t[-1] for t in all_times])
    out = []
    for times in all_times:
        # The last wait that began before the gap ended; it overlaps if it ends after the gap began.
        j = np.searchsorted(w_start, times[1:], side="left") - 1
        keep = ~((j >= 0) & (w_end[np.maximum(j, 0)] > times[:-1]))
        if min_decoding > 1:
            decoding = (first[None, :] <= times[:-1, None]) & (last[None, :] >= times[1:, None])
            keep &= decoding.sum(axis=1) >= min_decoding
        out.append(keep)
    return out


def steady_gaps(samples: Sequence[Sample], min_decoding: int = 0,
                waits: Waits | None = None) -> list[np.ndarray]:
    """Per successful request (in order), its gaps during which no request of the run was
    waiting for its first token (seconds). With ``min_decoding``, only gaps throughout which
    at least that many requests were decoding (first token seen, last not yet): the batch
    size a point asks for (costs requests x gaps; for analysis, not for every summary).

    ``waits``: the run's ``wait_windows``, when ``samples`` is a slice of the run (then
    without ``min_decoding``, which needs every request)."""
    ok = [s for s in samples if s.success]
    masks = steady_masks(ok, min_decoding, waits)
    return [np.asarray(s.itl, dtype=np.float64)[keep] for s, keep in zip(ok, masks, strict=True)]


def prefill_stall(samples: Sequence[Sample], mode: str = "prefill") -> dict[str, object]:
    """Decode paused by other requests' prefills (``mode`` fill: by their fills): the share
    of the streams' decode time (sum of their gaps) spent in gaps outside the steady decode
    window, that is while another request of the run waited for its first token; with what
    it means. Expected of real prefill at concurrency above one, and the reason ``decode_*``
    keys exist."""
    ok = [s for s in samples if s.success]
    masks = steady_masks(ok)
    total = stalled = 0.0
    gaps = 0
    for sample, keep in zip(ok, masks, strict=True):
        itl = np.asarray(sample.itl, dtype=np.float64)
        total += float(itl.sum())
        stalled += float(itl[~keep].sum())
        gaps += int((~keep).sum())
    share = stalled / total if total > 0 else 0.0
    if Mode(mode).fills:
        why = ("while another request's KV cache was being filled (the connector's fill step, "
               "in place of its prefill): decode waits for that step as it would for a prefill")
    else:
        why = ("while another request was being prefilled (decode paused by its prefill): expected "
               "of real prefill at concurrency above one")
    return {"share": round(share, 4), "gaps": gaps, "message": (
        f"{share:.0%} of decode time was in {gaps} gaps {why}; median ITL and TPOT include those "
        "pauses, the decode_* figures leave them out")}
