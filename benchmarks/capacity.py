"""Capacity search against a uniform scan: the same boundary, and what each costs.

On a stub vLLM server whose inter-token time grows with the streams it runs
(``tests/stub_vllm.py``, ``STUB_ITL_SLOPE_S``): 10 ms + 10 ms per stream, so with the limit
``decode_median_itl_ms <= 65`` the true boundary is 5 (60 ms) and 6 fails (70 ms).

- (a) the search: ``POST /api/capacity`` up to ``--max-concurrency``, ``--searches`` times;
- (b) a uniform scan through decodebench: ``POST /api/sweeps`` over 10 concurrency levels
  with ``repeats: 3`` (as ``vllm bench sweep serve_workload`` scans: 10 levels x 3 runs),
  64 requests each (the search's probe at 16: a sweep's base is one count); its boundary
  is the largest level, from 1 up, whose mean figure over its 3 trials stays under the limit.

Prints runs, wall time and boundary of each, and whether they agree (within one step of
the scan's grid). Run: ``python benchmarks/capacity.py``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.harness import AUTH, REPO, TOKEN, free_port, stop, wait_http  # noqa: E402

STUB = f"{shlex.quote(sys.executable)} {shlex.quote(str(REPO / 'tests' / 'stub_vllm.py'))}"
LIMIT_MS = 65.0
TRUE_BOUNDARY = 5
LEVELS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
OUTPUT_LEN = 8
INPUT_LEN = 64


def _seconds(runs: list[dict[str, Any]]) -> float:
    starts = [datetime.fromisoformat(r["started_at"]) for r in runs if r.get("started_at")]
    ends = [datetime.fromisoformat(r["finished_at"]) for r in runs if r.get("finished_at")]
    return (max(ends) - min(starts)).total_seconds()


def search(client: httpx.Client, ceiling: int) -> dict[str, Any]:
    """One capacity search to its end: boundary, runs, wall seconds."""
    body = {"base": {"output_len": OUTPUT_LEN}, "input_lens": [INPUT_LEN], "max_concurrency": ceiling,
            "sla": {"metric": "decode_median_itl_ms", "max_ms": LIMIT_MS}}
    found = client.post("/api/capacity", json=body).json()
    while found["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(1)
        found = client.get(f"/api/capacity/{found['id']}").json()
    (context,) = found["contexts"]
    return {"boundary": context["max_concurrency"], "first_failing": context["first_failing"],
            "runs": found["runs"], "wall_s": found["wall_s"], "decided": context["decided"]}


def scan(client: httpx.Client) -> dict[str, Any]:
    """The uniform scan: 10 levels x 3 trials, as one sweep; its boundary read off the means."""
    body = {"base": {"output_len": OUTPUT_LEN, "input_len": INPUT_LEN, "num_prompts": 4 * max(LEVELS)},
            "grid": {"max_concurrency": LEVELS}, "repeats": 3}
    sweep = client.post("/api/sweeps", json=body).json()
    while True:
        time.sleep(2)
        sweep = client.get(f"/api/sweeps/{sweep['id']}").json()
        if all(r["status"] in ("succeeded", "failed", "cancelled") for r in sweep["runs"]):
            break
    means = {int(p["point"]["max_concurrency"]): p["figures"]["decode_median_itl_ms"]["value"]
             for p in sweep["points"]}
    boundary = 0
    for level in LEVELS:
        if means[level] is None or means[level] > LIMIT_MS:
            break
        boundary = level
    return {"boundary": boundary, "runs": len(sweep["runs"]), "wall_s": _seconds(sweep["runs"]),
            "means": means}


def main() -> None:
    """Start a service with sloped stubs, run the searches and the scan, print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--searches", type=int, default=3)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--no-scan", action="store_true")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="capacity-bench-"))
    port = free_port()
    env = {**os.environ, "DECODEBENCH_DATA_DIR": str(data), "DECODEBENCH_PORT": str(port),
           "DECODEBENCH_API_TOKEN": TOKEN, "DECODEBENCH_GPUS": "", "DECODEBENCH_VLLM_COMMAND": STUB,
           "DECODEBENCH_SCHEDULER_POLL_S": "0.1",
           "STUB_TOKEN_INTERVAL_S": "0.010", "STUB_ITL_SLOPE_S": "0.010"}
    service = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", service)
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as client:
            found = [search(client, args.max_concurrency) for _ in range(args.searches)]
            scanned = None if args.no_scan else scan(client)
    finally:
        stop(service)
    print(f"stub: ITL 10 ms + 10 ms per stream; limit decode_median_itl_ms <= {LIMIT_MS:g} ms; "
          f"true boundary {TRUE_BOUNDARY}")
    print(f"{'method':<34} {'runs':>10} {'wall s':>16} {'boundary':>12}")
    runs = [f["runs"] for f in found]
    walls = [f["wall_s"] for f in found]
    spread = (f"{min(runs)}-{max(runs)}",
              f"{statistics.median(walls):.0f} ({min(walls):.0f}-{max(walls):.0f})")
    print(f"{'search (a), ' + str(len(found)) + ' times':<34} {spread[0]:>10} {spread[1]:>16} "
          f"{','.join(str(f['boundary']) for f in found):>12}")
    if scanned is not None:
        print(f"{'uniform scan (b), 10 x 3':<34} {scanned['runs']:>10} {scanned['wall_s']:>16.0f} "
              f"{scanned['boundary']:>12}")
        step = {b: i for i, b in enumerate(LEVELS)}
        agree = all(abs(step.get(f["boundary"], -9) - step[scanned["boundary"]]) <= 1 for f in found)
        print(f"ratio runs (a)/(b): {statistics.median(runs) / scanned['runs']:.2f}; "
              f"wall (a)/(b): {statistics.median(walls) / scanned['wall_s']:.2f}; "
              f"boundaries agree within one step: {agree}; "
              f"search exact: {all(f['boundary'] == TRUE_BOUNDARY for f in found)}")
        print("scan means (ms): " + ", ".join(f"{c}: {v:.1f}" for c, v in scanned["means"].items()))


if __name__ == "__main__":
    main()
