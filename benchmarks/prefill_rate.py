"""The prefill side of a capacity search against a server whose truth is known.

A prefill server that computes one prompt at a time in a fixed service time, with Poisson
arrivals, is an M/D/1 queue: the rate it sustains under a p99 TTFT limit is found by
simulating that queue to its steady state (``tests/prefill_queue.py``). Each search here
goes through the product's own judge (``service.analysis.prefill_rate``: ``take_look``,
``step_of``, ``next_rate``) on runs drawn from that queue, under two rules:

- ``fixed 32``: 32 requests a rate, whatever the rate (the rule before runs had a
  duration; judged by today's judge, backlog test included);
- ``60 s``: rate x 60 s requests, at least 100 (the default).

Prints, per case and rule, the measured rate over the truth (median, range, share within
[0.85, 1.10]), how often the range of the verdicts that carry a confidence holds the
truth, the runs a search took and how long one run near the answer sends (s/run). Run:
``python benchmarks/prefill_rate.py [--searches 30]``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.analysis.prefill_rate import rate_plan
from service.core.capacity_records import PrefillPlan
from tests.prefill_queue import simulated_search, sustainable_rate

# (service time s, p99 TTFT limit s): 2,048-token prompts at 16k tokens/s, limits 0.5-2 s.
CASES = ((0.125, 1.0), (0.125, 0.5), (0.125, 2.0), (0.5, 4.0))
RULES = {"fixed 32": {"duration_s": 0.001, "min_prompts": 32},
         "60 s": {"duration_s": 60.0, "min_prompts": 100}}


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--searches", type=int, default=30)
    parser.add_argument("--precision", type=float, default=0.1)
    args = parser.parse_args()
    print(f"{'service s':>9} {'limit s':>7} {'truth/s':>7} {'rule':>9} {'median':>7} {'min':>6} {'max':>6} "
          f"{'in ±':>6} {'sure':>5} {'runs':>5} {'s/run':>6}")
    for service_s, limit_s in CASES:
        truth = sustainable_rate(service_s, limit_s)
        start = 2 ** math.floor(math.log2(truth / 4))
        for name, rule in RULES.items():
            prefill: dict[str, Any] = {"ttft_p99_max_ms": limit_s * 1000, "start_rate": start,
                                       "max_rate": 64 * start, "precision": args.precision, **rule}
            prefill.update(rate_plan(start, 64 * start, args.precision))
            ratios, sure, runs, seconds = [], 0, [], []
            for seed in range(args.searches):
                answer, n, (low, high) = simulated_search(1000 + seed, service_s, prefill)
                ratios.append((answer or 0.0) / truth)
                sure += low <= truth < (high or math.inf)
                runs.append(n)
                seconds.append(_server_seconds(prefill, answer or start))
            r = np.array(ratios)
            inside = float(np.mean((r >= 0.85) & (r <= 1.10)))
            print(f"{service_s:>9g} {limit_s:>7g} {truth:>7.3g} {name:>9} {np.median(r):>7.3f} "
                  f"{r.min():>6.3f} {r.max():>6.3f} {inside:>6.0%} {sure / args.searches:>5.0%} "
                  f"{np.mean(runs):>5.1f} {np.mean(seconds):>6.0f}")


def _server_seconds(prefill: dict[str, Any], rate: float) -> float:
    """About how long one run near the answer sends: its requests over its rate."""
    return PrefillPlan.model_validate(prefill).prompts_at(rate) / rate


if __name__ == "__main__":
    main()
