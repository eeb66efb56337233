"""Does the control plane disturb a measurement? One run measured against a token stub
with the service idle, and again with the service busy, interleaved (idle, busy, idle,
busy, ...).

The service runs as its own process with two registered ``token_stub.py`` servers.
The measured run streams tokens exactly ``--interval`` apart, so its median ITL error
(distance from the stub's true interval) is what the client added. Busy means, all
while the measured run goes: another run on the second stub sending 10,000 short
requests, finishing (saving and summarising its 10,000 samples) in the middle of the
measured run; 20 page loads per second (index and run pages); connector reports every
50 ms. Target: the busy error within 1% (of the interval) of the idle error.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from harness import MODEL, service_with_stubs

FINISHED = ("succeeded", "failed", "cancelled")


def _wait(client: httpx.Client, run_id: str) -> dict[str, Any]:
    while (run := client.get(f"/api/runs/{run_id}").json())["status"] not in FINISHED:
        time.sleep(0.1)
    if run["status"] != "succeeded":
        raise SystemExit(f"run {run_id} did not succeed: {run['error']}")
    return run


def _itl_error(client: httpx.Client, run_id: str, interval: float) -> float:
    samples = client.get(f"/api/runs/{run_id}/requests").json()
    gaps = [g for s in samples for g in s["itl"]]
    return abs(statistics.median(gaps) - interval) / interval


def _busy(client: httpx.Client, stop: threading.Event, token: str, background: str) -> dict[str, int]:
    """Page loads at 20/s and a connector report every 50 ms until ``stop``."""
    counts = {"pages": 0, "reports": 0}
    report = {"role": "worker", "rank": 0, "runs": {background: {"requests_filled": 1}}}
    worker = {"Authorization": f"Bearer {token}"}
    next_page = next_report = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_page:
            path = "/" if counts["pages"] % 2 else f"/runs/{background}"
            client.get(path).raise_for_status()
            counts["pages"] += 1
            next_page += 1 / 20
        if now >= next_report:
            counts["reports"] += 1
            report["runs"][background]["requests_filled"] = counts["reports"]
            client.post("/api/connector/report", json=report, headers=worker).raise_for_status()
            next_report += 0.05
        time.sleep(max(0.0, min(next_page, next_report) - time.monotonic()))
    return counts


def trial(client: httpx.Client, stubs: list[dict[str, Any]], busy: bool, args: argparse.Namespace,
          seed: int) -> dict[str, Any]:
    """One measured run, with the service idle or busy; its ITL error and what went on."""
    measured = {"model": MODEL, "input_len": 16, "output_len": args.tokens, "num_prompts": args.streams,
                "max_concurrency": args.streams, "seed": seed}
    extra: dict[str, Any] = {}
    stop = threading.Event()
    loader: threading.Thread | None = None
    background = None
    if busy:
        # Posted first, so it takes the first idle stub and the measured run the other.
        background = client.post("/api/runs", json={
            "model": MODEL, "input_len": 16, "output_len": 1, "num_prompts": args.background,
            "max_concurrency": 64, "seed": seed + 1}).json()["id"]
    run_id = client.post("/api/runs", json=measured).json()["id"]
    if busy:
        assert background is not None
        token = next(s["token"] for s in stubs)
        with httpx.Client(base_url=str(client.base_url), headers=client.headers, timeout=60) as pages:
            result: dict[str, dict[str, int]] = {}
            loader = threading.Thread(target=lambda: result.update(c=_busy(pages, stop, token, background)))
            loader.start()
            try:
                bg = _wait(client, background)
                run = _wait(client, run_id)
            finally:
                stop.set()
                loader.join()
        inside = run["started_at"] < bg["finished_at"] < run["finished_at"]
        extra = {**result["c"], "background_inside": inside}
    else:
        run = _wait(client, run_id)
    return {"error": _itl_error(client, run_id, args.interval), **extra}


def main() -> None:
    """Print idle against busy."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--background", type=int, default=10_000)
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"idle": [], "busy": []}
    with tempfile.TemporaryDirectory(prefix="decodebench-interference-") as tmp, \
            service_with_stubs(Path(tmp) / "var", stubs=2, interval=args.interval) as (client, _, stubs):
        for t in range(args.trials):
            for mode in ("idle", "busy"):
                r = trial(client, stubs, mode == "busy", args, seed=1000 * t + (mode == "busy"))
                results[mode].append(r)
                print(f"trial {t + 1} {mode}: median ITL error {100 * r['error']:.2f}% "
                      + (f"({r['pages']} page loads, {r['reports']} reports, background run finished "
                         f"{'inside' if r['background_inside'] else 'OUTSIDE'} the measured run)"
                         if mode == "busy" else ""), flush=True)
    print(f"\n{args.streams} streams x {args.tokens} tokens, {1000 * args.interval:.0f} ms apart; "
          f"{args.trials} interleaved trials")
    print("| control plane | median ITL error, mean | worst |")
    print("|---|---:|---:|")
    means = {}
    for mode, rs in results.items():
        errors = [100 * r["error"] for r in rs]
        means[mode] = statistics.mean(errors)
        print(f"| {mode} | {means[mode]:.2f}% | {max(errors):.2f}% |")
    print(f"interference: median ITL error idle {means['idle']:.2f}%, busy {means['busy']:.2f}%; "
          f"busy - idle {means['busy'] - means['idle']:+.2f} points (target within 1)")


if __name__ == "__main__":
    main()
