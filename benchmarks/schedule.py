"""How many runs per second one service schedules, with 1, 4 and 16 registered servers.

The service runs as its own process (``python -m service``, real HTTP, real SQLite);
each registered server is ``token_stub.py`` in its own process, streaming tokens
1 ms apart, so a run costs the service what its bookkeeping costs: submit, place,
mark starting and running, tag and send one request, store its sample and summary,
finish. What is left is the control plane's own ceiling. Every variant is measured
in this one run, each on a fresh service and data dir, and printed side by side.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx
from harness import MODEL, service_with_stubs

RUN = {"model": MODEL, "input_len": 16, "output_len": 2, "num_prompts": 1, "max_concurrency": 1}
SWEEP = {"base": RUN, "grid": {"input_len": list(range(16, 16 + 64)), "fill.mean": [0.1, 0.2, 0.3, 0.4]}}
SWEEP_RUNS = 256


def measure(workers: int, submits: int) -> dict[str, float]:
    """On a fresh service with ``workers`` registered stub servers: time ``submits`` runs
    posted one by one, then a sweep of 256 one-request runs from its POST to its last end."""
    with tempfile.TemporaryDirectory(prefix="decodebench-schedule-") as tmp, \
            service_with_stubs(Path(tmp) / "var", workers) as (client, _, _):
        # One POST per run, as a script submitting runs one by one would.
        started = time.perf_counter()
        for _ in range(submits):
            client.post("/api/runs", json=RUN).raise_for_status()
        submitted = time.perf_counter() - started
        _wait_succeeded(client, submits)
        # A sweep queues all its runs at once: what is left is scheduling and running.
        started = time.perf_counter()
        client.post("/api/sweeps", json=SWEEP).raise_for_status()
        _wait_succeeded(client, submits + SWEEP_RUNS)
        elapsed = time.perf_counter() - started
    return {"submit_per_s": submits / submitted, "runs_per_s": SWEEP_RUNS / elapsed, "seconds": elapsed}


# How often the end is looked for: two list calls a look, which the service answers from
# the same 2 cores it schedules on (at 20 ms, 100 calls a second took a share of them).
# 0.1 s on a sweep of 12 s or more is under 1% of its time.
POLL_S = 0.1


def _wait_succeeded(client: httpx.Client, total: int) -> None:
    while client.get("/api/runs", params={"status": "succeeded", "limit": 1}).json()["total"] < total:
        failed = client.get("/api/runs", params={"status": "failed", "limit": 1}).json()
        if failed["total"]:
            raise RuntimeError(f"a run failed: {failed['runs'][0]['error']}")
        time.sleep(POLL_S)


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--submits", type=int, default=100)
    parser.add_argument("--workers", default="1,4,16")
    args = parser.parse_args()
    levels = [int(w) for w in args.workers.split(",")]
    results = {w: measure(w, args.submits) for w in levels}
    first = results[levels[0]]["runs_per_s"]
    print(f"{args.submits} runs posted one by one, then a sweep of {SWEEP_RUNS} one-request runs; "
          f"{os.cpu_count()} CPU cores")
    print("| registered servers | POST /api/runs per s | sweep seconds | runs/s | vs 1 server |")
    print("|---:|---:|---:|---:|---:|")
    for w, r in results.items():
        print(f"| {w} | {r['submit_per_s']:.0f} | {r['seconds']:.1f} | {r['runs_per_s']:.1f} "
              f"| {r['runs_per_s'] / first:.2f}x |")
    best = max(results.values(), key=lambda r: r["runs_per_s"])
    print(f"schedule: up to {best['runs_per_s']:.1f} runs/s; "
          f"{levels[-1]} servers / 1 server {results[levels[-1]]['runs_per_s'] / first:.2f}x")


if __name__ == "__main__":
    main()
