"""Does watching the server disturb what it measures? Decode on a real vLLM CPU server with
the service's scrape of its Prometheus ``/metrics`` (``service.analysis.server_metrics.Scraper``,
every ``--every`` seconds, as during every run) against the same server not scraped.
Also counts the streams that reached the client bunched (``service.analysis.bursts.is_bunched``)
in each arm, with Fisher's exact test: on a small machine vLLM's API server renders
``/metrics`` in the process that streams tokens.

One vLLM server (the product worker's engine flags and CPU binding, no connector, the
bundled tiny model), decodebench's load generator in this process. Arms interleaved
(off, on, off, on, ... in a new order every trial), a distinct seed for every trial and
arm so no request hits another's prefix cache. The figure of a trial is its median
TPOT; across trials the ratio scraped/not scraped is the geometric mean with a Welch
t 95% interval on the logs. Target: the interval contains 1 and lies within
[0.95, 1.05]. Last line:

    scrape: median TPOT scraped every S s/not 1.00 [lo, hi] (N trials each, ISL x C)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
from scipy.stats import fisher_exact

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fidelity import _fmt_ci, ratio_ci, reference_server  # noqa: E402

from service.analysis.bursts import is_bunched  # noqa: E402
from service.analysis.metrics import summarize  # noqa: E402
from service.analysis.server_metrics import Point, Scraper  # noqa: E402
from service.core.sample import Sample  # noqa: E402
from service.core.spec import RunSpec  # noqa: E402
from service.core.tinymodel import TINY_MODEL_NAME, VOCAB_SIZE, ensure_tiny_model  # noqa: E402
from service.load.generator import LoadGenerator  # noqa: E402
from service.load.plan import make_plan  # noqa: E402


async def trial(url: str, args: argparse.Namespace, seed: int, scraped: bool) -> tuple[float, int, int]:
    """Median TPOT (ms) of one trial, with the points scraped and the bunched streams."""
    spec = RunSpec(input_len=args.input_len, output_len=args.output_len, num_prompts=args.prompts,
                   max_concurrency=args.concurrency, seed=seed)
    plan = make_plan(spec, VOCAB_SIZE)
    samples: list[Sample] = []
    points: list[Point] = []
    async with httpx.AsyncClient() as client:
        scraper = Scraper(client, url, every_s=args.every)
        watching = asyncio.create_task(scraper.run(points.append)) if scraped else None
        generator = LoadGenerator(url, TINY_MODEL_NAME, f"scrape-{seed}", args.concurrency, 600)
        try:
            duration = await generator.measure(plan, samples.append)
        finally:
            await generator.aclose()
            if watching is not None:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
    if not all(s.success for s in samples):
        raise SystemExit(f"a request failed: {next(s.error for s in samples if not s.success)}")
    summary = summarize(samples, duration)
    bunched = sum(is_bunched(s) for s in samples if len(s.itl) >= 2)
    return float(summary["median_tpot_ms"] or 0.0), len(points), bunched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--every", type=float, default=1.0, help="seconds between scrapes")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="decodebench-scrape-") as tmp:
        work = Path(tmp)
        model_dir = ensure_tiny_model(work / "models")
        with reference_server(model_dir, work) as (url, _pid):
            figures: dict[bool, list[float]] = {False: [], True: []}
            bunched_streams = {False: 0, True: 0}
            seeds = iter(range(50_000, 60_000))
            order = random.Random(7)
            asyncio.run(trial(url, args, 1, False))  # warm the server up, not counted
            for k in range(args.trials):
                arms = [False, True]
                order.shuffle(arms)
                for scraped in arms:
                    tpot, points, bunched = asyncio.run(trial(url, args, next(seeds), scraped))
                    figures[scraped].append(tpot)
                    bunched_streams[scraped] += bunched
                    print(f"trial {k + 1} {'scraped' if scraped else 'not scraped':>11}: "
                          f"median TPOT {tpot:.3f} ms, {points} scrapes, {bunched} bunched streams",
                          flush=True)
    off, on = figures[False], figures[True]
    print()
    print("| arm | median TPOT ms, mean | min | max |\n|---|---:|---:|---:|")
    for name, values in (("not scraped", off), (f"scraped every {args.every:g} s", on)):
        print(f"| {name} | {statistics.mean(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    streams = args.trials * args.prompts
    _, p_value = fisher_exact([[bunched_streams[True], streams - bunched_streams[True]],
                               [bunched_streams[False], streams - bunched_streams[False]]])
    print(f"\nbunched streams: scraped {bunched_streams[True]}/{streams}, not scraped "
          f"{bunched_streams[False]}/{streams} (Fisher exact p = {p_value:.3g})")
    print(f"scrape: median TPOT scraped every {args.every:g} s/not {_fmt_ci(*ratio_ci(on, off))} "
          f"({args.trials} trials each, {args.input_len} x {args.concurrency})")


if __name__ == "__main__":
    main()
