"""The 95% intervals of a run's summary: ``<key>_ci`` next to its medians and p99s, by
bootstrap over requests (``service.analysis.intervals``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.analysis.intervals import PooledValues, pooled_quantile_ci
from service.analysis.metrics import LATENCY_METRICS
from service.analysis.steady_window import Waits, steady_gaps
from service.core.sample import Sample

# Statistics that get a 95% interval in a run's summary, as ``<key>_ci: [lo, hi]`` (ms).
# ITL statistics pool the gaps of every request and resample whole requests; the others
# resample requests' own values (see ``service.analysis.intervals``).
INTERVAL_QUANTILES: tuple[tuple[str, float], ...] = (("median", 0.5), ("p99", 0.99))


def request_values(samples: Sequence[Sample], waits: Waits | None = None) -> dict[str, list[np.ndarray]]:
    """Per successful request, in seconds, the values each latency statistic pools:
    ``ttft``, ``tpot``, ``e2el`` (one value per request), ``itl`` (its gaps) and
    ``decode_itl`` / ``decode_tpot`` (its steady-window gaps, and their mean). ``waits``:
    the run's ``wait_windows`` when ``samples`` is a slice of it."""
    ok = [s for s in samples if s.success]
    steady = steady_gaps(ok, waits=waits)
    return {
        "ttft": [np.array([s.ttft]) for s in ok],
        "tpot": [np.array([t]) for s in ok if (t := s.tpot()) is not None],
        "e2el": [np.array([s.latency]) for s in ok],
        "itl": [np.asarray(s.itl, dtype=np.float64) for s in ok],
        "decode_itl": steady,
        "decode_tpot": [np.array([g.mean()]) for g in steady if g.size],
    }


def summary_intervals(samples: Sequence[Sample], seed: int = 0) -> dict[str, list[float]]:
    """``median_ttft_ms_ci``, ``p99_itl_ms_ci``, ... ``decode_median_itl_ms_ci``: the 95%
    bootstrap interval (ms) of each latency statistic of the summary, over requests; a
    statistic with under two requests has none."""
    values = request_values(samples)
    out: dict[str, list[float]] = {}
    for name in LATENCY_METRICS:
        pooled = PooledValues(values[name])  # sorted once for both quantiles
        for stat, q in INTERVAL_QUANTILES:
            interval = pooled_quantile_ci(pooled, q, seed=seed)
            if interval is not None:
                out[f"{stat}_{name}_ms_ci"] = interval.scaled(1000).pair()
    for name in ("itl", "tpot"):
        interval = pooled_quantile_ci(values[f"decode_{name}"], 0.5, seed=seed)
        if interval is not None:
            out[f"decode_median_{name}_ms_ci"] = interval.scaled(1000).pair()
    return out
