"""Streams that reached the client in bursts: the warning samples alone can show.

``run_warnings`` turns samples into warnings; ``bunched_streams`` fires for streams whose
tokens reached the client in bursts instead of one engine step at a time (a starved
client, a buffering proxy), so their gaps are not the server's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from service.core.sample import Sample

# No engine step of vLLM takes under 0.1 ms: chunks closer than that arrived together.
TOGETHER_S = 1e-4
# Chunks closer than this share of a stream's own TPOT arrived together too.
TOGETHER_OF_TPOT = 0.1
# A run warns when at least this share of its streams arrived in bursts...
BUNCHED_SHARE = 0.1
# ...or when its pooled median ITL is below this share of its median TPOT.
ITL_OF_TPOT = 0.5


def is_bunched(sample: Sample) -> bool:
    """True when a stream's tokens reached the client in bursts, not one engine step at a
    time: more than half its gaps are under 0.1 ms or under a tenth of its own TPOT."""
    if not sample.success or len(sample.itl) < 2:
        return False
    limit = max(TOGETHER_S, TOGETHER_OF_TPOT * (sample.tpot() or 0.0))
    return float(np.median(sample.itl)) < limit


def run_warnings(samples: Sequence[Sample], summary: Mapping[str, object]) -> list[dict[str, object]]:
    """Warnings the samples themselves show, as ``{code, message, figure}``.

    ``bunched_streams`` fires for streams whose tokens reached the client in bursts, or a
    median gap far below the TPOT inside the steady decode window. Outside that window a
    low median ITL against the TPOT is what real prefill does at concurrency above one
    (another request's prefill pauses decode: one long gap among short ones); that is
    ``prefill_stall``, a figure of the summary, not a warning.
    """
    streams = [s for s in samples if s.success and len(s.itl) >= 2]
    if not streams:
        return []
    bunched = sum(is_bunched(s) for s in streams)
    share = bunched / len(streams)
    itl = summary.get("decode_median_itl_ms")
    tpot = summary.get("decode_median_tpot_ms")
    pooled_low = (
        isinstance(itl, float) and isinstance(tpot, float) and tpot > 0 and itl < ITL_OF_TPOT * tpot
    )
    if share < BUNCHED_SHARE and not pooled_low:
        return []
    message = (
        f"{bunched} of {len(streams)} streams reached the client in bursts instead of one token "
        f"per engine step (median gap under {TOGETHER_OF_TPOT:.0%} of the stream's TPOT)"
    )
    if pooled_low:
        message += (f"; in the steady decode window the median ITL {itl:.3f} ms is below half "
                    f"the median TPOT {tpot:.3f} ms")
    message += (
        ": the client did not see tokens when the server sent them (a starved client or a "
        "buffering proxy), so this run's ITL, and TPOT of those streams, are not meaningful"
    )
    return [{"code": "bunched_streams", "message": message, "figure": round(share, 4)}]
