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

Part 1 also prints, per point, the pairs (fill and prefill trial k queued back to back),
what would decide it, and the width of the paired interval against the unpaired (Welch)
one over the first 2, 3, ... pairs of the same runs.

Part 3 (always): the paired against the unpaired interval on synthetic pairs with
drift between trials shared by both halves of a pair (``--drift``, sd of the log of a
trial's level) and noise of its own (``--pair-sd``): the median half-width per number of
pairs; and the ``until_decided`` rule's coverage by simulation (looks 2, 4, 8, 16 at
Bonferroni confidence) against plain 95% intervals at the same looks.

Last lines:

    fill/prefill: N points, M match, K differ, U undecided
    intervals: false positives F% [lo, hi]; 5% change found P5%; 10% change found P10%

then part 3's two tables.
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

from service.analysis.fill_verdict import by_the_rule  # noqa: E402
from service.analysis.intervals import CONFIDENCE, ratio_by_requests, ratio_by_trials  # noqa: E402
from service.analysis.pairs import pair_looks, ratio_by_pairs  # noqa: E402
from service.analysis.summary_intervals import summary_intervals  # noqa: E402
from service.core.sample import Sample  # noqa: E402


def sweep(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, service(Path(tmp), {}) as client:
        body: dict[str, Any] = {
            "base": {"output_len": args.output_len, "num_prompts": args.prompts,
                     "max_concurrency": args.concurrency[0]},
            "grid": {"input_len": args.input_lens, "max_concurrency": args.concurrency,
                     "mode": ["fill", "prefill"]},
            "repeats": args.repeats}
        if args.until_decided:
            body["until_decided"] = {"max_pairs": args.until_decided}
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
        paired_widths(found)
        print(f"fill/prefill: {len(verdicts)} points, {verdicts.count('matches')} match, "
              f"{verdicts.count('differs')} differ, {verdicts.count('undecided')} undecided")


def _half_width(lo: float, hi: float) -> float:
    return 100 * (hi / lo) ** 0.5 - 100  # half the log width, in percent


def paired_widths(found: dict[str, Any]) -> None:
    """Per point of a finished sweep: its line, and the paired against the Welch interval
    of decode median ITL over its first k pairs."""
    key = "decode_median_itl_ms"
    print(f"\n{'point':<28}{'pairs':>6}  line")
    for pair in found["fill_vs_prefill"]:
        point = ", ".join(f"{k}={v}" for k, v in pair["point"].items())
        print(f"{point:<28}{pair['pairs']:>6}  {pair['line']}")
    print(f"\n{'point':<28}{'k pairs':>8}{'paired +-%':>12}{'Welch +-%':>12}")
    for pair in found["fill_vs_prefill"]:
        by_pair: dict[str, dict[str, float]] = {}
        for run in found["runs"]:
            same = all(run["spec"].get(k) == v for k, v in pair["point"].items())
            if same and run["pair_id"] and run["status"] == "succeeded":
                by_pair.setdefault(run["pair_id"], {})[run["spec"]["mode"]] = run["summary"][key]
        complete = [p for p in by_pair.values() if len(p) == 2]
        point = ", ".join(f"{k}={v}" for k, v in pair["point"].items())
        for k in range(2, len(complete) + 1):
            prefill = [p["prefill"] for p in complete[:k]]
            fill = [p["fill"] for p in complete[:k]]
            paired, welch = ratio_by_pairs(prefill, fill), ratio_by_trials(prefill, fill)
            cells = [f"{_half_width(r.lo, r.hi):.1f}" if r else "-" for r in (paired, welch)]
            print(f"{point:<28}{k:>8}{cells[0]:>12}{cells[1]:>12}")


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


def pair_rule(args: argparse.Namespace) -> None:
    """Paired against unpaired widths, and the sequential rule's coverage, on synthetic pairs."""
    rng = np.random.default_rng(1)
    print(f"\n{'pairs':<8}{'paired +-% (median)':>22}{'Welch +-% (median)':>22}"
          f"   drift sd {args.drift}, pair sd {args.pair_sd}, 400 draws")
    for n in (2, 3, 5, 8, 16):
        paired, welch = [], []
        for _ in range(400):
            level = np.exp(rng.normal(0, args.drift, size=n))
            prefill = 5 * level
            fill = prefill * np.exp(rng.normal(0, args.pair_sd, size=n))
            p, w = ratio_by_pairs(prefill, fill), ratio_by_trials(prefill, fill)
            paired.append(_half_width(p.lo, p.hi) if p else np.inf)
            welch.append(_half_width(w.lo, w.hi) if w else np.inf)
        print(f"{n:<8}{np.median(paired):>22.1f}{np.median(welch):>22.1f}")
    plan = pair_looks(2, 16)
    print(f"\npair rule, looks {plan.counts} at {100 * plan.confidence:.2f}% each; "
          f"pair sd {args.pair_sd}, {args.draws} points per true ratio")
    print(f"{'true ratio':<12}{'coverage [95%]':>24}{'plain 95% at looks':>20}{'stopped early':>15}"
          f"{'mean pairs':>12}")
    for true in (1.0, 1.02, 1.04, 1.08):
        results = {}
        for name, per_look in (("rule", None), ("plain", CONFIDENCE)):
            held, stops, used = 0, 0, []
            for seed in range(args.draws):
                d = np.random.default_rng(seed).normal(np.log(true), args.pair_sd, size=16)
                r, count = by_the_rule(d, plan, per_look)
                held += r.lo <= true <= r.hi
                stops += count < 16
                used.append(count)
            results[name] = (held, stops, float(np.mean(used)))
        held, stops, used = results["rule"]
        ci = stats.binomtest(held, args.draws).proportion_ci(0.95)
        print(f"{true:<12}{held / args.draws:>10.3f} [{ci.low:.3f}, {ci.high:.3f}]"
              f"{results['plain'][0] / args.draws:>20.3f}{stops / args.draws:>15.2f}{used:>12.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="run part 1 on a real vLLM CPU worker")
    parser.add_argument("--input-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--until-decided", type=int, default=0,
                        help="run the sweep with until_decided and this pair budget")
    parser.add_argument("--drift", type=float, default=0.15)
    parser.add_argument("--pair-sd", type=float, default=0.03)
    parser.add_argument("--draws", type=int, default=1000)
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
    intervals(args)
    pair_rule(args)


if __name__ == "__main__":
    main()
