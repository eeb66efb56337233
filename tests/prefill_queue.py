"""A prefill server whose truth is known: one prompt at a time, each taking the same
service time, requests arriving as a Poisson stream (an M/D/1 queue). The rate it
sustains under a p99 TTFT limit is found by simulating that queue long enough to reach
its steady state; runs of it are what a prefill run's requests would measure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from service.analysis import prefill_rate
from service.core.capacity_records import PrefillPlan, SearchLooks, rate_key
from service.core.sample import Sample
from service.storage.tables import Run


def queue_run(rate: float, service_s: float | np.ndarray, n: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` requests at ``rate`` per second into an empty queue: their send times and TTFTs
    (wait + service). Lindley's recursion W' = max(0, W + S - A), as a walk less its
    running minimum. ``service_s``: one service time, or service times seen, drawn from."""
    gaps = rng.exponential(1 / rate, n)
    sent = np.cumsum(gaps)
    service = (np.full(n, float(service_s)) if np.isscalar(service_s)
               else rng.choice(np.asarray(service_s, dtype=np.float64), n))
    walk = np.cumsum(np.concatenate([[0.0], service[:-1] - gaps[1:]]))
    wait = walk - np.minimum.accumulate(np.minimum(walk, 0.0))
    return sent, wait + service


def sustainable_rate(service_s: float | np.ndarray, limit_s: float, q: float = 0.99,
                     n: int = 400_000) -> float:
    """The highest rate whose steady-state ``q`` TTFT is at most ``limit_s`` (bisected over
    one long simulation per rate, common random numbers); ``service_s`` as ``queue_run``'s."""
    mean = float(np.mean(service_s))
    lo, hi = 0.01 / mean, 1 / mean
    for _ in range(40):
        mid = (lo + hi) / 2
        _, ttft = queue_run(mid, service_s, n, np.random.default_rng(1))
        lo, hi = (mid, hi) if np.quantile(ttft, q) <= limit_s else (lo, mid)
    return lo


def samples_of(sent: np.ndarray, ttft: np.ndarray, prompt_len: int) -> list[Sample]:
    """The requests of one simulated run as a driver would have measured them."""
    return [Sample(index=i, prompt_len=prompt_len, output_tokens=1, ttft=float(t), itl=[], latency=float(t),
                   start_time=float(s), success=True, sent_time=float(s))
            for i, (s, t) in enumerate(zip(sent, ttft, strict=True))]


def simulated_search(seed: int, service_s: float,
                      prefill: dict[str, Any]) -> tuple[float | None, int, tuple[float, float | None]]:
    """One prefill search through the real judge (``take_look``, ``step_of``) against a
    simulated one-at-a-time queue: its answer (requests/s), the runs it took and where the
    verdicts that carry a confidence put the crossing (``sure_bracket``)."""
    rng = np.random.default_rng(seed)
    runs: list[Run] = []
    looks = SearchLooks()
    plan = PrefillPlan.model_validate(prefill)
    samples: dict[str, list[Sample]] = {}
    start = datetime(2026, 1, 1, tzinfo=UTC)
    limit = plan.ttft_p99_max_ms
    while True:
        _, step = prefill_rate.step_of(runs, 2048, plan, looks)
        if step.queue is None:
            return step.last_pass, len(runs), step.surely
        rate = step.queue
        sent, ttft = queue_run(rate, service_s, plan.prompts_at(rate), rng)
        run_id = f"r{len(runs)}"
        samples[run_id] = samples_of(sent, ttft, 2048)
        runs.append(Run(id=run_id, spec={"mode": "prefill", "input_len": 2048, "request_rate": rate},
                        status="succeeded", summary={"p99_ttft_ms": float(np.quantile(ttft, 0.99)) * 1000},
                        created_at=start + timedelta(seconds=len(runs))))
        for r, ids in prefill_rate.looks_due(runs, 2048, looks):
            looks.rates[rate_key(2048, r)] = prefill_rate.take_look(
                [samples[i] for i in ids], ids, limit, prefill_rate.per_look(plan))
