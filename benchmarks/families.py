"""Each bundled family through the product: server start, fill against real prefill, roofline.

Per family (a bundled shape, reduced to ``--layers`` of its layers by default so that the
whole table fits a 2-core machine), a fresh service and one sweep over ``mode: [fill,
prefill]`` with ``--pairs`` trials: fill trial k and prefill trial k run back to back on one
server as a pair, each with its own seed, so the prefix cache never helps. Printed per
family, from the product's own answers:

- start: seconds from the sweep's POST to its first run measuring (the server's start);
- fill and prefill median TPOT (mean over trials) and the sweep's paired verdict on decode
  TPOT fill/prefill (``service.analysis.fill_verdict``: the interval over pairs);
- the share of the memory-bandwidth floor the fill runs reached (``pct_of_roofline``);
- the fidelity ledger's row for the model (``GET /api/fidelity``): fill/prefill of predicted
  engine step time at matched decode steps, timed inside vLLM by the connector, its decision
  against +-5%, and the client-side error beside it (MAPE of median ITL).

Last lines: ``families: N of M matched within +-5%`` (client side) and ``ledger: N of M
decided within +-5%`` (engine steps).
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

from fidelity import service  # noqa: E402

from service.core import shapes  # noqa: E402

# Fewest layers that keep every kind of layer, and an engine that fits next to nothing else.
FAMILIES: dict[str, tuple[int, dict[str, Any]]] = {
    "smollm2-135m": (30, {}),
    "qwen2.5-0.5b": (4, {}),
    "gemma-3-1b": (6, {}),
    "granite-4.0-h-350m": (4, {}),
    "qwen3-30b-a3b": (1, {"gpu_memory_utilization": 0.45}),
    # The long-context families (issue 48) this machine runs: MLA, sinks with alternating
    # windows, a gated DeltaNet hybrid. Llama-4-Scout's two layers peak at 23 GB of 24 on a
    # plain server here: left to a larger machine.
    "deepseek-v2-lite": (2, {}),
    # Their two layers hold about 8 GiB of weights: the default share (0.3 of the machine)
    # leaves no KV cache.
    "gpt-oss-20b": (2, {"gpu_memory_utilization": 0.5}),
    "qwen3-next-80b-a3b": (2, {"gpu_memory_utilization": 0.5}),
}


def one_family(work: Path, name: str, layers: int, engine: dict[str, Any],
               args: argparse.Namespace) -> dict[str, Any]:
    """One sweep of fill/prefill pairs on a fresh service; the figures of the table."""
    base = {"model": shapes.PREFIX + name, "input_len": args.input_len, "output_len": args.output_len,
            "num_prompts": args.prompts, "max_concurrency": args.concurrency, "seed": args.seed,
            "engine": {"num_layers": layers, "dtype": "bfloat16", **engine}}
    with service(work, {}) as api:
        began = time.monotonic()
        answer = api.post("/api/sweeps", json={"base": base, "grid": {"mode": ["fill", "prefill"]},
                                                "repeats": args.pairs})
        if answer.status_code != 201:
            raise SystemExit(f"{name}: the service refused the sweep: {answer.text}")
        sweep_id = answer.json()["id"]
        started: float | None = None
        while True:
            sweep = api.get(f"/api/sweeps/{sweep_id}").json()
            runs = sweep["runs"]
            if started is None and any(r["status"] not in ("queued", "starting") for r in runs):
                started = time.monotonic() - began
            if all(r["status"] in ("succeeded", "failed", "cancelled") for r in runs):
                break
            time.sleep(1)
        bad = [r for r in runs if r["status"] != "succeeded"]
        if bad:
            raise SystemExit(f"{name}: run {bad[0]['id']} {bad[0]['status']}: {bad[0]['error']}")
        tpot: dict[str, list[float]] = {"fill": [], "prefill": []}
        roofline: list[float] = []
        for run in runs:
            full = api.get(f"/api/runs/{run['id']}").json()
            mode = full["spec"]["mode"]
            tpot[mode].append(float(full["summary"]["decode_median_tpot_ms"]))
            share = ((full["summary"] or {}).get("roofline") or {}).get("pct_of_roofline")
            if mode == "fill" and share is not None:
                roofline.append(float(share))
        verdict = next(v for v in sweep["fill_vs_prefill"])
        tpot_ratio = next(c for c in verdict["ratios"] if c["metric"] == "decode_median_tpot_ms")
        ledger = next((row for row in api.get("/api/fidelity").json()["models"]
                       if row["model"] == base["model"]), None)
    return {"ledger": ledger, "family": shapes.SHAPES[name].family, "layers": layers,
            "start_s": started or float("nan"),
            "fill_ms": float(np.mean(tpot["fill"])), "prefill_ms": float(np.mean(tpot["prefill"])),
            "ratio": tpot_ratio["ratio"], "ci": tpot_ratio["ci"], "verdict": verdict["verdict"],
            "pairs": verdict["pairs"], "roofline_pct": float(np.mean(roofline)) if roofline else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=9000)
    args = parser.parse_args()
    rows = {}
    for name in args.families.split(","):
        layers, engine = FAMILIES[name]
        with tempfile.TemporaryDirectory(prefix=f"families-{name}-") as tmp:
            rows[name] = one_family(Path(tmp), name, layers, engine, args)
        r = rows[name]
        print(f"{name}: {r}", file=sys.stderr, flush=True)
    print(f"{args.input_len} x {args.concurrency}, {args.prompts} prompts x {args.output_len} tokens, "
          f"{args.pairs} fill/prefill pairs per family, bfloat16")
    print(f"{'shape':<20} {'family':<15} {'layers':>6} {'start s':>8} {'fill TPOT':>10} {'prefill':>8} "
          f"{'fill/prefill [95%]':>24} {'verdict':>10} {'% roofline':>11}")
    for name, r in rows.items():
        ci = f"{r['ratio']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r["ci"] else f"{r['ratio']:.3f}"
        print(f"{name:<20} {r['family']:<15} {r['layers']:>6} {r['start_s']:8.0f} {r['fill_ms']:10.2f} "
              f"{r['prefill_ms']:8.2f} {ci:>24} {r['verdict']:>10} {r['roofline_pct']:11.1f}")
    matched = sum(r["verdict"] == "matches" for r in rows.values())
    print(f"families: {matched} of {len(rows)} matched within +-5%")
    print("\nThe fidelity ledger (engine steps timed inside vLLM, GET /api/fidelity):")
    print(f"{'shape':<20} {'steps fill/prefill [95%]':>26} {'decided':>8} {'within 5%':>10} "
          f"{'pairs':>6} {'MAPE median ITL %':>18}")
    within = 0
    for name, r in rows.items():
        row = r["ledger"]
        if row is None or row.get("ratio") is None:
            print(f"{name:<20} {'(no row)':>26} {(row or {}).get('notes')}")
            continue
        v, lo, hi = row["ratio"]
        within += bool(row["decided"] and row["within_5pct"])
        mape = row["mape_median_itl_pct"]
        print(f"{name:<20} {f'{v:.3f} [{lo:.3f}, {hi:.3f}]':>26} {row['decided']!s:>8} "
              f"{row['within_5pct']!s:>10} {row['pairs']:>6} "
              f"{mape if mape is not None else float('nan'):18.2f}")
    print(f"ledger: {within} of {len(rows)} decided within +-5%")


if __name__ == "__main__":
    main()
