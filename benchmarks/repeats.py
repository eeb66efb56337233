"""Repeats: the product's own verdict on fill against real prefill, and what intervals cost.

Part 1 (``--sweep``): one ``POST /api/sweeps`` to a real service with a real vLLM CPU
worker: a grid over ``mode: [fill, prefill]`` x ``--input-lens`` x ``--concurrency``
with ``repeats: --repeats`` (trials interleaved across the points, distinct seeds).
Prints, per point, what the sweep page shows: decode ITL and TPOT of fill over
prefill with their 95% intervals (Welch t over trials) and the verdict, and the
sweep's wall time.

Part 2 (always): the cost and the calibration of the intervals on synthetic runs whose
requests share a per-request level (correlated gaps), so nothing here depends on the
machine's load:

- seconds for ``summary_intervals`` (the 12 intervals every run's summary gets) at
  several run sizes, median of 3;
- how often two draws of one distribution are called different (should be near 5%),
  and how often a 5% and a 10% change is found, over ``--pairs`` pairs of 16-request runs.

Last lines:

    fill/prefill: N points, M match, K differ, U undecided
    intervals: false positives F% [lo, hi]; 5% change found P5%; 10% change found P10%
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fidelity import service  # noqa: E402

from service.analysis.intervals import ratio_by_requests  # noqa: E402
from service.analysis.metrics import summary_intervals  # noqa: E402
from service.core.sample import Sample  # noqa: E402


def sweep(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, service(Path(tmp), {}) as client:
        body = {"base": {"output_len": args.output_len, "num_prompts": args.prompts,
                         "max_concurrency": args.concurrency[0]},
                "grid": {"input_len": args.input_lens, "max_concurrency": args.concurrency,
                         "mode": ["fill", "prefill"]},
                "repeats": args.repeats}
        started = time.monotonic()
        created = client.post("/api/sweeps", json=body)
        created.raise_for_status()
        sweep_id = created.json()["id"]
        while True:
            found = client.get(f"/api/sweeps/{sweep_id}").json()
            progress = found["progress"]
            print(f"  {progress['finished']}/{progress['total']} runs finished", file=sys.stderr)
            if progress["finished"] == progress["total"]:
                break
            time.sleep(10)
        wall = time.monotonic() - started
        failed = [r for r in found["runs"] if r["status"] != "succeeded"]
        for run in failed:
            print(f"run {run['id']} {run['status']}: {(run['error'] or '')[:200]}")
        bunched = sum(any(w["code"] == "bunched_streams" for w in r["warnings"]) for r in found["runs"])
        print(f"\nsweep {sweep_id}: {len(found['runs'])} runs in {wall:.0f} s; "
              f"{bunched} carry bunched_streams")
        print(f"{'point':<28}{'decode ITL fill/prefill [95%]':>34}{'decode TPOT fill/prefill [95%]':>34}"
              f"  verdict")
        verdicts = []
        for pair in found["fill_vs_prefill"]:
            cells = []
            for r in pair["ratios"]:
                cells.append(f"{r['ratio']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r["ci"]
                             else "no interval")
            point = ", ".join(f"{k}={v}" for k, v in pair["point"].items())
            print(f"{point:<28}{cells[0]:>34}{cells[1]:>34}  {pair['verdict']}")
            verdicts.append(pair["verdict"])
        print(f"{'point':<28}{'fill median TPOT (ms) [95%], CV':>40}{'prefill':>40}")
        figures = {json.dumps(p["point"], sort_keys=True): p["figures"] for p in found["points"]}
        for pair in found["fill_vs_prefill"]:
            point = ", ".join(f"{k}={v}" for k, v in pair["point"].items())
            cells = []
            for mode in ("fill", "prefill"):
                key = json.dumps({**pair["point"], "mode": mode}, sort_keys=True)
                fig: dict[str, Any] = figures[key]["decode_median_tpot_ms"] or {}
                ci = fig.get("ci") or [float("nan")] * 2
                cells.append(f"{fig.get('value', float('nan')):.2f} [{ci[0]:.2f}, {ci[1]:.2f}] "
                             f"CV {100 * (fig.get('cv') or 0):.1f}%")
            print(f"{point:<28}{cells[0]:>40}{cells[1]:>40}")
        print(f"fill/prefill: {len(verdicts)} points, {verdicts.count('matches')} match, "
              f"{verdicts.count('differs')} differ, {verdicts.count('undecided')} undecided")


def _run(rng: np.random.Generator, requests: int, gaps: int, scale: float = 0.01) -> list[Sample]:
    out = []
    for i in range(requests):
        level = scale * rng.normal(1, 0.03)
        itl = np.abs(rng.normal(level, 0.05 * level, size=gaps)).tolist()
        ttft = float(abs(rng.normal(0.05, 0.005)))
        out.append(Sample(index=i, success=True, start_time=i * 0.1, ttft=ttft, itl=itl,
                          latency=ttft + sum(itl), output_tokens=gaps + 1, prompt_len=1024))
    return out


def intervals(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    print(f"\n{'requests x gaps':<18}{'summary_intervals (s), median of 3':>38}")
    for requests, gaps in ((16, 127), (64, 127), (256, 255), (1000, 1023)):
        samples = _run(rng, requests, gaps)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            summary_intervals(samples)
            times.append(time.perf_counter() - t0)
        print(f"{requests} x {gaps:<11}{np.median(times):>38.3f}  "
              f"(min {min(times):.3f}, max {max(times):.3f})")

    def groups(scale: float) -> list[np.ndarray]:
        return [np.asarray(s.itl) for s in _run(rng, 16, 64, scale)]

    def rate(scale_b: float) -> tuple[int, int]:
        hits = sum(bool(r and r.differs()) for r in (
            ratio_by_requests(groups(0.01), groups(scale_b), 0.5, seed=i) for i in range(args.pairs)))
        return hits, args.pairs

    fp, n = rate(0.01)
    ci = stats.binomtest(fp, n).proportion_ci(0.95)
    p5, _ = rate(0.0105)
    p10, _ = rate(0.011)
    print(f"intervals: false positives {100 * fp / n:.1f}% [{100 * ci.low:.1f}, {100 * ci.high:.1f}] "
          f"of {n}; 5% change found {100 * p5 / n:.0f}%; 10% change found {100 * p10 / n:.0f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="run part 1 on a real vLLM CPU worker")
    parser.add_argument("--input-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=400)
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
    intervals(args)


if __name__ == "__main__":
    main()
