"""Fidelity: is decode after a fill the decode the same engine has after a real prefill?

Three arms, measured in one run of this script, trials interleaved (every trial
visits every point, in a new order, and the arms in a new order) with a distinct
seed for every arm, point and trial so no request ever hits another's prefix cache:

- reference: ``vllm bench serve``'s own client (in process, vLLM's ``main``) against
  a vLLM server without a KV connector, so every request pays a real prefill;
- client: decodebench's load generator against that same server (client parity);
- product: a decodebench run in fill mode through the service's REST API, on the
  worker the service starts with its connector.

The reference server is started with exactly the product worker's engine flags
(``service.control.vllm_cli.engine_flags``) and CPU binding (``service.control.cpu_binding``),
minus the connector. Two vLLM CPU servers alive at once disturb each other on a
small machine even when one is idle, so the one not being measured is paused
(SIGSTOP to its process group) and resumed (SIGCONT) around each measurement.

Per point and arm the figure of a trial is its median TPOT (and median ITL);
across trials the script prints the mean with a Student-t 95% interval, and for
the ratios arm/reference the geometric mean ratio with a Welch t interval on the
logs (``scipy.stats.ttest_ind``). Decode-only figures use the steady decode window
(``service.analysis.metrics.decode_stats``: gaps during which no request of the run waited
for its first token), which at concurrency above one keeps the reference's
chunked prefills out of its decode steps; but with real prefills at long context a
closed loop rarely has every slot decoding at once (early requests finish their
decode during later ones' prefills), so the reference's steady window holds smaller
batches than the product's. The "full batch" figures keep only gaps during which
every concurrency slot was decoding, which is decode with decode at the same batch;
a "nan" there means the reference never reached it. The last line takes decode-only
TPOT at concurrency 1 and the full-batch figure above it:

    fidelity: worst product/reference X.XX [lo, hi]; worst client/reference Y.YY [lo, hi]

``--service-env KEY=VALUE`` starts the service (and so its worker) with extra
environment: ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` reproduces vLLM's own layout for
a server with a connector on 2 cores, for the layout comparison in docs/cpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import free_port  # noqa: E402

from service.analysis.bursts import is_bunched  # noqa: E402
from service.analysis.metrics import decode_stats, summarize  # noqa: E402
from service.control.cpu_binding import BINDING_VARS, binding_env  # noqa: E402
from service.control.vllm_cli import engine_flags  # noqa: E402
from service.core.sample import Sample  # noqa: E402
from service.core.shapes import ensure_bundled  # noqa: E402
from service.core.spec import EngineSpec  # noqa: E402
from service.core.tinymodel import TINY_MODEL_NAME  # noqa: E402

TOKEN = "fidelity-benchmark-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ARMS = ("reference", "client", "product")
# The figure the last line compares, at concurrency 1 and above it.
LIKE_FOR_LIKE = {False: "decode_tpot_ms", True: "full_tpot_ms"}


def _wait_http(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited early; log tail:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not up after {timeout} s")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _pause(pgid: int, paused: bool) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGSTOP if paused else signal.SIGCONT)


@contextlib.contextmanager
def reference_server(model_dir: Path, work: Path, args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """A vLLM server with the product worker's engine flags and CPU binding, no connector."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(port),
            *engine_flags(args.model, engine(args), on_cpu=True)]
    env = {**os.environ, **binding_env(1, os.environ)}
    log = work / "reference.log"
    with log.open("wb") as out:
        # A process group of its own in this process's session, as the service starts
        # its workers next to its drivers (``service.control.procs``: the scheduler's autogroups).
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                process_group=0)
    try:
        _wait_http(proc, f"http://127.0.0.1:{port}/health", log)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        _stop(proc)


@contextlib.contextmanager
def service(work: Path, extra_env: dict[str, str]) -> Iterator[httpx.Client]:
    """The decodebench service as its own process, with a fresh data directory."""
    port = free_port()
    env = {**os.environ, "DECODEBENCH_DATA_DIR": str(work / "var"), "DECODEBENCH_PORT": str(port),
           "DECODEBENCH_GPUS": "", "DECODEBENCH_API_TOKEN": TOKEN, **extra_env}
    env.pop("DECODEBENCH_VLLM_COMMAND", None)
    log = work / "service.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=30)
    try:
        _wait_http(proc, f"http://127.0.0.1:{port}/healthz", log, timeout=120)
        yield client
    finally:
        client.close()
        _stop(proc)


@dataclass
class Trial:
    """One arm's measurement of one point."""

    median_tpot_ms: float
    median_itl_ms: float
    decode_tpot_ms: float
    decode_itl_ms: float
    # Decode-only TPOT over gaps during which every concurrency slot was decoding (nan: none).
    full_tpot_ms: float
    bunched: float
    input_len: float


@dataclass
class Point:
    """One (input length, concurrency) point and its trials per arm."""

    input_len: int
    concurrency: int
    trials: dict[str, list[Trial]] = field(default_factory=lambda: {a: [] for a in ARMS})


def _trial(samples: list[Sample], duration: float, concurrency: int) -> Trial:
    ok = [s for s in samples if s.success]
    if len(ok) < len(samples):
        first = next(s.error for s in samples if not s.success)
        raise SystemExit(f"{len(samples) - len(ok)} requests failed: {first}")
    # Streams the client saw in bursts say nothing of decode (service.analysis.bursts.is_bunched): the
    # figures come from the others, the same rule for every arm, and the share is reported.
    streamed = [s for s in ok if not is_bunched(s)]
    summary = summarize(streamed, duration)
    steady = decode_stats(streamed)
    full = decode_stats(streamed, min_decoding=concurrency)
    return Trial(
        median_tpot_ms=float(summary["median_tpot_ms"] or 0.0),
        median_itl_ms=float(summary["median_itl_ms"] or 0.0),
        decode_tpot_ms=float(steady["decode_median_tpot_ms"] or 0.0),
        decode_itl_ms=float(steady["decode_median_itl_ms"] or 0.0),
        full_tpot_ms=float(full["decode_median_tpot_ms"] or 0.0) if full["decode_gaps"] else math.nan,
        bunched=1 - len(streamed) / len(ok),
        input_len=float(np.mean([s.prompt_len for s in ok])),
    )


def engine(args: argparse.Namespace) -> EngineSpec:
    """The engine of every arm: the model's layers and dtype as asked."""
    return EngineSpec(num_layers=args.num_layers, dtype=args.dtype, max_model_len=args.max_model_len)


def run_reference(url: str, model_dir: Path, point: Point, args: argparse.Namespace, seed: int,
                  work: Path) -> Trial:
    """``vllm bench serve`` with the random dataset, exactly as a user would run it."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args([
        "--backend", "openai", "--base-url", url, "--model", str(model_dir),
        "--served-model-name", args.model, "--dataset-name", "random",
        "--random-input-len", str(point.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.prompts), "--max-concurrency", str(point.concurrency),
        "--seed", str(seed), "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--save-detailed",
        "--result-dir", str(work), "--result-filename", "reference.json",
    ])
    with contextlib.redirect_stdout(sys.stderr):
        result = main(ns)
    samples = [
        Sample(index=i, prompt_len=n_in, output_tokens=n_out, ttft=ttft, itl=list(itl), latency=lat,
               start_time=start, success=not err)
        for i, (n_in, n_out, ttft, itl, lat, start, err) in enumerate(zip(
            result["input_lens"], result["output_lens"], result["ttfts"], result["itls"],
            result["latencies"], result["start_times"], result["errors"], strict=True))
    ]
    # Recomputed from vLLM's own samples with our definitions (equal to vLLM's: tests/test_metrics.py)
    # so that its bunched streams are left out like every arm's.
    return _trial(samples, result["duration"], point.concurrency)


def run_client(url: str, point: Point, args: argparse.Namespace, seed: int, tag: str) -> Trial:
    """decodebench's load generator against the reference server."""
    import asyncio

    from service.core.spec import RunSpec
    from service.load.generator import LoadGenerator
    from service.load.plan import make_plan

    spec = RunSpec(model=args.model, engine=engine(args), input_len=point.input_len,
                   output_len=args.output_len, num_prompts=args.prompts,
                   max_concurrency=point.concurrency, seed=seed)
    plan = make_plan(spec, args.vocab_size)
    samples: list[Sample] = []

    async def go() -> float:
        generator = LoadGenerator(url, args.model, tag, point.concurrency, 3600)
        try:
            return await generator.measure(plan, samples.append)
        finally:
            await generator.aclose()

    return _trial(samples, asyncio.run(go()), point.concurrency)


def run_product(client: httpx.Client, point: Point, args: argparse.Namespace, seed: int) -> Trial:
    """A decodebench fill run through the REST API."""
    spec = {"model": args.model, "engine": engine(args).model_dump(exclude_defaults=True),
            "input_len": point.input_len, "output_len": args.output_len, "num_prompts": args.prompts,
            "max_concurrency": point.concurrency, "seed": seed, "mode": "fill"}
    run = _finish(client, client.post("/api/runs", json=spec).json())
    rows = client.get(f"/api/runs/{run['id']}/requests").json()
    samples = [Sample(index=r["index"], prompt_len=r["prompt_len"], output_tokens=r["output_tokens"],
                      ttft=r["ttft"], itl=r["itl"], latency=r["latency"], start_time=r["start_time"],
                      success=r["success"], error=r["error"]) for r in rows]
    return _trial(samples, run["summary"]["duration"], point.concurrency)


def _finish(client: httpx.Client, run: dict[str, Any]) -> dict[str, Any]:
    if "id" not in run:
        raise SystemExit(f"the service refused the run: {run}")
    while run["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.5)  # seldom: the service times tokens on the loop that answers this
        run = client.get(f"/api/runs/{run['id']}").json()
    if run["status"] != "succeeded":
        raise SystemExit(f"run {run['id']} {run['status']}: {run['error']}")
    return run


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean with a Student-t 95% interval."""
    if not values:
        return math.nan, math.nan, math.nan
    a = np.asarray(values, dtype=float)
    m = float(a.mean())
    if a.size < 2:
        return m, math.nan, math.nan
    half = float(stats.t.ppf(0.975, a.size - 1) * a.std(ddof=1) / math.sqrt(a.size))
    return m, m - half, m + half


def ratio_ci(arm: list[float], ref: list[float]) -> tuple[float, float, float]:
    """Geometric mean ratio arm/ref with a Welch t 95% interval on the logs."""
    if not arm or not ref:
        return math.nan, math.nan, math.nan
    la, lb = np.log(arm), np.log(ref)
    ratio = float(math.exp(la.mean() - lb.mean()))
    if len(la) < 2 or len(lb) < 2:
        return ratio, math.nan, math.nan
    ci = stats.ttest_ind(la, lb, equal_var=False).confidence_interval(0.95)
    return ratio, float(math.exp(ci.low)), float(math.exp(ci.high))


def _fmt_ci(m: float, lo: float, hi: float, digits: int = 2) -> str:
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def valid(trials: list[Trial]) -> list[Trial]:
    """Trials with at least half their streams seen as streams."""
    return [t for t in trials if t.bunched <= 0.5 and t.median_tpot_ms > 0]


def report(points: list[Point], arms: list[str]) -> None:
    """Print the per-point tables and the last line."""
    worst: dict[str, tuple[float, float, float]] = {}
    for title, key in (("median TPOT (ms)", "median_tpot_ms"), ("median ITL (ms)", "median_itl_ms"),
                       ("decode-only median TPOT (ms)", "decode_tpot_ms"),
                       ("decode-only median ITL (ms)", "decode_itl_ms"),
                       ("decode-only median TPOT at full batch (ms)", "full_tpot_ms")):
        print(f"\n{title}: mean of trials [95% t interval]; ratios: geometric mean [95% Welch t]")
        head = f"{'ISL':>6} {'conc':>4}" + "".join(f" {a:>22}" for a in arms)
        head += "".join(f" {a + '/ref':>24}" for a in arms if a != "reference")
        print(head)
        for p in points:
            line = f"{p.input_len:>6} {p.concurrency:>4}"

            def values(arm: str, p: Point = p, key: str = key) -> list[float]:
                return [v for t in valid(p.trials[arm]) if not math.isnan(v := getattr(t, key))]

            for a in arms:
                line += f" {_fmt_ci(*mean_ci(values(a))):>22}"
            for a in arms:
                if a == "reference":
                    continue
                r = ratio_ci(values(a), values("reference"))
                line += f" {_fmt_ci(*r):>24}"
                # Like for like: one request decoding at concurrency 1, every slot decoding above.
                if key == LIKE_FOR_LIKE[p.concurrency > 1] and not math.isnan(r[0]) and (
                    a not in worst or abs(math.log(r[0])) > abs(math.log(worst[a][0]))
                ):
                    worst[a] = r
            print(line)
    print("\nbunched streams (the client saw them in bursts; left out of every figure above) as a "
          "share of all, trials left out (over half bunched), mean input length; per arm")
    for p in points:
        print(f"{p.input_len:>6} {p.concurrency:>4}" + "".join(
            f" {a}: {np.mean([t.bunched for t in p.trials[a]]):.2f}, "
            f"{len(p.trials[a]) - len(valid(p.trials[a]))}/{len(p.trials[a])}, "
            f"{np.mean([t.input_len for t in p.trials[a]]):.0f} tok;" for a in arms))
    parts = []
    for a in ("product", "client"):
        if a in worst:
            parts.append(f"worst {a}/reference {_fmt_ci(*worst[a])}")
    print("\nfidelity: " + "; ".join(parts)
          + " (decode-only median TPOT; above concurrency 1 at full batch)")


def main() -> None:
    """Measure the arms at every point, interleaved, and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default=TINY_MODEL_NAME,
                        help="a bundled model: the tiny one or decodebench-shapes/NAME")
    parser.add_argument("--num-layers", type=int, default=None, help="a shape's layers (default all)")
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default float32 on a CPU)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--input-lens", default="1024,4096,16384,32768")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8, help="requests per trial")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--service-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", type=Path, help="also write every trial's figures here")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if "reference" not in arms or set(arms) - set(ARMS):
        raise SystemExit(f"--arms must include reference and name only {ARMS}")
    extra_env = dict(item.split("=", 1) for item in args.service_env)
    points = [Point(int(n), int(c)) for c in args.concurrency.split(",")
              for n in args.input_lens.split(",")]
    order = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        work = Path(tmp)
        model_dir = ensure_bundled(work / "models", args.model, args.num_layers)
        args.vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        with contextlib.ExitStack() as stack:
            api = stack.enter_context(service(work, extra_env)) if "product" in arms else None
            worker_pgid = None
            if api is not None:
                # A first run starts the service's worker; its pid lets us pause it between arms.
                _finish(api, api.post("/api/runs", json={
                    "model": args.model, "engine": engine(args).model_dump(exclude_defaults=True),
                    "input_len": 64, "output_len": 4, "num_prompts": 1}).json())
                (worker,) = [w for w in api.get("/api/workers").json() if w["status"] == "ready"]
                worker_pgid = worker["pid"]
                print(f"product worker binding: {json.dumps(worker['cpu_binding'])}", file=sys.stderr)
                _pause(worker_pgid, True)
            url, ref_pgid = stack.enter_context(reference_server(model_dir, work, args))
            print("reference binding: "
                  + json.dumps({k: binding_env(1, os.environ)[k] for k in BINDING_VARS}), file=sys.stderr)
            # Warm the reference up the way the product's first run warmed its worker.
            run_client(url, Point(64, 1), argparse.Namespace(**{**vars(args), "output_len": 4, "prompts": 1}),
                       1, "warm")
            seed = args.seed
            started = time.monotonic()
            for trial in range(args.trials):
                visit = points[:]
                order.shuffle(visit)
                for p in visit:
                    sequence = arms[:]
                    order.shuffle(sequence)
                    for arm in sequence:
                        seed += 1
                        on_product = arm == "product"
                        _pause(ref_pgid, on_product)
                        if worker_pgid is not None:
                            _pause(worker_pgid, not on_product)
                        if arm == "reference":
                            t = run_reference(url, model_dir, p, args, seed, work)
                        elif arm == "client":
                            t = run_client(url, p, args, seed, f"fidelity-{seed}")
                        else:
                            assert api is not None
                            t = run_product(api, p, args, seed)
                        p.trials[arm].append(t)
                        print(f"[{time.monotonic() - started:7.1f} s] trial {trial + 1} "
                              f"{p.input_len}x{p.concurrency} {arm:>9}: TPOT {t.median_tpot_ms:.2f} "
                              f"ITL {t.median_itl_ms:.2f} decode TPOT {t.decode_tpot_ms:.2f} ms",
                              file=sys.stderr, flush=True)
            _pause(ref_pgid, False)
            if worker_pgid is not None:
                _pause(worker_pgid, False)
    if args.json:
        args.json.write_text(json.dumps(
            [{"input_len": p.input_len, "concurrency": p.concurrency,
              "trials": {a: [vars(t) for t in ts] for a, ts in p.trials.items() if ts}} for p in points],
            indent=1))
    print(f"fidelity benchmark: {args.trials} interleaved trials, {args.prompts} requests x "
          f"{args.output_len} output tokens per trial; service env {extra_env or 'default'}")
    report(points, arms)


if __name__ == "__main__":
    main()
