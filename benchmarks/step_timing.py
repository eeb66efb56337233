"""What timing every engine step costs decode: the connector's step clock on and off.

Two parts, one run:

1. **Per step, in isolation**: the scheduler side's ``StepTracker.observe`` on a step of C
   decoding requests, and the worker side's clock and report buffer (``begin``,
   ``load_begin``/``load_end``, ``end``, ``Reporter.add_step``), in microseconds a step.
2. **Decode, on a real vLLM (CPU) server**: two servers on the bundled tiny model with the
   FillConnector, one with ``step_timing`` on and one off, take waves of filled requests in
   turn (A B A B, each wave its own prompts); each wave's time per output token, and the
   ratio on/off over the pairs of waves with a Student-t interval.

    .venv/bin/python benchmarks/step_timing.py [--pairs 12] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.report import Reporter
from connector.steps import StepClock, StepTracker
from service.core.tinymodel import TINY_MODEL_NAME, VOCAB_SIZE, ensure_tiny_model
from tests.vllm_process import start_vllm, stop, wait_healthy

RUN_ID = "r-step-timing"


def per_step_cost(batch: int, steps: int = 20_000) -> tuple[float, float]:
    """Microseconds a step for the scheduler side and for the worker side."""
    tracker = StepTracker()
    for n in range(batch):
        tracker.admitted(SimpleNamespace(request_id=f"q{n}", num_prompt_tokens=4096), RUN_ID)
    ids = [f"q{n}" for n in range(batch)]
    computed = [4096] * batch
    out = SimpleNamespace(total_num_scheduled_tokens=batch, num_scheduled_tokens=dict.fromkeys(ids, 1),
                          scheduled_spec_decode_tokens={}, scheduled_new_reqs=[],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=ids, num_computed_tokens=computed))
    started = time.perf_counter()
    infos = [tracker.observe(out) for _ in range(steps)]  # type: ignore[arg-type]
    scheduler_us = (time.perf_counter() - started) / steps * 1e6
    reporter = Reporter(None, None, "worker", 0)  # no service: rows are kept, never sent
    clock = StepClock(reporter.add_step, reporter.step_dropped)
    started = time.perf_counter()
    for info in infos:
        clock.begin(info)
        clock.load_begin()
        clock.load_end()
        clock.end()
    worker_us = (time.perf_counter() - started) / steps * 1e6
    return scheduler_us, worker_us


class Control:
    """The service as the connector sees it: every run is a fill run; reports are taken."""

    def __init__(self) -> None:
        self.steps = 0
        control = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                run_id = self.path.split("run_id=")[1]
                body = json.dumps({"run_id": run_id, "mode": "fill", "mean": 0.015, "std": 0.0}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                report = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                control.steps += sum(len(rows) for rows in (report.get("steps") or {}).values())
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def wave(client: httpx.Client, url: str, rng: random.Random, concurrency: int, input_len: int,
         output_len: int) -> float:
    """One wave of ``concurrency`` filled requests at once; seconds per output token."""

    def one(_: int) -> float:
        prompt = [rng.randrange(10, VOCAB_SIZE) for _ in range(input_len)]
        started = time.perf_counter()
        answer = client.post(f"{url}/v1/completions", json={
            "model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "kv_transfer_params": {"decodebench_run_id": RUN_ID}}, timeout=600)
        answer.raise_for_status()
        return (time.perf_counter() - started) / output_len

    with ThreadPoolExecutor(concurrency) as pool:
        return statistics.mean(pool.map(one, range(concurrency)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    print("Per step, in isolation (20,000 steps each):")
    print("| decoding requests | scheduler side (us/step) | worker side (us/step) |")
    print("|---|---|---|")
    for batch in (1, 16, 64, 256):
        scheduler_us, worker_us = per_step_cost(batch)
        print(f"| {batch} | {scheduler_us:.1f} | {worker_us:.1f} |")

    control = Control()
    root = Path(tempfile.mkdtemp(prefix="decodebench-step-timing-"))
    model = ensure_tiny_model(root / "models")
    servers: dict[str, tuple[Any, str]] = {}
    try:
        for name, timing in (("on", True), ("off", False)):
            config = json.dumps({"kv_connector": "FillConnector", "kv_connector_module_path": "connector",
                                 "kv_role": "kv_both", "kv_connector_extra_config": {
                                     "control_url": control.url, "worker_token": "t", "step_timing": timing}})
            servers[name] = start_vllm(model, root / f"{name}.log", "--kv-transfer-config", config,
                                       served_name=TINY_MODEL_NAME, kv_bytes=1 << 29)
        for name, (proc, url) in servers.items():
            wait_healthy(proc, url, root / f"{name}.log")
        rng = random.Random(1)
        times: dict[str, list[float]] = {"on": [], "off": []}
        with httpx.Client() as client:
            for name in ("on", "off"):  # warm both up
                wave(client, servers[name][1], rng, args.concurrency, args.input_len, args.output_len)
            for n in range(args.pairs):
                order = ("on", "off") if n % 2 == 0 else ("off", "on")
                for name in order:
                    times[name].append(wave(client, servers[name][1], rng, args.concurrency,
                                            args.input_len, args.output_len))
        logs = [math.log(a / b) for a, b in zip(times["on"], times["off"], strict=True)]
        mean = statistics.mean(logs)
        half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        print(f"\nDecode on vLLM (CPU), tiny model, {args.input_len} tokens in, {args.output_len} out, "
              f"{args.concurrency} at once, {args.pairs} pairs of waves (A B B A ...):")
        print("| timing | median ms per output token | min | max |")
        print("|---|---|---|---|")
        for name in ("on", "off"):
            ms = [t * 1e3 for t in times[name]]
            print(f"| {name} | {statistics.median(ms):.2f} | {min(ms):.2f} | {max(ms):.2f} |")
        print(f"\non/off: {math.exp(mean):.3f} [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}] "
              f"(95%, t over pairs); steps reported by the 'on' server: {control.steps}")
    finally:
        for proc, _ in servers.values():
            stop(proc)
        control.server.shutdown()


if __name__ == "__main__":
    main()
