"""The decode median ITL of a run's requests so far, kept up to date as they end.

A progress display asks for it every half second while the run is measured; recomputing it
from every sample (``metrics.decode_stats``) costs the whole run each time. ``RunningDecode``
takes each request once and answers in a time that does not grow with the run:

- The steady decode window is the summary's (``steady_window.steady_masks``): a gap counts when no
  request of the run was waiting for its first token during it. Each request's gaps are
  judged against the waits known when it comes; a request ending later whose wait overlaps
  gaps counted already takes them out again (only requests that ended after its wait began
  can hold such gaps, so that look-back is as short as a request is long).
- The gaps counted are kept in a histogram of log-spaced bins ``BIN_WIDTH`` wide (relative),
  so the median costs the same at 1k or 20k requests and is the summary's within half a bin.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable

import numpy as np

from service.core.sample import Sample

# Relative width of a bin: the median read from the bins is within half of it.
BIN_WIDTH = 1e-3
# Gaps below this (s) share the first bin, gaps above the last share the last one.
LOWEST_S = 1e-6
HIGHEST_S = 1e3
BINS = math.ceil(math.log(HIGHEST_S / LOWEST_S) / math.log1p(BIN_WIDTH)) + 1


def _bins(gaps: np.ndarray) -> np.ndarray:
    clipped = np.clip(gaps, LOWEST_S, HIGHEST_S)
    return np.minimum((np.log(clipped / LOWEST_S) / math.log1p(BIN_WIDTH)).astype(np.int64), BINS - 1)


def _bin_value(k: int) -> float:
    """The geometric middle of bin ``k`` (s)."""
    return float(LOWEST_S * (1 + BIN_WIDTH) ** (k + 0.5))


class _Request:
    """One answered request as the running figure needs it."""

    __slots__ = ("steady", "times")

    def __init__(self, times: np.ndarray, steady: np.ndarray) -> None:
        # When each token reached the client; which of the gaps between them are counted.
        self.times = times
        self.steady = steady


class RunningDecode:
    """The steady-window decode median ITL of the requests taken so far (see the module
    docstring). ``add`` from one thread at a time; ``figure`` from any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = np.zeros(BINS, dtype=np.int64)
        self._gaps = 0
        # Answered requests by the time of their last token (sorted), for the look-back.
        self._ends: list[float] = []
        self._requests: list[_Request] = []
        # The waits for a first token so far, merged into disjoint intervals sorted by
        # start (their ends are then sorted too), as ``steady_window.wait_windows`` makes them.
        self._wait_starts: list[float] = []
        self._wait_ends: list[float] = []

    def add(self, samples: Iterable[Sample]) -> None:
        """Take requests that ended (in any order; failed ones count for nothing)."""
        for sample in samples:
            if sample.success:
                self._add(sample)

    def _add(self, sample: Sample) -> None:
        times = np.cumsum(np.array([sample.start_time + sample.ttft, *sample.itl], dtype=np.float64))
        wait = (sample.start_time, sample.start_time + sample.ttft)
        steady = self._steady(times, wait)
        counted = np.diff(times)[steady]
        with self._lock:
            self._uncount_during(*wait)
            np.add.at(self._counts, _bins(counted), 1)
            self._gaps += int(counted.size)
        end = float(times[-1])
        at = bisect.bisect_right(self._ends, end)
        self._ends.insert(at, end)
        self._requests.insert(at, _Request(times, steady))

    def _steady(self, times: np.ndarray, wait: tuple[float, float]) -> np.ndarray:
        """Which gaps of a request no known wait overlaps, its own wait merged in first."""
        self._merge_wait(*wait)
        # Only the waits that end after its first token and begin before its last matter.
        lo = bisect.bisect_right(self._wait_ends, float(times[0]))
        hi = bisect.bisect_left(self._wait_starts, float(times[-1]))
        starts = np.asarray(self._wait_starts[lo:hi], dtype=np.float64)
        ends = np.asarray(self._wait_ends[lo:hi], dtype=np.float64)
        if not starts.size:
            return np.ones(times.size - 1, dtype=bool)
        # As ``steady_window.steady_masks``: the last wait begun before the gap ended overlaps it
        # if it ends after the gap began.
        j = np.searchsorted(starts, times[1:], side="left") - 1
        steady: np.ndarray = ~((j >= 0) & (ends[np.maximum(j, 0)] > times[:-1]))
        return steady

    def _merge_wait(self, start: float, end: float) -> None:
        i = bisect.bisect_left(self._wait_starts, start)
        if i > 0 and self._wait_ends[i - 1] >= start:
            i -= 1
            start = self._wait_starts[i]
        j = i
        while j < len(self._wait_starts) and self._wait_starts[j] <= end:
            end = max(end, self._wait_ends[j])
            j += 1
        self._wait_starts[i:j] = [start]
        self._wait_ends[i:j] = [end]

    def _uncount_during(self, start: float, end: float) -> None:
        """A new wait: the gaps counted so far that it overlaps leave the steady window.
        Only requests whose last token came after the wait began can hold one."""
        for request in self._requests[bisect.bisect_right(self._ends, start):]:
            times = request.times
            if times[0] >= end:
                continue
            hit = request.steady & (times[1:] > start) & (times[:-1] < end)
            if hit.any():
                request.steady &= ~hit
                np.subtract.at(self._counts, _bins(np.diff(times)[hit]), 1)
                self._gaps -= int(hit.sum())

    def figure(self) -> tuple[float | None, int]:
        """The median of the counted gaps (ms; None while there is none) and how many there
        are: numpy's median (the middle gap, or the mean of the two middle ones) read from
        the bins."""
        with self._lock:
            n = self._gaps
            if n == 0:
                return None, 0
            cumulative = np.cumsum(self._counts)
        # The bins of the order statistics (n - 1) // 2 and n // 2, counted from 0.
        lower = int(np.searchsorted(cumulative, (n - 1) // 2 + 1))
        upper = int(np.searchsorted(cumulative, n // 2 + 1))
        return (_bin_value(lower) + _bin_value(upper)) / 2 * 1000, n
