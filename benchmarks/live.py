"""What a progress display costs the service: ``GET /api/runs/{id}/live`` from 1k to 20k
requests done of one long run.

The service runs as its own process (``python -m service``, real HTTP, real SQLite) with a
registered ``token_stub.py`` streaming tokens 1 ms apart; one run of 20,000 requests x 2
tokens at concurrency 64, sent at 250 requests/s (unpaced, the stub answers faster than the
service saves, and the requests done it shows jump by thousands), polled every 0.1 s
(``decodebench bench serve`` polls every 0.5 s; faster here, so that each level gets calls
while the run passes it). Each call is timed from the client and counted at a level when its
requests done are within a tenth of it; calls once every request is done, while the runner
computes the summary, are a row of their own. For scale, the same figure recomputed from the
stored samples (what the route did per poll before the runner kept a running one: read every
sample, then ``decode_stats``) is timed afterwards on the run's database, over its first 1k
to 20k samples.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import MODEL, REPO, service_with_stubs

sys.path.insert(0, str(REPO))

from service.analysis.metrics import decode_stats
from service.storage import measurements
from service.storage.db import make_engine

POLL_S = 0.1
BANDS = (1_000, 5_000, 10_000, 15_000, 20_000)
# A call counts at a level when its requests done are within this share of it.
NEAR = 0.1


def recomputed_s(db: Path, run_id: str, upto: int) -> float:
    """Seconds to read a run's first ``upto`` stored samples and take their decode median."""
    engine = make_engine(db)
    try:
        started = time.perf_counter()
        samples = []
        for found in measurements.sample_slices(engine, run_id):
            samples.extend(found)
            if len(samples) >= upto:
                break
        decode_stats(samples[:upto])
        return time.perf_counter() - started
    finally:
        engine.dispose()


def main() -> None:
    """Run once and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rate", type=float, default=250.0, help="requests/s sent")
    parser.add_argument("--poll", type=float, default=POLL_S, help="seconds between /live calls")
    args = parser.parse_args()
    bands = [b for b in BANDS if b <= args.requests]
    with tempfile.TemporaryDirectory(prefix="decodebench-live-") as tmp:
        data = Path(tmp) / "var"
        with service_with_stubs(data) as (client, _, _):
            run = client.post("/api/runs", json={
                "model": MODEL, "input_len": 16, "output_len": 2, "num_prompts": args.requests,
                "max_concurrency": args.concurrency,
                "request_rate": args.rate}).json()
            calls: list[tuple[int, float, str]] = []
            submitted = time.perf_counter()
            while True:
                started = time.perf_counter()
                live = client.get(f"/api/runs/{run['id']}/live").json()
                calls.append((live["completed"] + live["failed"], time.perf_counter() - started,
                              live["status"]))
                if live["status"] not in ("queued", "starting", "running"):
                    break
                time.sleep(args.poll)
            wall = time.perf_counter() - submitted
            done = client.get(f"/api/runs/{run['id']}").json()
        if done["status"] != "succeeded":
            raise RuntimeError(f"the run ended {done['status']}: {done['error']}")
        before = {b: recomputed_s(data / "decodebench.sqlite3", run["id"], b) for b in bands}
    rate = done["summary"]["request_throughput"]
    print(f"one run of {args.requests} requests x 2 tokens at concurrency {args.concurrency}, "
          f"{args.rate:g} requests/s sent, "
          f"/live polled every {args.poll} s; {os.cpu_count()} CPU cores; the run went at "
          f"{rate:.0f} requests/s and ended {wall:.1f} s after its POST")
    print("| requests done | /live calls | /live median ms | /live max ms | recomputed from samples ms |")
    print("|---:|---:|---:|---:|---:|")
    medians = {}
    for band in bands:
        times = [t for n, t, status in calls
                 if status == "running" and abs(n - band) <= NEAR * band and n < args.requests]
        medians[band] = statistics.median(times) if times else None
        shown = (f"{len(times)} | {statistics.median(times) * 1000:.1f} | {max(times) * 1000:.1f}"
                 if times else "0 | - | -")
        print(f"| {band} | {shown} | {before[band] * 1000:.0f} |")
    summing = [t for n, t, status in calls if status == "running" and n == args.requests]
    if summing:
        print(f"| {args.requests}, summary being computed | {len(summing)} | "
              f"{statistics.median(summing) * 1000:.1f} | {max(summing) * 1000:.1f} | |")
    first, last = medians[bands[0]], medians[bands[-1]]
    if first and last:
        print(f"live: /live at {bands[-1]} / at {bands[0]} requests done {last / first:.2f}x; "
              f"recomputed {before[bands[-1]] / before[bands[0]]:.1f}x")


if __name__ == "__main__":
    main()
