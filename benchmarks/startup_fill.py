"""The fill's own cost: per-request fill against startup fill, on a real shape.

Two vLLM servers with decodebench's connector on the same model files and engine flags,
one filling each request's blocks in the step that schedules it (``fill.startup`` off),
one that filled its whole KV cache once at start (``fill.startup`` on). A stand-in for the
service's connector routes answers every run's pull with a fill, so no service is needed.
Trials are interleaved (A B A B, the order drawn anew each trial), each with its own seed
so the prefix cache never helps, and the server not being measured is paused (SIGSTOP to
its process group) so the two never share the two cores.

The load is short outputs at a batch where a step schedules several new requests (their
fill lands inside the measured decode steps): request throughput and median TPOT per
arm, and startup/per-request as the geometric mean ratio with a Welch t interval on the
logs (``scipy.stats.ttest_ind``). Last line:

    startup_fill: request throughput startup/per-request X.XX [lo, hi]; median TPOT Y.YY [lo, hi]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import free_port, stop, wait_http  # noqa: E402

from service.analysis.metrics import summarize  # noqa: E402
from service.control.cpu_binding import binding_env  # noqa: E402
from service.control.vllm_cli import engine_flags, kv_transfer_config  # noqa: E402
from service.core.sample import Sample  # noqa: E402
from service.core.shapes import ensure_bundled  # noqa: E402
from service.core.spec import EngineSpec, RunSpec  # noqa: E402
from service.load.generator import LoadGenerator  # noqa: E402
from service.load.plan import make_plan  # noqa: E402

ARMS = ("per-request", "startup")


@contextlib.contextmanager
def control(mean: float) -> Iterator[str]:
    """A stand-in for the service's connector routes: every run is a fill with ``mean``;
    reports and provenance are taken and dropped."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            run_id = self.path.split("run_id=", 1)[-1]
            self._answer({"run_id": run_id, "mode": "fill", "mean": mean, "std": 0.0})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer({})

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextlib.contextmanager
def server(model_dir: Path, args: argparse.Namespace, startup: bool, log: Path,
           control_url: str) -> Iterator[tuple[str, int]]:
    """A vLLM server with the connector, its fill per request or at start."""
    port = free_port()
    config = kv_transfer_config(control_url, "unused", args.fill_mean, 0.0, startup_fill=startup)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(port),
            "--kv-transfer-config", json.dumps(config),
            *engine_flags(args.model, engine(args), on_cpu=True)]
    env = {**os.environ, **binding_env(1, os.environ),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=600)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
        stop(proc)


def engine(args: argparse.Namespace) -> EngineSpec:
    """Both servers' engine."""
    return EngineSpec(num_layers=args.num_layers, dtype=args.dtype, max_model_len=args.max_model_len,
                      gpu_memory_utilization=args.gpu_memory_utilization)


def _pause(pgid: int, paused: bool) -> None:
    os.killpg(pgid, signal.SIGSTOP if paused else signal.SIGCONT)


def trial(url: str, args: argparse.Namespace, seed: int, vocab: int) -> dict[str, float]:
    """One measurement: request throughput and median TPOT."""
    spec = RunSpec(model=args.model, engine=engine(args), input_len=args.input_len,
                   output_len=args.output_len, num_prompts=args.prompts,
                   max_concurrency=args.concurrency, seed=seed)
    plan = make_plan(spec, vocab)
    samples: list[Sample] = []

    async def go() -> float:
        generator = LoadGenerator(url, args.model, f"startup-fill-{seed}", args.concurrency, 1800)
        try:
            return await generator.measure(plan, samples.append)
        finally:
            await generator.aclose()

    duration = asyncio.run(go())
    summary = summarize(samples, duration)
    assert summary["completed"] == args.prompts, summary
    return {"request_throughput": float(summary["request_throughput"]),
            "median_tpot_ms": float(summary["median_tpot_ms"])}


def ratio(b: list[float], a: list[float]) -> tuple[float, float, float]:
    """Geometric mean of b/a with a Welch t 95% interval on the logs."""
    lb, la = np.log(b), np.log(a)
    diff = float(lb.mean() - la.mean())
    if len(b) < 2 or len(a) < 2:
        return math.exp(diff), math.nan, math.nan
    ci = stats.ttest_ind(lb, la, equal_var=False).confidence_interval(0.95)
    return math.exp(diff), math.exp(ci.low), math.exp(ci.high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="decodebench-shapes/qwen2.5-0.5b")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--fill-mean", type=float, default=0.015)
    parser.add_argument("--seed", type=int, default=7000)
    args = parser.parse_args()
    order = random.Random(args.seed)
    figures: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="startup-fill-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        model_dir = ensure_bundled(work / "models", args.model, args.num_layers)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        control_url = stack.enter_context(control(args.fill_mean))
        servers: dict[str, tuple[str, int]] = {}
        for arm in ARMS:
            servers[arm] = stack.enter_context(server(model_dir, args, arm == "startup", work / f"{arm}.log",
                                                      control_url))
            _pause(servers[arm][1], True)
        seed = args.seed
        for k in range(args.trials + 1):  # trial 0 warms both servers up and is not counted
            sequence = list(ARMS)
            order.shuffle(sequence)
            for arm in sequence:
                seed += 1
                url, pgid = servers[arm]
                _pause(pgid, False)
                try:
                    got = trial(url, args, seed, vocab)
                finally:
                    _pause(pgid, True)
                print(f"trial {k} {arm:>11}: {got['request_throughput']:.3f} req/s, "
                      f"median TPOT {got['median_tpot_ms']:.2f} ms", file=sys.stderr, flush=True)
                if k:
                    figures[arm].append(got)
    print(f"{args.model} layers={args.num_layers or 'all'} {args.input_len}x{args.concurrency}, "
          f"output {args.output_len}, {args.prompts} prompts, {args.trials} trials per arm")
    print(f"{'arm':>12} {'req/s':>8} {'median TPOT ms':>15}")
    for arm in ARMS:
        rps = [f["request_throughput"] for f in figures[arm]]
        tpot = [f["median_tpot_ms"] for f in figures[arm]]
        print(f"{arm:>12} {np.mean(rps):8.3f} {np.mean(tpot):15.2f}")
    r = ratio([f["request_throughput"] for f in figures["startup"]],
              [f["request_throughput"] for f in figures["per-request"]])
    t = ratio([f["median_tpot_ms"] for f in figures["startup"]],
              [f["median_tpot_ms"] for f in figures["per-request"]])
    print(f"startup_fill: request throughput startup/per-request {r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]; "
          f"median TPOT {t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]")


if __name__ == "__main__":
    main()
