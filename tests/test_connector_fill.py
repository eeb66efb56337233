"""What the worker side writes: the same blocks and values as vLLM's DecodeBenchConnector,
on every cache layout it meets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.lazy import Lazy

# Imported at the first test that runs here (``tests.lazy``): collection needs none of them.
torch = Lazy("torch")
upstream_connector = Lazy("vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector")
kv_cache = Lazy("vllm.v1.kv_cache_interface")
connector_metadata = Lazy("connector.metadata")
connector_worker = Lazy("connector.worker")
h = Lazy("tests.vllm_harness")

SHAPE = (64, 2, 16, 64)  # blocks, KV heads, tokens per block, K and V of head dim 32


def _workers(tmp_path: Path, kv: Any, cache_dtype: str = "auto",
             mean: float = 0.015, std: float = 0.0) -> tuple[Any, Any]:
    extra = {"fill_mean": mean, "fill_std": std}
    ours = connector_worker.FillConnectorWorker(
        h.vllm_config(tmp_path, h.OURS, extra, cache_dtype=cache_dtype), kv
    )
    upstream = upstream_connector.DecodeBenchConnectorWorker(
        h.vllm_config(tmp_path, h.UPSTREAM, extra, cache_dtype=cache_dtype), kv
    )
    return ours, upstream


def _fill(worker: Any, caches: dict[str, Any], blocks: tuple[list[int], ...],
          values: tuple[float, float] | None = None) -> None:
    worker.register_kv_caches(caches)
    if isinstance(worker, connector_worker.FillConnectorWorker):
        meta = connector_metadata.FillConnectorMetadata(reqs_to_fill={"r": (blocks, 100)},
                                                        fill_values={"r": values} if values else {})
    else:
        meta = upstream_connector.DecodeBenchConnectorMetadata(reqs_to_fill={"r": (blocks, 100)})
    worker.start_fill_kv(meta)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [9, 2, 40, 41, 42, 7], list(range(0, 64, 3)),
                                 [5, 63, 64, 200]])
def test_constant_fill_writes_exactly_what_upstream_writes(
    tmp_path: Path, dtype_name: str, ids: list[int]
) -> None:
    dtype = getattr(torch, dtype_name)
    kv = h.kv_config([(["l0", "l1"], h.attention(16, dtype))])
    ours, upstream = _workers(tmp_path, kv)
    base = {name: torch.randn(SHAPE).to(dtype) for name in ("l0", "l1")}
    mine = {k: v.clone() for k, v in base.items()}
    theirs = {k: v.clone() for k, v in base.items()}
    _fill(ours, mine, (ids,))
    _fill(upstream, theirs, (ids,))
    for name in base:
        assert torch.equal(mine[name], theirs[name])
        # ...and really changed the selected blocks (ids past the end are ignored).
        valid = [b for b in ids if b < SHAPE[0]]
        assert torch.all(mine[name][valid] == torch.tensor(0.015, dtype=dtype))


def test_per_request_values_override_the_extra_config(tmp_path: Path) -> None:
    kv = h.kv_config([(["l0"], h.attention())])
    ours, _ = _workers(tmp_path, kv)
    cache = {"l0": torch.zeros(SHAPE)}
    _fill(ours, cache, ([1, 2],), values=(0.75, 0.0))
    assert torch.all(cache["l0"][[1, 2]] == 0.75)
    assert torch.all(cache["l0"][0] == 0) and torch.all(cache["l0"][3:] == 0)


def test_constant_is_clamped_to_the_dtypes_finite_range(tmp_path: Path) -> None:
    kv = h.kv_config([(["l0"], h.attention(16, torch.float16))])
    ours, upstream = _workers(tmp_path, kv, mean=1e6)
    mine = {"l0": torch.zeros(SHAPE, dtype=torch.float16)}
    theirs = {"l0": torch.zeros(SHAPE, dtype=torch.float16)}
    _fill(ours, mine, ([0, 1],))
    _fill(upstream, theirs, ([0, 1],))
    assert torch.equal(mine["l0"], theirs["l0"])
    assert torch.all(mine["l0"][[0, 1]] == 65504)


def test_fp8_cache_stored_as_uint8_is_written_as_fp8_values(tmp_path: Path) -> None:
    spec = kv_cache.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.uint8,
                                      kv_quant_mode=kv_cache.KVQuantMode.FP8_PER_TENSOR)
    kv = h.kv_config([(["l0"], spec)])
    ours, upstream = _workers(tmp_path, kv, cache_dtype="fp8", mean=0.3)
    assert ours._fp8_dtypes, "the worker did not see the fp8 layout"
    mine = {"l0": torch.zeros(SHAPE, dtype=torch.uint8)}
    theirs = {"l0": torch.zeros(SHAPE, dtype=torch.uint8)}
    _fill(ours, mine, ([4, 5, 30],))
    _fill(upstream, theirs, ([4, 5, 30],))
    assert torch.equal(mine["l0"], theirs["l0"])
    fp8 = ours._fp8_dtypes["l0"]
    decoded = mine["l0"][[4, 5, 30]].view(fp8).float()
    assert torch.all(decoded == torch.tensor(0.3).to(fp8).float())


def test_state_tensors_given_as_a_list_are_filled_whole(tmp_path: Path) -> None:
    kv = h.kv_config([(["mamba"], h.attention())])
    ours, upstream = _workers(tmp_path, kv)
    mine = {"mamba": [torch.zeros(8, 5), torch.zeros(3, 7, dtype=torch.bfloat16)]}
    theirs = {"mamba": [torch.zeros(8, 5), torch.zeros(3, 7, dtype=torch.bfloat16)]}
    _fill(ours, mine, ([0],))
    _fill(upstream, theirs, ([0],))
    for a, b in zip(mine["mamba"], theirs["mamba"], strict=True):
        assert torch.equal(a, b)
        assert torch.all(a == torch.tensor(0.015, dtype=a.dtype))


def test_circular_buffer_groups_are_zeroed_not_filled(tmp_path: Path) -> None:
    ring = kv_cache.CircularBufferSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = h.kv_config([(["attn"], h.attention()), (["ring"], ring)])
    ours, upstream = _workers(tmp_path, kv, mean=0.5)
    mine = {"attn": torch.ones(SHAPE), "ring": torch.ones(SHAPE)}
    theirs = {k: v.clone() for k, v in mine.items()}
    _fill(ours, mine, ([1, 2], [7]))
    _fill(upstream, theirs, ([1, 2], [7]))
    for name in mine:
        assert torch.equal(mine[name], theirs[name])
    assert torch.all(mine["ring"][7] == 0) and torch.all(mine["ring"][6] == 1)
    assert torch.all(mine["attn"][[1, 2]] == 0.5)


def test_strided_layout_gets_the_same_values(tmp_path: Path) -> None:
    # Heads outermost in memory: the block dimension of the logical view is strided.
    physical = torch.zeros(2, 64, 16, 64)
    view = physical.permute(1, 0, 2, 3)
    assert not view.is_contiguous()
    expected = view.clone()
    expected[[3, 4, 9]] = 0.015
    connector_worker.fill_block_rows(view, [3, 4, 9], 0.015, 0.0, torch.float32)
    assert torch.equal(view, expected)
    connector_worker.fill_block_rows(view, [20, 21, 22], 0.1, 0.3, torch.float32)
    region = view[20:23]
    assert abs(region.mean().item() - 0.1) < 0.02 and abs(region.std().item() - 0.3) < 0.02


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_random_fill_has_the_asked_mean_and_std(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    cache = torch.zeros(600, 2, 16, 64, dtype=dtype)  # 1.2M elements per fill: past one pool
    blocks = list(range(10, 590))
    connector_worker.fill_block_rows(cache, blocks, 0.015, 0.2, dtype)
    values = cache[10:590].float()
    assert values.numel() > connector_worker.POOL_ELEMS
    assert values.mean().item() == pytest.approx(0.015, abs=0.002)
    assert values.std().item() == pytest.approx(0.2, rel=0.01)
    assert torch.all(cache[:10] == 0) and torch.all(cache[590:] == 0)
    # Not a constant, and a second fill starts elsewhere in the pool.
    first = cache[10].clone()
    assert first.unique().numel() > 200  # bfloat16 has only about 1,000 values in this range
    connector_worker.fill_block_rows(cache, blocks, 0.015, 0.2, dtype)
    assert not torch.equal(first, cache[10])


def test_random_fill_of_scattered_blocks_keeps_the_others(tmp_path: Path) -> None:
    kv = h.kv_config([(["l0"], h.attention())])
    ours, _ = _workers(tmp_path, kv)
    cache = {"l0": torch.zeros(SHAPE)}
    ids = [1, 5, 6, 7, 30, 50]
    _fill(ours, cache, (ids,), values=(1.0, 0.5))
    filled = cache["l0"][ids]
    assert filled.mean().item() == pytest.approx(1.0, abs=0.05)
    assert filled.std().item() == pytest.approx(0.5, rel=0.1)
    others = [b for b in range(SHAPE[0]) if b not in ids]
    assert torch.all(cache["l0"][others] == 0)
