"""Did a run measure what it says? The evidence from the connector, the server and the client.

Pure functions over what a run leaves behind: the connector's per-run counters
(``service.core.spec.connector_totals``), the points scraped from the worker's
Prometheus ``/metrics`` (``(t, values)``, ``t`` on the samples' clock,
``time.perf_counter``), the samples, and the load drivers' beats. They give the
reason a run must fail, or the warnings it carries with its numbers.

Warnings are ``{"code", "message", "figure"}``:

- ``preempted``: vLLM preempted requests during the run (a preempted request is
  recomputed with a real prefill, inside the decode the run measures);
- ``queued_in_server``: while every request the run asked for at once was decoding
  (past its first token, not finished, as the client saw it) the server ran fewer
  (median), or requests waited in the server's queue in at least half of the scrapes
  while any was decoding: the decode batch was not the one asked for. At least
  ``MIN_SCRAPES`` scrapes must fall in the window for that; without them (scrapes
  during a run are off by default) the verdict comes from two scrapes, at the run's
  start and end: vLLM's ``request_queue_time_seconds`` histogram gives the mean time
  a request waited before the engine first scheduled it, and the run carries the
  warning when that is at least ``QUEUED_SHARE`` of the mean request latency and
  ``QUEUED_MIN_S`` (a step or two of waiting is how any request joins a batch; a
  fill run's first request also waits there, once, for the run's values);
- ``kv_near_full``: KV cache usage above 95% in a scrape;
- ``foreign_prefix_hits``: prefix-cache hits no prompt of the run explains (no two
  prompts of a run share a prefix and the run's ``cache_salt`` keeps other runs'
  blocks out, so with no preemption the run expects none);
- ``fill_mismatch``: the two connector sides disagree on how many requests were
  filled, or the connector accounted for fewer requests than the run sent;
- ``client_lag``: open loop requests left more than 1 ms after they were due (median
  over the requests that did not wait for a concurrency slot, at least
  ``MIN_FREE_SENDS`` of them: that wait is the server's time, see ``slot_waits``), or a
  load driver was busy at least 95% of a core (median beat);
- ``dummy_moe_routing``: a mixture-of-experts model ran on dummy weights, so its router
  spread the tokens over the experts unlike the real model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from service.core.mode import Mode
from service.core.sample import Sample

Warning_ = dict[str, Any]
Point = tuple[float, Mapping[str, float]]

KV_NEAR_FULL = 0.95
LAG_S = 1e-3
# The fewest requests that had a free slot for a verdict on their lateness: the median of
# fewer is one timer's jitter (the driver's event loop wakes on a 1 ms clock).
MIN_FREE_SENDS = 5
DRIVER_BUSY = 0.95
WAITING_SHARE = 0.5
MIN_SCRAPES = 3
QUEUED_SHARE = 0.05
QUEUED_MIN_S = 0.05

PREEMPTIONS = ("vllm:num_preemptions", "vllm:num_preemptions_total")
PREFIX_HITS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc",)
QUEUE_TIME_SUM = ("vllm:request_queue_time_seconds_sum",)
QUEUE_TIME_COUNT = ("vllm:request_queue_time_seconds_count",)


def _warn(code: str, message: str, figure: float | int | None) -> Warning_:
    return {"code": code, "message": message, "figure": figure}


def value_of(values: Mapping[str, float], names: Sequence[str]) -> float | None:
    """The first of ``names`` present in a scrape (metric names change between vLLM versions)."""
    for name in names:
        value = values.get(name)
        if value is not None and math.isfinite(value):
            return float(value)
    return None


def counter_delta(points: Sequence[Point], names: Sequence[str]) -> float | None:
    """Last minus first value of a counter over the run; None if absent or reset."""
    if len(points) < 2:
        return None
    first, last = value_of(points[0][1], names), value_of(points[-1][1], names)
    if first is None or last is None or last < first:
        return None
    return last - first


def asked_concurrency(max_concurrency: int | None, num_prompts: int,
                      request_rate: float | None) -> int | None:
    """How many requests a run holds in flight at most: its cap, or all of them when sent
    at once; None for an open loop without a cap (the server decides)."""
    if max_concurrency is not None:
        return min(max_concurrency, num_prompts)
    if request_rate is None:
        return num_prompts
    return None


def infeasible(concurrency: int | None, longest_tokens: int, kv_tokens: int | None) -> str | None:
    """Why a run cannot hold its asked batch in the server's KV cache, or None."""
    if concurrency is None or kv_tokens is None:
        return None
    needed = concurrency * longest_tokens
    if needed <= kv_tokens:
        return None
    return (f"infeasible: {concurrency} requests at once x {longest_tokens:,} tokens each "
            f"(input + output) = {needed:,} tokens of KV cache, and this server holds "
            f"{kv_tokens:,}; vLLM would preempt and recompute requests, so the run was not sent")


def connector_verdict(totals: Mapping[str, Any] | None, mode: str,
                      sent: int) -> tuple[str | None, list[Warning_]]:
    """What the connector's counters say about a run that sent ``sent`` requests (warmups
    included) that got an answer: the reason it must fail, and warnings."""
    if sent <= 0:
        return None, []
    totals = totals or {}
    seen = int(totals.get("requests_seen", 0))
    if seen == 0:
        return (f"the vLLM server's connector never reported on this run ({sent} requests "
                "answered): it could not reach the service (its control_url or token), or the "
                "server runs without decodebench's connector, so nothing shows the requests "
                f"were treated as mode '{mode}' says"), []
    other = int(totals.get("other_requests", 0))
    if other:
        reason = totals.get("error") or "no reason given"
        return (f"{other} of {seen} requests were not treated as mode '{mode}' says (neither "
                f"filled with this run's values nor prefilled as asked): {reason}"), []
    filled = int(totals.get("filled_requests", 0))
    if Mode(mode).engine_writes_kv and (filled or int(totals.get("requests_filled", 0))):
        return f"{filled} requests of a {mode} run were filled by the connector", []
    warnings: list[Warning_] = []
    if seen < sent:
        warnings.append(_warn(
            "fill_mismatch",
            f"the connector accounted for {seen} of the {sent} requests this run sent; the "
            "rest may not have been treated as the run's mode says", sent - seen))
    on_workers = int(totals.get("requests_filled", 0))
    if Mode(mode).fills and on_workers < filled:
        warnings.append(_warn(
            "fill_mismatch",
            f"the scheduler side decided {filled} fills but a worker rank reported only "
            f"{on_workers} filled requests", filled - on_workers))
    return None, warnings


def in_flight(samples: Sequence[Sample], at: np.ndarray, decoding: bool = False) -> np.ndarray:
    """Requests the client had in flight at each time of ``at`` (its own clock); with
    ``decoding``, only those past their first token."""
    if not samples:
        return np.zeros(len(at), dtype=int)
    offset = [s.ttft if decoding else 0.0 for s in samples]
    starts = np.sort(np.array([s.start_time + o for s, o in zip(samples, offset, strict=True)]))
    ends = np.sort(np.array([s.start_time + max(s.latency, 0.0) for s in samples]))
    return np.searchsorted(starts, at, side="right") - np.searchsorted(ends, at, side="right")


def server_warnings(points: Sequence[Point], samples: Sequence[Sample], concurrency: int | None,
                    recomputed: int = 0, replayed: bool = False) -> list[Warning_]:
    """Warnings from the server's own view of the run (``points`` cover the run);
    ``replayed``: a seeded run, whose prompts are meant to hit the prefix cache."""
    warnings: list[Warning_] = []
    preemptions = counter_delta(points, PREEMPTIONS)
    if (preemptions or 0) > 0 or recomputed > 0:
        count = int(max(preemptions or 0, recomputed))
        warnings.append(_warn(
            "preempted",
            f"vLLM preempted requests {count} times during the run: a preempted request is "
            "recomputed with a real prefill inside the decode this run measures; lower the "
            "concurrency or the lengths, or give the server more KV cache", count))
    usage = [u for _, v in points if (u := value_of(v, KV_USAGE)) is not None]
    if usage and max(usage) > KV_NEAR_FULL:
        peak = max(usage)
        warnings.append(_warn(
            "kv_near_full", f"KV cache usage reached {peak:.1%} (over {KV_NEAR_FULL:.0%}): the "
            "server was at the edge of preempting or queueing requests", round(peak, 4)))
    hits = counter_delta(points, PREFIX_HITS)
    if hits and not preemptions and not recomputed and not replayed:
        warnings.append(_warn(
            "foreign_prefix_hits",
            f"{int(hits):,} prompt tokens were served from the prefix cache, and no prompt of "
            "this run shares a prefix with another: the server had traffic this run did not "
            "send, or cached blocks of another run", int(hits)))
    queued = _queued(points, samples, concurrency) or _queued_by_counters(points, samples)
    if queued is not None:
        warnings.append(queued)
    return warnings


def _queued(points: Sequence[Point], samples: Sequence[Sample],
            concurrency: int | None) -> Warning_ | None:
    scraped = [(t, r, w) for t, v in points
               if (r := value_of(v, RUNNING)) is not None and (w := value_of(v, WAITING)) is not None]
    if not scraped or not samples:
        return None
    times = np.array([t for t, _, _ in scraped])
    running_all = np.array([r for _, r, _ in scraped])
    waiting_all = np.array([w for _, _, w in scraped])
    decoding = in_flight(samples, times, decoding=True)
    if concurrency is not None:
        full = decoding >= concurrency
        if int(full.sum()) >= MIN_SCRAPES:
            median_running = float(np.median(running_all[full]))
            if median_running < concurrency:
                share = float(np.mean(waiting_all[full] > 0))
                return _warn(
                    "queued_in_server",
                    f"while the client had all {concurrency} requests decoding the server ran a "
                    f"median of {median_running:g} (requests waiting in its queue in {share:.0%} "
                    f"of {int(full.sum())} scrapes): the decode batch was smaller than asked",
                    median_running)
    busy = decoding >= 1
    if int(busy.sum()) >= MIN_SCRAPES:
        share = float(np.mean(waiting_all[busy] > 0))
        if share >= WAITING_SHARE:
            return _warn(
                "queued_in_server",
                f"requests waited in the server's queue in {share:.0%} of {int(busy.sum())} "
                "scrapes while the run had requests decoding: the server, not the run, set the "
                "batch", round(share, 4))
    return None


def _queued_by_counters(points: Sequence[Point], samples: Sequence[Sample]) -> Warning_ | None:
    """The queue verdict from the first and last scrape alone: the mean time the run's
    requests waited in the engine's queue against their mean latency."""
    waited_s = counter_delta(points, QUEUE_TIME_SUM)
    requests = counter_delta(points, QUEUE_TIME_COUNT)
    latencies = [s.latency for s in samples if s.success and s.latency > 0]
    if waited_s is None or not requests or not latencies:
        return None
    mean_wait = waited_s / requests
    share = mean_wait / float(np.mean(latencies))
    if share < QUEUED_SHARE or mean_wait < QUEUED_MIN_S:
        return None
    return _warn(
        "queued_in_server",
        f"requests waited a mean of {mean_wait * 1000:,.0f} ms in the server's queue before it "
        f"first scheduled them, {share:.0%} of their mean latency ({int(requests)} requests, "
        "vllm:request_queue_time_seconds): the server, not the run, set the batch",
        round(share, 4))


def slot_waits(samples: Sequence[Sample]) -> np.ndarray:
    """Which requests (with a due time, in order) may have waited for a concurrency slot:
    those that, at their due time or before they left, saw the client with as many
    requests in flight as it ever had at once (its ``max_concurrency``, when the run
    reached it). Such a request left when another ended, a time the server set; the
    samples cannot tell that from the client's own lateness, so it is no evidence
    either way. A run that never reached its cap has few such moments: its peak."""
    timed = [s for s in samples if s.due_time is not None]
    starts = np.array([s.start_time for s in samples])
    at_start = in_flight(samples, starts)
    busiest = int(at_start.max(initial=0))
    peaks = np.sort(starts[at_start >= busiest])
    dues = np.array([s.due_time for s in timed])
    left = np.array([s.start_time for s in timed])
    full_when_due = in_flight(samples, dues) >= busiest
    full_before_left = (np.searchsorted(peaks, left, side="left")
                        > np.searchsorted(peaks, dues, side="right"))
    return np.asarray(full_when_due | full_before_left, dtype=bool)


def client_warnings(samples: Sequence[Sample], beats: Sequence[Mapping[str, float]],
                    open_loop: bool) -> list[Warning_]:
    """``client_lag`` from the samples' due and send times and the drivers' beats."""
    warnings: list[Warning_] = []
    if open_loop:
        timed = [s for s in samples if s.due_time is not None]
        waited = slot_waits(samples)
        lags = [s.start_time - s.due_time for s, w in zip(timed, waited, strict=True)
                if s.due_time is not None and not w]
        if len(lags) >= MIN_FREE_SENDS and (lag := float(np.median(lags))) > LAG_S:
            warnings.append(_warn(
                "client_lag",
                f"requests left a median {lag * 1000:.1f} ms after they were due (not counting "
                "any that waited for a concurrency slot): the load driver could not keep the "
                "arrival schedule", round(lag * 1000, 3)))
    by_shard: dict[int, list[float]] = {}
    for beat in beats:
        by_shard.setdefault(int(beat.get("shard", 0)), []).append(float(beat["cpu"]))
    busiest = max((float(np.median(c)) for c in by_shard.values() if c), default=0.0)
    if busiest >= DRIVER_BUSY:
        warnings.append(_warn(
            "client_lag",
            f"a load driver was busy {busiest:.0%} of a core (median over the run): a saturated "
            "client times tokens late", round(busiest, 4)))
    return warnings


# Where vLLM reads a model's expert count, first present name first
# (``ModelArchConfigConvertor.get_num_experts``); a model with experts is MoE to vLLM.
EXPERT_COUNTS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")
# Multimodal configs keep the language model's config under one of these.
TEXT_CONFIGS = ("text_config", "decoder", "generator")


def num_experts(config: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer a model's config.json declares (0: a dense model)."""
    text = next((config[k] for k in TEXT_CONFIGS if isinstance(config.get(k), Mapping)), config)
    count = next((text[name] for name in EXPERT_COUNTS if name in text), 0)
    if isinstance(count, list):  # some configs give one count per layer
        count = max((c for c in count if isinstance(c, int)), default=0)
    if isinstance(count, int) and not isinstance(count, bool) and count > 0:
        return count
    # Heterogeneous models (NemotronH) declare experts per block.
    blocks = text.get("block_configs")
    if not isinstance(blocks, list):
        return 0
    per_block = [b.get("n_routed_experts") for b in blocks
                 if isinstance(b, Mapping) and b.get("block_type") == "moe"]
    return max((n for n in per_block if isinstance(n, int) and n > 0), default=0)


def dummy_moe(load_format: str, config: Mapping[str, Any] | None) -> list[Warning_]:
    """``dummy_moe_routing`` for a mixture-of-experts model run on dummy weights: its router
    is random too, so tokens spread over the experts unlike the real model's."""
    if load_format != "dummy" or config is None:
        return []
    experts = num_experts(config)
    if experts <= 0:
        return []
    return [_warn(
        "dummy_moe_routing",
        f"this mixture-of-experts model ({experts} experts per layer) ran on dummy weights: "
        "its router's weights are random too, so which experts the tokens go to is not the "
        "real model's routing, and the load per expert (and with it the decode speed) may "
        "differ from the real model's", experts)]
