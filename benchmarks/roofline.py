"""How close decode comes to the memory-bandwidth floor on this machine.

One service process with a real vLLM CPU server (the bundled tiny model in float32, or a
bundled shape with ``--model``) runs a
sweep of fill-mode runs over input length x concurrency, ``--repeats`` trials per point
interleaved by the sweep, each with its own seed. Each run's summary carries its roofline
(``service.analysis.roofline``) from the sizes and bandwidth the server's connector
measured (``connector.roofline``): bytes a decode step reads (weights, and the KV cache of
every decoding sequence), the least time a step can take at the measured bandwidth, and
that time over the measured decode median ITL. Printed per point: the mean over trials
with their range, and what the rest of the step is (ITL minus the floor: Python, the
scheduler, kernel launches, sampling: time a 2-layer model's tiny steps are made of).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fidelity import engine, service  # noqa: E402


def wait_sweep(client: Any, sweep_id: str, total: int, timeout: float = 3600) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        sweep = client.get(f"/api/sweeps/{sweep_id}").json()
        if sweep["progress"]["finished"] >= total:
            return list(sweep["runs"])
        if time.monotonic() > deadline:
            raise RuntimeError("the sweep did not finish")
        print(f"  {sweep['progress']['finished']}/{total} runs", end="\r", flush=True)
        time.sleep(2)


def spec_line(bandwidth: dict[str, Any]) -> str:
    spec = bandwidth.get("spec_bytes_per_s")
    return f"{spec / 1e9:.0f} GB/s ({bandwidth.get('spec_how')})" if spec else "none (a CPU)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="decodebench-tiny",
                        help="a bundled model: the tiny one or decodebench-shapes/NAME")
    parser.add_argument("--num-layers", type=int, default=None, help="a shape's layers (default all)")
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default float32 on a CPU)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--input-lens", default="1024,4096,16384,32768")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    lens = [int(x) for x in args.input_lens.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    base = {"model": args.model, "engine": engine(args).model_dump(exclude_defaults=True),
            "input_len": lens[0], "output_len": args.output_len, "num_prompts": args.prompts,
            "max_concurrency": concs[0], "mode": "fill", "repeats": args.repeats, "seed": 1000}
    with tempfile.TemporaryDirectory(prefix="decodebench-roofline-") as tmp, service(Path(tmp), {}) as client:
        answer = client.post("/api/sweeps", json={"base": base, "grid": {"input_len": lens,
                                                                        "max_concurrency": concs}})
        answer.raise_for_status()
        sweep = answer.json()
        runs = wait_sweep(client, sweep["id"], len(sweep["runs"]))
        facts = None
        rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for run in runs:
            if run["status"] != "succeeded":
                print(f"run {run['id']} {run['status']}: {run['error']}")
                continue
            full = client.get(f"/api/runs/{run['id']}").json()
            facts = facts or (full["provenance"] or {}).get("roofline")
            roof = (full["summary"] or {}).get("roofline")
            if roof:
                rows.setdefault((run["spec"]["input_len"], run["spec"]["max_concurrency"]), []).append(roof)
    if facts is None:
        raise SystemExit("no run carried the connector's roofline facts")
    bandwidth = facts["bandwidth"]
    print(f"\n{args.model} ({facts['weight_params']:,} streamed parameters, {facts['weight_dtype']}: "
          f"{facts['weight_bytes'] / 1e6:.2f} MB of weights a step; KV {facts['kv_bytes_per_token']} bytes "
          f"per token, {facts['kv_dtype']}), device {facts['device']}")
    print(f"measured bandwidth: {bandwidth['measured_bytes_per_s'] / 1e9:.2f} GB/s ({bandwidth['how']}); "
          f"fill {bandwidth['fill_bytes_per_s'] / 1e9:.2f} GB/s; specified: "
          f"{spec_line(bandwidth)}")
    print(f"{args.repeats} trials per point, {args.prompts} requests x {args.output_len} tokens; "
          "mean [min, max]\n")
    print("| ISL x conc | batch | context | MB/step | floor ms | decode median ITL ms | % of roofline "
          "| rest of the step, ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (isl, conc), trials in sorted(rows.items()):
        def stat(key: str, scale: float = 1.0, fmt: str = ".2f",
                 trials: list[dict[str, Any]] = trials) -> str:
            values = np.array([t[key] for t in trials if t.get(key) is not None], dtype=float) * scale
            if not len(values):
                return "-"
            return f"{values.mean():{fmt}} [{values.min():{fmt}}, {values.max():{fmt}}]"

        rest = np.array([t["decode_median_itl_ms"] - t["min_step_ms"] for t in trials
                         if t.get("decode_median_itl_ms")])
        print(f"| {isl} x {conc} | {stat('batch')} | {stat('context_tokens', fmt='.0f')} | "
              f"{stat('bytes_per_step', 1e-6)} | {stat('min_step_ms')} | {stat('decode_median_itl_ms')} | "
              f"{stat('pct_of_roofline', fmt='.1f')} | "
              f"{rest.mean():.2f} [{rest.min():.2f}, {rest.max():.2f}] |")
    worst = min((float(np.mean([t["pct_of_roofline"] for t in trials])), isl, conc)
                for (isl, conc), trials in rows.items())
    best = max((float(np.mean([t["pct_of_roofline"] for t in trials])), isl, conc)
               for (isl, conc), trials in rows.items())
    print(f"\nroofline: {worst[0]:.1f}% at {worst[1]} x {worst[2]} to "
          f"{best[0]:.1f}% at {best[1]} x {best[2]}")


if __name__ == "__main__":
    main()
