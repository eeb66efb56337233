"""Load generator capacity: ours against ``vllm bench serve``'s client, on a stub server with a
known inter-token interval.

The stub (``token_stub.py``, its own process) streams one token every
``--interval`` seconds per request. At each concurrency level three clients send
the same number of requests, one after the other: vLLM's client and our load
generator class in this process, and the service's real driver path (driver
processes from ``service.load.driver``, sharded one per 256 streams, at most one per
core, samples streamed back over their pipes). The table shows achieved output
tokens/s and how far each client's median ITL is from the stub's true interval. A
client that cannot keep up reports lower throughput and inflated ITLs: its own
limit, not the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from harness import free_port
from vllm.benchmarks.lib.endpoint_request_func import (
    RequestFuncInput,
    async_request_openai_completions,
)

from service.core.sample import Sample
from service.core.spec import RunSpec
from service.load.driver import shard_count
from service.load.generator import LoadGenerator
from service.load.plan import make_plan
from service.load.shards import DriverPool, Drivers

HERE = Path(__file__).resolve().parent


async def _ours(url: str, concurrency: int, requests: int, tokens: int) -> tuple[float, list[float]]:
    spec = RunSpec(input_len=8, output_len=tokens, num_prompts=requests, max_concurrency=concurrency)
    plan = make_plan(spec, 1000)
    samples: list[Sample] = []
    generator = LoadGenerator(url, "stub", "r-bench", concurrency, 120)
    try:
        duration = await generator.measure(plan, samples.append)
    finally:
        await generator.aclose()
    assert all(s.success for s in samples), samples[0].error
    return sum(s.output_tokens for s in samples) / duration, [g for s in samples for g in s.itl]


async def _driver(url: str, concurrency: int, requests: int, tokens: int) -> tuple[float, list[float]]:
    spec = RunSpec(input_len=8, output_len=tokens, num_prompts=requests, max_concurrency=concurrency)
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="decodebench-loadgen-") as logs:
        pool = DriverPool(Path(logs))
        pool.start()
        try:
            drivers = Drivers.for_run("r-bench", spec, url, "stub", 1000, 120, pool, hang_s=60)
            duration = await drivers.run(samples.append)
        finally:
            await pool.close()
    assert all(s.success for s in samples), samples[0].error
    return sum(s.output_tokens for s in samples) / duration, [g for s in samples for g in s.itl]


async def _vllm(url: str, concurrency: int, requests: int, tokens: int) -> tuple[float, list[float]]:
    slots = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=True) as session:

        async def one(i: int) -> object:
            inp = RequestFuncInput(prompt=[3 + i % 50] * 8, api_url=f"{url}/v1/completions",
                                   prompt_len=8, output_len=tokens, model="stub", ignore_eos=True)
            async with slots:
                return await async_request_openai_completions(inp, session)

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(i) for i in range(requests)))
        duration = time.perf_counter() - start
    assert all(o.success for o in outputs), outputs[0].error  # type: ignore[attr-defined]
    total = sum(o.output_tokens for o in outputs)  # type: ignore[attr-defined]
    return total / duration, [g for o in outputs for g in o.itl]  # type: ignore[attr-defined]


def main() -> None:
    """Run the levels and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--levels", default="16,64,256,1024")
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per level = rounds x level")
    args = parser.parse_args()
    port = free_port()
    stub = subprocess.Popen([sys.executable, str(HERE / "token_stub.py"), "--port", str(port),
                             "--interval", str(args.interval)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        ideal = 1 / args.interval
        print(f"stub: one token every {args.interval * 1000:.0f} ms per stream "
              f"({ideal:.0f} tok/s per stream), {args.tokens} tokens per request")
        print("| streams | shards | ideal tok/s | vllm tok/s | class tok/s | driver tok/s | class/vllm "
              "| driver/vllm | vllm ITL err | class ITL err | driver ITL err |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        ratio = err_driver = 0.0
        level = 0
        for level in (int(x) for x in args.levels.split(",")):
            n = level * args.rounds
            # vLLM's import leaves millions of objects on the heap; a full collection in the
            # middle of a run would stall whichever client triggered it. Freeze them first.
            gc.collect()
            gc.freeze()
            vllm_tps, vllm_itl = asyncio.run(_vllm(url, level, n, args.tokens))
            gc.collect()
            gc.freeze()
            ours_tps, ours_itl = asyncio.run(_ours(url, level, n, args.tokens))
            gc.collect()
            gc.freeze()
            driver_tps, driver_itl = asyncio.run(_driver(url, level, n, args.tokens))

            def err(itl: list[float]) -> float:
                return abs(statistics.median(itl) - args.interval) / args.interval * 100

            ratio = driver_tps / vllm_tps
            err_driver = err(driver_itl)
            shards = shard_count(RunSpec(num_prompts=n, max_concurrency=level))
            print(f"| {level} | {shards} | {ideal * level:.0f} | {vllm_tps:.0f} | {ours_tps:.0f} "
                  f"| {driver_tps:.0f} | {ours_tps / vllm_tps:.2f}x | {ratio:.2f}x | {err(vllm_itl):.1f}% "
                  f"| {err(ours_itl):.1f}% | {err_driver:.1f}% |", flush=True)
        print(f"loadgen: driver/vllm throughput at max concurrency {level} {ratio:.2f}x; "
              f"driver median ITL error {err_driver:.1f}%")
    finally:
        gc.unfreeze()
        stub.terminate()
        stub.wait()


if __name__ == "__main__":
    main()
