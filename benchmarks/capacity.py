"""Capacity search against a uniform scan: the same boundary, and what each costs.

On a stub vLLM server whose inter-token time grows with the streams it runs
(``tests/stub_vllm.py``, ``STUB_ITL_SLOPE_S``): 10 ms + 10 ms per stream, so with the limit
``decode_median_itl_ms <= 65`` the true boundary is 5 (60 ms) and 6 fails (70 ms).

- (a) the search: ``POST /api/capacity`` up to ``--max-concurrency``, ``--searches`` times;
- (b) a uniform scan through decodebench: ``POST /api/sweeps`` over 10 concurrency levels
  with ``repeats: 3`` (as ``vllm bench sweep serve_workload`` scans: 10 levels x 3 runs),
  64 requests each (the search's probe at 16: a sweep's base is one count); its boundary
  is the largest level, from 1 up, whose mean figure over its 3 trials stays under the limit.

With ``--real``, on a real vLLM CPU server with the bundled tiny model instead (the service
starts it; fill runs at ``--input-len``, default 16384, where attention over the filled
context makes the inter-token time grow with the streams), against ``--limit-ms``; the true
boundary is not known there, so the search and the scan are compared with each other.
``--vllm-sweep SECONDS`` then also runs ``vllm bench sweep serve_workload`` (real prefill,
10 levels x 3 runs, ``--vllm-prompts`` requests a run) on a plain server of the same model,
stopped after that many seconds; its boundary is read off its median TPOT per level.

Prints runs (the search's: mean, least and most over its searches), wall time and
boundary of each, and whether they agree (within one step of the scan's grid). Run:
``python benchmarks/capacity.py`` (under the vLLM lock with ``--real``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
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


def search(client: httpx.Client, ceiling: int, shape: dict[str, Any]) -> dict[str, Any]:
    """One capacity search to its end: boundary, runs, wall seconds."""
    body = {"base": {"output_len": shape["output_len"]}, "input_lens": [shape["input_len"]],
            "max_concurrency": ceiling, "sla": {"metric": "decode_median_itl_ms", "max_ms": shape["limit"]}}
    found = client.post("/api/capacity", json=body).json()
    while found["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(1)
        found = client.get(f"/api/capacity/{found['id']}").json()
    (context,) = found["contexts"]
    figures = {p["concurrency"]: (p["figure_ms"], p["trials"], p["verdict"]) for p in context["probes"]}
    return {"boundary": context["max_concurrency"], "first_failing": context["first_failing"],
            "runs": found["runs"], "wall_s": found["wall_s"], "decided": context["decided"],
            "probes": figures, "statement": context["statement"]}


def scan(client: httpx.Client, shape: dict[str, Any]) -> dict[str, Any]:
    """The uniform scan: 10 levels x 3 trials, as one sweep; its boundary read off the means."""
    body = {"base": {"output_len": shape["output_len"], "input_len": shape["input_len"],
                     "num_prompts": 4 * max(LEVELS)},
            "grid": {"max_concurrency": LEVELS}, "repeats": 3}
    sweep = client.post("/api/sweeps", json=body).json()
    while True:
        time.sleep(2)
        sweep = client.get(f"/api/sweeps/{sweep['id']}").json()
        if all(r["status"] in ("succeeded", "failed", "cancelled") for r in sweep["runs"]):
            break
    means = {int(p["point"]["max_concurrency"]): p["figures"]["decode_median_itl_ms"]["value"]
             for p in sweep["points"]}
    return {"boundary": _read_off(means, shape["limit"]), "runs": len(sweep["runs"]),
            "wall_s": _seconds(sweep["runs"]), "means": means}


def _read_off(means: dict[int, float | None], limit: float) -> int:
    """The largest level, from the lowest up, whose figure stays under the limit."""
    boundary = 0
    for level in sorted(means):
        value = means[level]
        if value is None or value > limit:
            break
        boundary = level
    return boundary


def vllm_sweep(seconds: float, shape: dict[str, Any], prompts: int, out: Path) -> dict[str, Any]:
    """``vllm bench sweep serve_workload`` on a plain vLLM server of the tiny model (real
    prefill), stopped after ``seconds``: the runs it finished, its wall time and, when it got
    through, the boundary read off the median TPOT (mean over runs) per concurrency: its
    median ITL came out at 0.003 ms on the CPU server here (most gaps between the chunks
    its client timed were near 0), no decode figure to put a limit on."""
    from service.core.tinymodel import TINY_MODEL_NAME, ensure_tiny_model

    model_dir = ensure_tiny_model(out / "models")
    port = free_port()
    # The `vllm` entry point of a CPU build installed without its metadata cannot start;
    # the same code through its modules can (`vllm bench serve` is vllm.benchmarks.serve).
    python = shlex.quote(sys.executable)
    wrapper = out / "bench_serve.py"
    wrapper.write_text("import sys\nfrom vllm.benchmarks.serve import add_cli_args, main\n"
                       "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                       "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\n"
                       "main(parser.parse_args(sys.argv[1:]))\n")
    serve = (f"{python} -m vllm.entrypoints.openai.api_server --model {model_dir} "
             f"--served-model-name {TINY_MODEL_NAME} --host 127.0.0.1 --port {port} --dtype float32 "
             "--load-format dummy --enforce-eager --kv-cache-memory-bytes 1073741824")
    bench = (f"{python} {wrapper} --model {TINY_MODEL_NAME} --tokenizer {model_dir} --host 127.0.0.1 "
             f"--port {port} --dataset-name random --random-input-len {shape['input_len']} "
             f"--random-output-len {shape['output_len']} --num-prompts {prompts} --ignore-eos")
    argv = [sys.executable, "-m", "vllm.benchmarks.sweep.serve_workload", "--serve-cmd", serve,
            "--bench-cmd", bench, "--workload-var", "max_concurrency", "--workload-iters", "10",
            "--num-runs", "3", "-o", str(out / "results"),
            # Its default after each run resets the server's caches through an endpoint a
            # plain server does not serve; random prompts share no prefix to reset.
            "--after-bench-cmd", f"{python} -c pass"]
    started = time.monotonic()
    with (out / "serve_workload.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=seconds)
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
            # It starts its server in a session of its own: an interrupt lets it stop it.
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                stop(proc)
    wall = time.monotonic() - started
    records = [json.loads(p.read_text()) for p in (out / "results").rglob("run=*.json")
               if "failure" not in p.name]
    by_level: dict[int, list[float]] = {}
    for record in records:
        by_level.setdefault(int(record["max_concurrency"]), []).append(float(record["median_tpot_ms"]))
    means: dict[int, float | None] = {c: statistics.mean(v) for c, v in sorted(by_level.items())}
    return {"finished": finished and proc.returncode == 0, "runs": len(records), "wall_s": wall,
            "means": means, "boundary": _read_off(means, shape["limit"]) if finished else None}


def main() -> None:
    """Start a service with sloped stubs, run the searches and the scan, print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--searches", type=int, default=3)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--no-scan", action="store_true")
    parser.add_argument("--only-vllm-sweep", action="store_true",
                        help="with --real: only (c), serve_workload (no service, no search, no scan)")
    parser.add_argument("--real", action="store_true",
                        help="a real vLLM CPU server with the tiny model instead of the sloped stub")
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--limit-ms", type=float, default=None)
    parser.add_argument("--vllm-sweep", type=float, default=0.0, metavar="SECONDS",
                        help="with --real: also vllm bench sweep serve_workload, stopped after SECONDS")
    parser.add_argument("--vllm-prompts", type=int, default=16)
    parser.add_argument("--prior", action="store_true",
                        help="the stub reports roofline facts that are its own law (10 ms of weights, "
                             "10 ms of KV a stream), so the search aims from its first probe")
    args = parser.parse_args()
    shape = {"input_len": args.input_len or (16384 if args.real else INPUT_LEN),
             "output_len": args.output_len or (32 if args.real else OUTPUT_LEN),
             "limit": args.limit_ms or (10.0 if args.real else LIMIT_MS)}
    data = Path(tempfile.mkdtemp(prefix="capacity-bench-"))
    port = free_port()
    env = {**os.environ, "DECODEBENCH_DATA_DIR": str(data), "DECODEBENCH_PORT": str(port),
           "DECODEBENCH_API_TOKEN": TOKEN, "DECODEBENCH_GPUS": "", "DECODEBENCH_VLLM_COMMAND": STUB,
           "DECODEBENCH_SCHEDULER_POLL_S": "0.1",
           "STUB_TOKEN_INTERVAL_S": "0.010", "STUB_ITL_SLOPE_S": "0.010"}
    if args.real:
        env.pop("DECODEBENCH_VLLM_COMMAND")
    elif args.prior:
        # 1 GB of weights and 1 GB of KV a stream at the mean context (input + half the
        # output), read at 100 GB/s: 10 ms + 10 ms a stream, the stub's own step.
        context = shape["input_len"] + shape["output_len"] / 2
        env["STUB_ROOFLINE"] = json.dumps({
            "weight_bytes": 10**9, "weight_params": 5 * 10**8, "kv_bytes_per_token": round(1e9 / context),
            "kv_dtype": "bfloat16", "weight_dtype": "bfloat16", "tensor_parallel_size": 1,
            "bandwidth": {"measured_bytes_per_s": 10**11, "how": "the stub's law"}, "device": "stub"})
    if args.only_vllm_sweep:
        swept = vllm_sweep(args.vllm_sweep, shape, args.vllm_prompts, data)
        print(f"vllm sweep: {swept}", flush=True)
        return
    service = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", service)
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as client:
            found = []
            for _ in range(args.searches):
                found.append(search(client, args.max_concurrency, shape))
                print(f"search: {found[-1]}", flush=True)
            scanned = None if args.no_scan else scan(client, shape)
            print(f"scan: {scanned}", flush=True)
    finally:
        stop(service)
    swept = None
    if args.real and args.vllm_sweep > 0:
        swept = vllm_sweep(args.vllm_sweep, shape, args.vllm_prompts, data)
        print(f"vllm sweep: {swept}", flush=True)
    if args.real:
        print(f"real vLLM CPU, tiny model, input_len {shape['input_len']}, output_len "
              f"{shape['output_len']}; limit decode_median_itl_ms <= {shape['limit']:g} ms")
    else:
        print(f"stub: ITL 10 ms + 10 ms per stream; limit decode_median_itl_ms <= {LIMIT_MS:g} ms; "
              f"true boundary {TRUE_BOUNDARY}")
    print(f"{'method':<34} {'runs':>14} {'wall s':>16} {'boundary':>12}")
    runs = [f["runs"] for f in found]
    walls = [f["wall_s"] for f in found]
    spread = (f"{statistics.mean(runs):.1f} ({min(runs)}-{max(runs)})",
              f"{statistics.median(walls):.0f} ({min(walls):.0f}-{max(walls):.0f})")
    print(f"{'search (a), ' + str(len(found)) + ' times':<34} {spread[0]:>14} {spread[1]:>16} "
          f"{','.join(str(f['boundary']) for f in found):>12}")
    if scanned is not None:
        print(f"{'uniform scan (b), 10 x 3':<34} {scanned['runs']:>14} {scanned['wall_s']:>16.0f} "
              f"{scanned['boundary']:>12}")
        step = {b: i for i, b in enumerate(LEVELS)}
        agree = all(abs(step.get(f["boundary"], -9) - step[scanned["boundary"]]) <= 1 for f in found)
        print(f"ratio runs (a)/(b): {statistics.median(runs) / scanned['runs']:.2f}; "
              f"wall (a)/(b): {statistics.median(walls) / scanned['wall_s']:.2f}; "
              f"boundaries agree within one step: {agree}"
              + ("" if args.real else
                 f"; search exact: {all(f['boundary'] == TRUE_BOUNDARY for f in found)}"))
        print("scan means (ms): " + ", ".join(f"{c}: {v:.1f}" for c, v in scanned["means"].items()))
    if swept is not None:
        print(f"{'vllm serve_workload (c)':<34} {swept['runs']:>14} {swept['wall_s']:>16.0f} "
              f"{swept['boundary'] if swept['boundary'] is not None else '-':>12}"
              + ("" if swept["finished"] else f"  (stopped after {args.vllm_sweep:g} s, unfinished)"))
        print("serve_workload median TPOT means (ms): "
              + ", ".join(f"{c}: {v:.1f}" for c, v in swept["means"].items()))


if __name__ == "__main__":
    main()
