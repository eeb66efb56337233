"""Curve: how long a decode curve takes through decodebench against real prefill.

One decode curve (input lengths x concurrencies, ``--output-len`` tokens out,
``--prompts`` requests per point), measured two ways in one run of this script:

- ours: one ``POST /api/sweeps`` (fill mode) to a real service whose real vLLM CPU
  worker starts for it; timed from the POST to the end of the sweep's last point,
  worker start included. A second sweep of the same grid with ``stop.itl_ci_pct``
  (each point stops once its median decode ITL is known to +-that percent, from
  ``--stop-min`` requests on, at most ``--prompts``), on a fresh service, so it too
  pays its worker's start.
- real prefill: ``vllm bench serve`` (vLLM's own client, in this process) against one
  vLLM server without a KV connector, with the worker's engine flags and CPU binding,
  started once and timed from its start; a distinct ``--seed`` per point, so no
  request is shortened by the prefix cache.

Only one vLLM server is alive at a time (two disturb each other on 2 cores). With
``--trials N`` the three arms are measured N times, in a new order each trial.

Per point it prints each side's median ITL and decode-only median ITL with their 95%
intervals (bootstrap over requests, ``service.analysis.intervals``), and each arm's worker start
apart from its total. The last lines:

    curve: ours X s vs real prefill Y s: ours/real Z.ZZ
    curve (stop.itl_ci_pct P): ours X s vs real prefill Y s: ours/real Z.ZZ
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fidelity import engine, mean_ci, reference_server, service  # noqa: E402

from service.analysis.intervals import Interval, pooled_median_ci  # noqa: E402
from service.analysis.metrics import summarize  # noqa: E402
from service.analysis.steady_window import steady_gaps  # noqa: E402
from service.core.sample import Sample  # noqa: E402
from service.core.shapes import ensure_bundled  # noqa: E402
from service.core.tinymodel import TINY_MODEL_NAME  # noqa: E402

ARMS = ("ours", "ours_stop", "real")


@dataclass
class PointResult:
    """One arm's figures at one point."""

    requests: int
    itl: Interval | None
    decode_itl: Interval | None
    median_tpot_ms: float
    stop: str = ""


@dataclass
class ArmResult:
    """One arm's measurement of the whole curve."""

    total_s: float
    start_s: float
    points: dict[tuple[int, int], PointResult] = field(default_factory=dict)


def _figures(samples: list[Sample], duration: float, stop: str = "") -> PointResult:
    ok = [s for s in samples if s.success]
    if len(ok) < len(samples):
        raise SystemExit(f"{len(samples) - len(ok)} requests failed: "
                         f"{next(s.error for s in samples if not s.success)}")
    summary = summarize(ok, duration)
    return PointResult(
        requests=len(ok),
        itl=pooled_median_ci([np.asarray(s.itl) for s in ok]),
        decode_itl=pooled_median_ci(steady_gaps(ok)),
        median_tpot_ms=float(summary["median_tpot_ms"]),
        stop=stop,
    )


def run_ours(work: Path, grid: dict[str, list[int]], args: argparse.Namespace, seed: int,
             stop_pct: float | None) -> ArmResult:
    """One sweep through a fresh service; timed from the POST to the last point's end."""
    base: dict[str, Any] = {"model": args.model, "engine": engine(args).model_dump(exclude_defaults=True),
                            "output_len": args.output_len, "num_prompts": args.prompts,
                            "seed": seed, "mode": "fill"}
    if stop_pct is not None:
        base["stop"] = {"itl_ci_pct": stop_pct, "min_prompts": args.stop_min}
    tag = "stop" if stop_pct is not None else "fixed"
    (work / f"ours-{tag}-{seed}").mkdir(parents=True)
    with service(work / f"ours-{tag}-{seed}", {}) as api:
        began = time.monotonic()
        sweep = api.post("/api/sweeps", json={"base": base, "grid": grid}).json()
        if "id" not in sweep:
            raise SystemExit(f"the service refused the sweep: {sweep}")
        first_running: float | None = None
        while True:
            sweep = api.get(f"/api/sweeps/{sweep['id']}").json()
            runs = sweep["runs"]
            if first_running is None and any(r["status"] != "queued" and r["started_at"] for r in runs):
                first_running = time.monotonic()
            if all(r["status"] in ("succeeded", "failed", "cancelled") for r in runs):
                break
            time.sleep(0.25)
        total = time.monotonic() - began
        bad = [r for r in runs if r["status"] != "succeeded"]
        if bad:
            raise SystemExit(f"run {bad[0]['id']} {bad[0]['status']}: {bad[0]['error']}")
        result = ArmResult(total, (first_running or began) - began)
        for run in runs:
            rows = api.get(f"/api/runs/{run['id']}/requests").json()
            samples = [Sample(index=r["index"], prompt_len=r["prompt_len"],
                              output_tokens=r["output_tokens"], ttft=r["ttft"], itl=r["itl"],
                              latency=r["latency"], start_time=r["start_time"],
                              success=r["success"], error=r["error"]) for r in rows]
            spec = run["spec"]
            stopped = (run.get("stopped_by") or {}).get("rule", "")
            result.points[(spec["input_len"], spec["max_concurrency"])] = _figures(
                samples, run["summary"]["duration"], stopped)
    return result


def run_real(work: Path, model_dir: Path, points: list[tuple[int, int]], args: argparse.Namespace,
             seed: int) -> ArmResult:
    """``vllm bench serve`` per point against one server without a connector."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    began = time.monotonic()
    with reference_server(model_dir, work, args) as (url, _pgid):
        result = ArmResult(0.0, time.monotonic() - began)
        for k, (input_len, concurrency) in enumerate(points):
            parser = FlexibleArgumentParser()
            add_cli_args(parser)
            ns = parser.parse_args([
                "--backend", "openai", "--base-url", url, "--model", str(model_dir),
                "--served-model-name", args.model, "--dataset-name", "random",
                "--random-input-len", str(input_len), "--random-output-len", str(args.output_len),
                "--num-prompts", str(args.prompts), "--max-concurrency", str(concurrency),
                "--seed", str(seed + k), "--ignore-eos", "--temperature", "0", "--disable-tqdm",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--save-detailed",
                "--result-dir", str(work), "--result-filename", "real.json",
            ])
            with contextlib.redirect_stdout(sys.stderr):
                out = main(ns)
            samples = [
                Sample(index=i, prompt_len=n_in, output_tokens=n_out, ttft=ttft, itl=list(itl),
                       latency=lat, start_time=start, success=not err)
                for i, (n_in, n_out, ttft, itl, lat, start, err) in enumerate(zip(
                    out["input_lens"], out["output_lens"], out["ttfts"], out["itls"],
                    out["latencies"], out["start_times"], out["errors"], strict=True))
            ]
            result.points[(input_len, concurrency)] = _figures(samples, out["duration"])
        result.total_s = time.monotonic() - began
    return result


def _ci(interval: Interval | None) -> str:
    if interval is None:
        return "n/a"
    return (f"{interval.value * 1000:.2f} [{interval.lo * 1000:.2f}, {interval.hi * 1000:.2f}] "
            f"+-{interval.half_width_pct():.1f}%")


def _ratio_line(label: str, ours: list[float], real: list[float]) -> str:
    m_o, m_r = float(np.mean(ours)), float(np.mean(real))
    spread = ""
    if len(ours) > 1:
        ratios = [o / r for o, r in zip(ours, real, strict=True)]
        _, lo, hi = mean_ci(ratios)
        spread = f" (per trial {', '.join(f'{r:.2f}' for r in ratios)}; mean [{lo:.2f}, {hi:.2f}])"
    return f"{label}: ours {m_o:.0f} s vs real prefill {m_r:.0f} s: ours/real {m_o / m_r:.2f}{spread}"


def main() -> None:
    """Measure the curve each way and print the tables and the last lines."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default=TINY_MODEL_NAME,
                        help="a bundled model: the tiny one or decodebench-shapes/NAME")
    parser.add_argument("--num-layers", type=int, default=None, help="a shape's layers (default all)")
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default float32 on a CPU)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--input-lens", default="8192,16384,32768")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--prompts", type=int, default=16, help="requests per point")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--stop-pct", type=float, default=2.0, help="stop.itl_ci_pct of the second sweep")
    parser.add_argument("--stop-min", type=int, default=8, help="stop.min_prompts of the second sweep")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seed", type=int, default=5000)
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if "real" not in arms or set(arms) - set(ARMS):
        raise SystemExit(f"--arms must include real and name only {ARMS}")
    lens = [int(n) for n in args.input_lens.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    points = [(n, c) for n in lens for c in concs]
    grid = {"input_len": lens, "max_concurrency": concs}
    results: dict[str, list[ArmResult]] = {a: [] for a in arms}
    order = random.Random(args.seed)
    seed = args.seed
    with tempfile.TemporaryDirectory(prefix="curve-") as tmp:
        work = Path(tmp)
        model_dir = ensure_bundled(work / "models", args.model, args.num_layers)
        for trial in range(args.trials):
            sequence = arms[:]
            order.shuffle(sequence)
            for arm in sequence:
                seed += 100
                if arm == "real":
                    r = run_real(work, model_dir, points, args, seed)
                else:
                    r = run_ours(work, grid, args, seed, args.stop_pct if arm == "ours_stop" else None)
                results[arm].append(r)
                print(f"trial {trial + 1} {arm}: {r.total_s:.1f} s (worker start {r.start_s:.1f} s)",
                      file=sys.stderr, flush=True)

    print(f"curve benchmark: {len(points)} points ({args.input_lens} x concurrency "
          f"{args.concurrency}), {args.output_len} tokens out, {args.prompts} requests per point "
          f"(the stop sweep: +-{args.stop_pct:g}% from {args.stop_min} requests on, at most "
          f"{args.prompts}); {args.trials} trial(s), arms in a new order each")
    for trial in range(args.trials):
        print(f"\ntrial {trial + 1}: median ITL (ms) [95% bootstrap over requests] +-half width; "
              "decode-only median ITL; requests")
        print(f"{'ISL':>6} {'conc':>4}" + "".join(f" | {a + ' ITL':>30} {'decode ITL':>30} {'n':>3}"
                                                  for a in arms))
        for p in points:
            line = f"{p[0]:>6} {p[1]:>4}"
            for a in arms:
                f = results[a][trial].points[p]
                line += f" | {_ci(f.itl):>30} {_ci(f.decode_itl):>30} {f.requests:>3}"
            print(line)
        print("time (s): " + "; ".join(
            f"{a} {results[a][trial].total_s:.1f} (worker start {results[a][trial].start_s:.1f}, "
            f"curve {results[a][trial].total_s - results[a][trial].start_s:.1f})" for a in arms))
    print()
    real = [r.total_s for r in results["real"]]
    real_warm = [r.total_s - r.start_s for r in results["real"]]
    lines = {"ours": "curve", "ours_stop": f"curve (stop.itl_ci_pct {args.stop_pct:g})"}
    for arm in ("ours", "ours_stop"):
        if arm in results:
            warm = [r.total_s - r.start_s for r in results[arm]]
            print(_ratio_line(f"{lines[arm]}, worker start left out", warm, real_warm))
    # The stop sweep's line, then the fixed-count one last.
    for arm in ("ours_stop", "ours"):
        if arm in results:
            print(_ratio_line(lines[arm], [r.total_s for r in results[arm]], real))

if __name__ == "__main__":
    main()
