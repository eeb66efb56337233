"""Fill speed: our worker-side fill against vLLM's DecodeBenchConnector and a plain memset.

One KV-cache-shaped tensor (40,000 tokens of a Llama-8B-like layer: 8 KV heads,
head dim 128, K and V, block size 16), all of one request's blocks selected, as
the connector sees it when a 40k-token request is scheduled. Each variant runs
in the same process, interleaved, and the median of several repeats is reported.

Prints a table, the device's bandwidth as the connector measures it for the roofline
(``connector.roofline.measure_bandwidth``), and a last line:
``fill: ours/upstream speedup constant X.Xx random Y.Yx; ours/memset Z.ZZ``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnectorWorker,
)

from connector.roofline import measure_bandwidth
from connector.worker import fill_block_rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()  # warm up
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=40_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fragmented", action="store_true",
                        help="block ids scattered over twice the range instead of one contiguous range")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    num_blocks = -(-args.tokens // args.block_size)
    # Logical per-layer view: [blocks, kv heads, tokens per block, K and V of head dim 128].
    span = 2 * num_blocks if args.fragmented else num_blocks
    shape = (span + 64, 8, args.block_size, 256)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    ids = list(range(32, 32 + num_blocks))
    if args.fragmented:
        # As after much churn of the free block queue: scattered, in no order.
        g = torch.Generator().manual_seed(0)
        ids = (32 + torch.randperm(span, generator=g)[:num_blocks]).tolist()
    nbytes = num_blocks * cache[0].numel() * cache.element_size()
    # The memset reference writes the same number of bytes, in one contiguous range.
    region = cache[32 : 32 + num_blocks]

    upstream = object.__new__(DecodeBenchConnectorWorker)

    def memset() -> None:
        region.fill_(0.5)

    variants: dict[str, Callable[[], None]] = {
        "memset (same bytes)": memset,
        "upstream constant": lambda: upstream._fill_block_tensor(cache, ids, 0.015, 0.0, dtype),
        "ours constant": lambda: fill_block_rows(cache, ids, 0.015, 0.0, dtype),
        "upstream random": lambda: upstream._fill_block_tensor(cache, ids, 0.015, 0.02, dtype),
        "ours random": lambda: fill_block_rows(cache, ids, 0.015, 0.02, dtype),
    }
    results = {name: [] for name in variants}  # type: dict[str, list[float]]
    # Interleave the variants so machine noise hits them alike.
    for _ in range(3):
        for name, fn in variants.items():
            results[name].append(_time(fn, device, args.repeats))
    best = {name: min(ts) for name, ts in results.items()}

    layout = "fragmented" if args.fragmented else "contiguous"
    print(f"fill of {args.tokens} tokens, {nbytes / 2**20:.0f} MiB, {args.dtype}, {layout} "
          f"block ids, on {device}")
    print(f"{'variant':<22}{'ms':>10}{'GB/s':>10}{'vs memset':>12}")
    for name, seconds in best.items():
        print(f"{name:<22}{seconds * 1e3:>10.2f}{nbytes / seconds / 1e9:>10.2f}"
              f"{best['memset (same bytes)'] / seconds:>12.2f}")
    # What the connector reports as the roofline's bandwidth, measured here the same way.
    measured = measure_bandwidth(device)
    print(f"device bandwidth: copy {measured['measured_bytes_per_s'] / 1e9:.2f} GB/s, fill "
          f"{measured['fill_bytes_per_s'] / 1e9:.2f} GB/s ({measured['how']}; connector.roofline)")
    const = best["upstream constant"] / best["ours constant"]
    rand = best["upstream random"] / best["ours random"]
    of_memset = best["memset (same bytes)"] / best["ours constant"]
    print(f"fill: ours/upstream speedup constant {const:.1f}x random {rand:.1f}x; "
          f"ours/memset {of_memset:.2f}")


if __name__ == "__main__":
    main()
