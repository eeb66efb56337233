"""Seeded against fill against prefill, through the service, on a real shape at reduced depth.

One service process (real HTTP, real SQLite) starts one vLLM CPU server; every run goes
through the API. Per trial (its own seed) and input length, the three modes run at
concurrency 1 then 4 (the same prompts: ``--prompts`` each), the order of the modes drawn
anew per trial; the seeded run at concurrency 4 finds every prompt its concurrency-1 run
seeded (same model, engine, input length and seed: the same seed set) and prefills none.

Printed per input length x concurrency:
- decode median ITL per mode (mean over trials), and seeded/fill and prefill/fill as the
  geometric mean of the per-trial ratios with a paired t 95% interval over trials (the
  three runs of a trial ran back to back, so drift between trials cancels);
- the wall time of the runs (started to finished: seeding included) per mode;
- the seeding pass: seconds, and the share of the seed set already cached (reused).
Last lines, per input length, the time to a curve (both concurrencies, seeding included)
per mode.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import AUTH, TOKEN, free_port, stop  # noqa: E402

MODES = ("fill", "seeded", "prefill")
CONCURRENCY = (1, 4)


@contextlib.contextmanager
def service(data_dir: Path) -> Iterator[httpx.Client]:
    """The service as a process that starts real vLLM servers."""
    port = free_port()
    env = {**os.environ, "DECODEBENCH_DATA_DIR": str(data_dir), "DECODEBENCH_PORT": str(port),
           "DECODEBENCH_API_TOKEN": TOKEN, "DECODEBENCH_GPUS": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("DECODEBENCH_VLLM_COMMAND", None)
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir.parent / "service.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=30)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError("the service exited")
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/healthz").status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the service did not come up")
            time.sleep(0.2)
        yield client
    finally:
        client.close()
        stop(proc)


def run(client: httpx.Client, spec: dict[str, Any]) -> dict[str, Any]:
    """Submit a run and wait for its end; a run that does not succeed stops the benchmark."""
    response = client.post("/api/runs", json=spec)
    response.raise_for_status()
    run_id = response.json()["id"]
    while True:
        got = client.get(f"/api/runs/{run_id}").json()
        if got["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.5)
    if got["status"] != "succeeded":
        raise RuntimeError(f"run {run_id} ({spec['mode']}) {got['status']}: {got['error']}")
    return got


def wall_s(got: dict[str, Any]) -> float:
    """Started to finished (s): seeding, measurement and the summary."""
    started = datetime.fromisoformat(got["started_at"])
    finished = datetime.fromisoformat(got["finished_at"])
    return (finished - started).total_seconds()


def paired(b: list[float], a: list[float]) -> str:
    """Geometric mean of b/a over trials with a paired t 95% interval on the logs."""
    d = np.log(b) - np.log(a)
    mean = math.exp(float(d.mean()))
    if len(d) < 2 or float(np.std(d)) == 0.0:
        return f"{mean:.3f}"
    ci = stats.ttest_1samp(d, 0.0).confidence_interval(0.95)
    return f"{mean:.3f} [{math.exp(ci.low):.3f}, {math.exp(ci.high):.3f}]"


def reused(seeding: dict[str, Any]) -> str:
    """The share of the seed set's prompt tokens the seeding pass found cached."""
    return f"{seeding['reused_tokens'] / seeding['prompt_tokens']:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="decodebench-shapes/qwen2.5-0.5b")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--input-lens", default="4096,8192")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--seed", type=int, default=9000)
    args = parser.parse_args()
    input_lens = [int(n) for n in args.input_lens.split(",")]
    order = random.Random(args.seed)
    # figures[(input_len, concurrency, mode)] = per trial (itl, wall, seeding record)
    figures: dict[tuple[int, int, str], list[tuple[float, float, dict[str, Any] | None]]] = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="seeded-bench-") as tmp, service(Path(tmp) / "var") as client:
        # One unmeasured run starts the server (its start is no mode's cost).
        run(client, {"model": args.model, "engine": {"num_layers": args.num_layers}, "input_len": 64,
                     "output_len": 4, "num_prompts": 2, "max_concurrency": 1, "seed": args.seed - 1})
        for k in range(args.trials):
            for input_len in input_lens:
                modes = list(MODES)
                order.shuffle(modes)
                for mode in modes:
                    for concurrency in CONCURRENCY:
                        spec = {"model": args.model, "engine": {"num_layers": args.num_layers},
                                "mode": mode, "input_len": input_len, "output_len": args.output_len,
                                "num_prompts": args.prompts, "max_concurrency": concurrency,
                                "seed": args.seed + k}
                        got = run(client, spec)
                        summary = got["summary"]
                        entry = (float(summary["decode_median_itl_ms"]), wall_s(got), summary.get("seeding"))
                        figures.setdefault((input_len, concurrency, mode), []).append(entry)
                        seeding = entry[2]
                        print(f"trial {k} {input_len}x{concurrency} {mode:>7}: ITL {entry[0]:.2f} ms, "
                              f"run {entry[1]:.1f} s"
                              + (f", seeding {seeding['seconds']:.2f} s reused {reused(seeding)}"
                                 if seeding else ""), file=sys.stderr, flush=True)
    print(f"{args.model} layers={args.num_layers}, output {args.output_len}, {args.prompts} prompts, "
          f"{args.trials} trials, "
          f"{time.monotonic() - began:.0f} s in all")
    print(f"{'point':>9} {'ITL fill':>9} {'seeded':>8} {'prefill':>8}   {'seeded/fill [95%]':>24}"
          f"   {'prefill/fill [95%]':>24}   {'run s f/s/p':>17}   seeding s (reused)")
    for input_len in input_lens:
        for concurrency in CONCURRENCY:
            per = {m: figures[(input_len, concurrency, m)] for m in MODES}
            itl = {m: [e[0] for e in per[m]] for m in MODES}
            walls = "/".join(f"{np.mean([e[1] for e in per[m]]):.1f}" for m in MODES)
            seeds = ", ".join(f"{e[2]['seconds']:.2f} ({reused(e[2])})" for e in per["seeded"] if e[2])
            mean = {m: float(np.mean(itl[m])) for m in MODES}
            print(f"{input_len:>5}x{concurrency:<3} {mean['fill']:9.2f} {mean['seeded']:8.2f} "
                  f"{mean['prefill']:8.2f}   {paired(itl['seeded'], itl['fill']):>24}   "
                  f"{paired(itl['prefill'], itl['fill']):>24}   {walls:>17}   {seeds}")
    for input_len in input_lens:
        curve = {m: np.mean([sum(figures[(input_len, c, m)][k][1] for c in CONCURRENCY)
                             for k in range(args.trials)]) for m in MODES}
        print(f"seeded: time to a curve at {input_len} (concurrency {', '.join(map(str, CONCURRENCY))}, "
              f"seeding included): fill {curve['fill']:.1f} s, seeded {curve['seeded']:.1f} s, "
              f"prefill {curve['prefill']:.1f} s")


if __name__ == "__main__":
    main()
