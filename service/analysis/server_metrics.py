"""The server's own view of a run: vLLM's Prometheus ``/metrics``, scraped while it runs.

A :class:`Scraper` polls ``{url}/metrics`` on a fixed tick and hands each
:class:`Point` to a callback; :func:`parse` keeps the few vLLM series that say what
the engine did (requests running and waiting, KV cache use, preemptions, prompt
tokens by source, prefix cache, tokens, finished requests, time in the queue), summed
over engines;
:func:`summarize` turns a run's points into counter deltas and gauge max/mean.

Names are vLLM's (``vllm/v1/metrics/loggers.py``). Counters are kept under their
name without ``_total`` (``vllm:num_preemptions``), and a labelled series as
``name{label=value}`` (``vllm:prompt_tokens_by_source{source=local_compute}``), and a
histogram as its ``name_sum`` and ``name_count``.
``vllm:kv_cache_usage_perc`` is a fraction (1 = full), as vLLM reports it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import numpy as np
from numpy.typing import ArrayLike
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
GAUGES = (RUNNING, WAITING, KV_USAGE)
# Each engine's KV usage is a fraction of its own cache: engines average, they do not add up.
MEAN_OVER_ENGINES = frozenset({KV_USAGE})
COUNTERS = (
    "vllm:num_preemptions",
    "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
    "vllm:generation_tokens",
    "vllm:prompt_tokens",
    "vllm:request_success",  # summed over finished_reason
)
# Counters kept as one series per value of a label.
BY_LABEL = {"vllm:prompt_tokens_by_source": "source"}
# Histograms kept as their ``_sum`` and ``_count`` (running totals, like counters): the
# time each request waited in the engine's queue before it was first scheduled, observed
# as it finishes, so two scrapes around a run give its mean.
HISTOGRAMS = ("vllm:request_queue_time_seconds",)
HISTOGRAM_PARTS = frozenset(f"{name}{part}" for name in HISTOGRAMS for part in ("_sum", "_count"))
SCRAPE_TIMEOUT_S = 2.0


def _series(sample_name: str, labels: dict[str, str]) -> str | None:
    """The key a sample is kept under, or None when it is not one we keep."""
    if sample_name in GAUGES or sample_name in HISTOGRAM_PARTS:
        return sample_name
    # The exposition names counter samples ``<name>_total`` (next to ``<name>_created``).
    name = sample_name.removesuffix("_total")
    if name == sample_name:
        return None
    if name in COUNTERS:
        return name
    label = BY_LABEL.get(name)
    if label is not None and label in labels:
        return f"{name}{{{label}={labels[label]}}}"
    return None


def _parse(text: str) -> dict[str, float] | None:
    """The kept series of an exposition text, or None when the text does not parse."""
    sums: dict[str, float] = {}
    engines: dict[str, int] = {}
    try:
        # Keyed on sample names, so a text with or without # TYPE lines reads the same.
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = _series(sample.name, sample.labels)
                if key is None or not math.isfinite(sample.value):
                    continue
                sums[key] = sums.get(key, 0.0) + float(sample.value)
                engines[key] = engines.get(key, 0) + 1
    except Exception:  # the parser raises several kinds on bad input; any of them means garbage
        return None
    for key in MEAN_OVER_ENGINES & sums.keys():
        sums[key] /= engines[key]
    return sums


def parse(text: str) -> dict[str, float]:
    """The vLLM series we keep from a Prometheus exposition text, summed over engines
    (KV cache usage: averaged). Absent series are left out; text that does not parse
    gives ``{}`` and a logged warning."""
    values = _parse(text)
    if values is None:
        log.warning("not a Prometheus exposition text (%d characters); no server metrics from it",
                    len(text))
        return {}
    return values


def is_gauge(name: str) -> bool:
    """Whether a kept series is a gauge (a level now), not a counter (a running total)."""
    return name in GAUGES


@dataclass
class Point:
    """One scrape: ``t`` is ``time.time()`` halfway through the request (as near as the
    client can tell to when the server read its gauges), ``values`` what :func:`parse` kept."""

    t: float
    values: dict[str, float]


class Scraper:
    """Polls one vLLM server's ``/metrics`` every ``every_s`` seconds."""

    def __init__(self, client: httpx.AsyncClient, url: str, every_s: float = 0.5) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be positive, got {every_s}")
        self.client = client
        self.url = url.rstrip("/")
        self.every_s = every_s
        self._complained = False

    def _complain(self, message: str, *args: object) -> None:
        # Every tick would repeat it: the first time is news, the rest is noise.
        if self._complained:
            log.debug(message, *args)
            return
        self._complained = True
        log.warning(message + " (further failures of this scraper are logged at debug level)", *args)

    async def scrape(self) -> Point | None:
        """One scrape; None when the server did not answer, answered an error, or said
        nothing we keep."""
        wall, sent = time.time(), time.perf_counter()
        try:
            response = await self.client.get(f"{self.url}/metrics", timeout=SCRAPE_TIMEOUT_S)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self._complain("scraping %s/metrics failed: %s: %s", self.url, type(exc).__name__, exc)
            return None
        # The gauges were read somewhere between sending and receiving: stamp the middle.
        half = (time.perf_counter() - sent) / 2
        # Off the event loop: a big exposition text takes a while to parse.
        values = await asyncio.to_thread(_parse, response.text)
        if values is None:
            self._complain("%s/metrics is not a Prometheus exposition text", self.url)
            return None
        if not values:
            return None
        return Point(t=wall + half, values=values)

    async def run(self, on_point: Callable[[Point], None]) -> None:
        """Scrape on every tick of ``every_s`` until cancelled, passing each point to
        ``on_point``. Ticks are kept on a fixed grid (no drift); a scrape slower than a
        tick skips the ticks it missed. An exception from ``on_point`` ends the loop."""
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while True:
            point = await self.scrape()
            if point is not None:
                on_point(point)
            tick += self.every_s
            now = loop.time()
            if tick < now:
                tick += math.ceil((now - tick) / self.every_s) * self.every_s
            await asyncio.sleep(tick - now)


class PointLike(Protocol):
    """Anything with a time and values, as a :class:`Point` or a stored row."""

    @property
    def t(self) -> float: ...

    @property
    def values(self) -> dict[str, float]: ...


def summarize(points: Sequence[PointLike]) -> dict[str, Any]:
    """Counter deltas (last minus first; None if the counter ever went down, a restart),
    gauge ``max`` and time-weighted ``mean`` (trapezoids over the scrape times; one point:
    its value), the number of ``points`` and their ``span_s``."""
    ordered = sorted(points, key=lambda p: p.t)
    summary: dict[str, Any] = {"points": len(ordered), "span_s": 0.0, "deltas": {}, "max": {},
                               "mean": {}}
    if not ordered:
        return summary
    first, last = ordered[0], ordered[-1]
    summary["span_s"] = last.t - first.t
    names = sorted({name for p in ordered for name in p.values})
    for name in names:
        ts = np.array([p.t for p in ordered if name in p.values], dtype=np.float64)
        vs = np.array([p.values[name] for p in ordered if name in p.values], dtype=np.float64)
        if is_gauge(name):
            summary["max"][name] = float(vs.max())
            span = ts[-1] - ts[0]
            area = float(np.sum((vs[1:] + vs[:-1]) / 2 * np.diff(ts)))
            summary["mean"][name] = area / span if span > 0 else float(vs.mean())
        elif name in first.values and name in last.values:
            reset = bool(np.any(np.diff(vs) < 0))
            summary["deltas"][name] = None if reset else last.values[name] - first.values[name]
    return summary


def in_flight(start_times: ArrayLike, latencies: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Requests in flight as the client saw them: a step function given as its corners
    ``(times, counts)``, each change drawn as a vertical step (times repeat)."""
    starts = np.asarray(start_times, dtype=np.float64)
    if starts.size == 0:
        return np.zeros(0), np.zeros(0)
    ends = starts + np.asarray(latencies, dtype=np.float64)
    times = np.concatenate([starts, ends])
    steps = np.concatenate([np.ones(starts.size), -np.ones(ends.size)])
    # At equal times an end goes first: a request that ends as another starts is not two.
    order = np.lexsort((steps, times))
    times, counts = times[order], np.cumsum(steps[order])
    before = np.concatenate([[0.0], counts[:-1]])
    corners_t = np.repeat(times, 2)
    corners_n = np.column_stack([before, counts]).ravel()
    return corners_t, corners_n
