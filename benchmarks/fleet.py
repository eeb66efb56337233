"""The Ray backend against local processes, on this machine, measured side by side.

Part 1, the same server both ways: two services run at once, one with local processes,
one on a Ray cluster made here (``ray.cluster_utils``: a head and one node). Each starts
its own server (the stub vLLM server of the tests, ``tests/stub_vllm.py``, tokens
``--interval`` apart), and their runs alternate (local, Ray, local, Ray, ...), each with
a seed of its own. Per run: the median ITL its drivers measured, and the time from the
POST of the run to its first token (one clock: every process here reads the same
monotonic clock, and the Ray drivers' samples come back on the service's). Printed: the
Ray/local ratio of median ITL, geometric mean with a Welch t 95% interval on the logs
(``scipy.stats``), and the submit-to-first-token times.

Part 2, a fleet: 16 runs of one kind over 4 fake GPU nodes of one GPU each (stub
servers): runs per second from the first POST to the last end, and how the servers the
runs used spread over the nodes.

Everything runs in this script's session (one autogroup), so the two services share the
CPU as they would share a machine.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ray
from harness import AUTH, REPO, TOKEN, free_port, stop, wait_http
from ray.cluster_utils import Cluster
from scipy import stats

STUB = f"{shlex.quote(sys.executable)} {shlex.quote(str(REPO / 'tests' / 'stub_vllm.py'))}"
RUN: dict[str, Any] = {"input_len": 64, "output_len": 64, "num_prompts": 16, "max_concurrency": 4}


@contextmanager
def service(data_dir: Path, env: dict[str, str]) -> Iterator[httpx.Client]:
    """A service process (real HTTP, real SQLite) in this script's session."""
    port = free_port()
    full = {**os.environ, "DECODEBENCH_DATA_DIR": str(data_dir), "DECODEBENCH_PORT": str(port),
            "DECODEBENCH_API_TOKEN": TOKEN, "DECODEBENCH_GPUS": "", "DECODEBENCH_VLLM_COMMAND": STUB,
            "DECODEBENCH_SCHEDULER_POLL_S": "0.05", "DECODEBENCH_HUB_CHECK": "off", **env}
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / "service.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=full, stdout=log,
                                stderr=subprocess.STDOUT, process_group=0)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, timeout=120)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=60) as client:
            yield client
    finally:
        stop(proc)


def ray_env(cluster: Cluster, namespace: str) -> dict[str, str]:
    return {"DECODEBENCH_RAY_ADDRESS": cluster.address, "DECODEBENCH_RAY_NAMESPACE": namespace,
            "DECODEBENCH_RAY_SERVER_HOST": "127.0.0.1", "DECODEBENCH_RAY_FORWARD_ENV": "VLLM_,STUB_"}


def finished(client: httpx.Client, run_id: str, timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        run = client.get(f"/api/runs/{run_id}").json()
        if run["status"] in ("succeeded", "failed", "cancelled"):
            if run["status"] != "succeeded":
                raise RuntimeError(f"run {run_id} {run['status']}: {run['error']}")
            return dict(run)
        if time.monotonic() > deadline:
            raise RuntimeError(f"run {run_id} did not finish")
        time.sleep(0.02)


def one_run(client: httpx.Client, seed: int) -> tuple[float, float]:
    """A run's median ITL (ms) and the time from its POST to its first token (s)."""
    posted = time.perf_counter()
    run_id = client.post("/api/runs", json={**RUN, "seed": seed}).json()["id"]
    run = finished(client, run_id)
    samples = client.get(f"/api/runs/{run_id}/requests").json()
    first = min(s["start_time"] + s["ttft"] for s in samples if s["success"])
    return float(run["summary"]["median_itl_ms"]), first - posted


def log_ratio_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Geometric mean of a/b with a Welch t 95% interval on the logs."""
    la, lb = np.log(a), np.log(b)
    ci = stats.ttest_ind(la, lb, equal_var=False).confidence_interval(0.95)
    return math.exp(la.mean() - lb.mean()), math.exp(ci.low), math.exp(ci.high)


def part1(trials: int, interval: float) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=1)
    cluster.wait_for_nodes()
    stub_env = {"STUB_TOKEN_INTERVAL_S": str(interval)}
    try:
        with tempfile.TemporaryDirectory(prefix="decodebench-fleet-") as tmp, \
                service(Path(tmp) / "local", stub_env) as local, \
                service(Path(tmp) / "ray", {**stub_env, **ray_env(cluster, "fleet-bench-1")}) as on_ray:
            # Each starts its server (and warms its drivers) before anything is timed.
            one_run(local, 10_000)
            one_run(on_ray, 10_001)
            itl: dict[str, list[float]] = {"local": [], "ray": []}
            first: dict[str, list[float]] = {"local": [], "ray": []}
            for k in range(trials):
                for name, client in (("local", local), ("ray", on_ray)) if k % 2 == 0 else \
                        (("ray", on_ray), ("local", local)):
                    median_itl, to_first = one_run(client, 2 * k + (name == "ray"))
                    itl[name].append(median_itl)
                    first[name].append(to_first)
                    print(f"trial {k} {name:5}: median ITL {median_itl:.2f} ms, submit to first token "
                          f"{to_first * 1000:.0f} ms", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    ratio, lo, hi = log_ratio_interval(itl["ray"], itl["local"])
    print(f"\nsame stub server ({interval * 1000:g} ms a token), {trials} alternating runs each, "
          f"{RUN['num_prompts']} requests x {RUN['output_len']} tokens at concurrency "
          f"{RUN['max_concurrency']}")
    print("| backend | median ITL, ms (mean [min, max]) | submit to first token, ms (median [min, max]) |")
    print("|---|---:|---:|")
    for name in ("local", "ray"):
        print(f"| {name} | {np.mean(itl[name]):.2f} [{min(itl[name]):.2f}, {max(itl[name]):.2f}] | "
              f"{np.median(first[name]) * 1000:.0f} [{min(first[name]) * 1000:.0f}, "
              f"{max(first[name]) * 1000:.0f}] |")
    print(f"\nfleet: ray/local median ITL {ratio:.3f} [{lo:.3f}, {hi:.3f}]")


def part2(runs: int, nodes: int) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(nodes):
        cluster.add_node(num_cpus=1, num_gpus=1)
    cluster.wait_for_nodes()
    try:
        with tempfile.TemporaryDirectory(prefix="decodebench-fleet-") as tmp, \
                service(Path(tmp) / "ray", {"STUB_TOKEN_INTERVAL_S": "0.005",
                                            **ray_env(cluster, "fleet-bench-2")}) as client:
            spec = {**RUN, "num_prompts": 8}
            started = time.perf_counter()
            ids = [client.post("/api/runs", json={**spec, "seed": k}).json()["id"] for k in range(runs)]
            done = [finished(client, run_id) for run_id in ids]
            elapsed = time.perf_counter() - started
            workers = {w["id"]: w for w in client.get("/api/workers").json()}
    finally:
        ray.shutdown()
        cluster.shutdown()
    servers = {r["worker_id"] for r in done}
    per_node = collections.Counter(workers[w]["node"]["id"][:8] for w in servers)
    runs_per_node = collections.Counter(workers[r["worker_id"]]["node"]["id"][:8] for r in done)
    print(f"\n{runs} runs of {spec['num_prompts']} requests over {nodes} nodes of one fake GPU each "
          f"(stub servers, 5 ms a token)")
    print(f"runs per second (first POST to last end, server starts included): {runs / elapsed:.2f} "
          f"({elapsed:.1f} s)")
    print(f"servers used: {len(servers)}; servers per node: {dict(per_node)}; "
          f"runs per node: {dict(runs_per_node)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--interval", type=float, default=0.01,
                        help="stub server's seconds between tokens")
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=4)
    args = parser.parse_args()
    part1(args.trials, args.interval)
    part2(args.runs, args.nodes)


if __name__ == "__main__":
    main()
