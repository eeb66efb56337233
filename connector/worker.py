"""Worker side: writes the fill values into the selected KV cache blocks, in place.

vLLM's own fill builds a tensor of values the size of the selected blocks and
scatters it (allocate, write, read, write again). Here each run of consecutive
block ids is one strided slice of the cache, filled in place: a constant fill is
a memset-like ``fill_``, a random fill tiles a pool of normal samples into it
(see :class:`NoisePool`).
Scattered ids fall back to one ``index_fill_``/``index_copy_`` per layer.

When vLLM registers the KV caches, TP rank 0 also gathers the decode roofline's facts
(``connector.roofline``: weights read per step, KV bytes per token, measured bandwidth)
and reports them as the ``roofline`` part of the server's provenance.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnectorWorker,
)

from connector import roofline
from connector.metadata import FillConnectorMetadata
from connector.provenance import cpu_model
from connector.report import Reporter
from connector.steps import StepClock

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

# On a GPU, above this many separate runs of block ids one indexed kernel beats many
# slice launches; on a CPU a slice costs no launch, so slices always win.
MAX_GPU_SLICES = 16
# Random fills through a temporary (fp8 caches) are sampled in chunks of this many elements.
SAMPLE_CHUNK = 1 << 24
NATIVE_NORMAL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of ``block_ids`` as half-open ``(start, stop)`` ranges, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


def clamp_to(dtype: torch.dtype, value: float) -> float:
    """``value`` clamped to the finite range of a floating ``dtype``."""
    info = torch.finfo(dtype)
    return float(min(max(value, info.min), info.max))


def _raw_constant(cache: torch.Tensor, fill_dtype: torch.dtype, mean: float) -> torch.Tensor:
    """The constant as a 0-d tensor of the cache's own dtype (fp8 values as their bytes)."""
    if not fill_dtype.is_floating_point:
        return torch.zeros((), dtype=cache.dtype)
    value = torch.tensor(clamp_to(fill_dtype, mean), dtype=fill_dtype)
    return value.view(cache.dtype) if fill_dtype != cache.dtype else value


class NoisePool:
    """Normal samples drawn once per (mean, std, dtype, device), tiled into the cache.

    Sampling a normal value costs far more than writing it, so a random fill that
    samples every element runs well below memory speed. The pool holds a prime
    number of samples (never aligned with heads, blocks or layers) and each fill
    starts at a random offset into it, so the cache holds normal values with the
    asked mean and std at memory speed; the pattern repeats every
    ``POOL_ELEMS`` elements.
    """

    def __init__(self, max_pools: int = 4) -> None:
        self.max_pools = max_pools
        self._pools: dict[tuple[float, float, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, mean: float, std: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The pool for these values, sampled on first use."""
        key = (mean, std, dtype, device)
        pool = self._pools.pop(key, None)
        if pool is None:
            info = torch.finfo(dtype)
            values = torch.empty(POOL_ELEMS, dtype=torch.float32, device=device)
            values.normal_(mean, std).clamp_(info.min, info.max)
            pool = values.to(dtype)
        self._pools[key] = pool  # most recently used last
        while len(self._pools) > self.max_pools:
            self._pools.pop(next(iter(self._pools)))
        return pool


NOISE = NoisePool()
_OFFSETS = random.Random()
# A prime just under 2**20: the tiling period of the random fill.
POOL_ELEMS = 1_048_573


def _tile(flat: torch.Tensor, pool: torch.Tensor) -> None:
    """Write ``pool`` repeated into the 1-D ``flat``, from a random offset into the pool."""
    period = pool.numel()
    offset = _OFFSETS.randrange(period)
    n = flat.numel()
    head = min(n, period - offset)
    flat[:head].copy_(pool[offset : offset + head])
    done = head
    whole = (n - done) // period
    if whole:
        end = done + whole * period
        flat[done:end].view(whole, period).copy_(pool.unsqueeze(0).expand(whole, period))
        done = end
    if done < n:
        flat[done:].copy_(pool[: n - done])


def _fill_random(region: torch.Tensor, fill_dtype: torch.dtype, mean: float, std: float) -> None:
    """Normal values into ``region`` (a view of the cache) as ``fill_dtype``, clamped to its range."""
    target = region.view(fill_dtype) if fill_dtype != region.dtype else region
    if target.is_contiguous():
        _tile(target.view(-1), NOISE.get(mean, std, fill_dtype, target.device))
        return
    # A strided slice (block dimension not outermost): sample in place.
    info = torch.finfo(fill_dtype)
    if fill_dtype in NATIVE_NORMAL:
        target.normal_(mean, std).clamp_(info.min, info.max)
        return
    rows = max(1, SAMPLE_CHUNK // max(1, target[0].numel()))
    for chunk in target.split(rows):
        values = torch.empty(chunk.shape, dtype=torch.float32, device=chunk.device)
        values.normal_(mean, std).clamp_(info.min, info.max)
        chunk.copy_(values)


def fill_block_rows(
    cache: torch.Tensor,
    block_ids: list[int],
    mean: float,
    std: float,
    fill_dtype: torch.dtype,
) -> int:
    """Fill rows ``block_ids`` of a block-indexed cache tensor; return bytes written."""
    ids = sorted({b for b in block_ids if 0 <= b < cache.shape[0]})
    if not ids:
        return 0
    runs = block_runs(ids)
    random = std > 0 and fill_dtype.is_floating_point
    if cache.device.type == "cpu" or len(runs) <= MAX_GPU_SLICES:
        if random:
            for start, stop in runs:
                _fill_random(cache[start:stop], fill_dtype, mean, std)
        else:
            constant = _raw_constant(cache, fill_dtype, mean)
            for start, stop in runs:
                cache[start:stop].fill_(constant)
    else:
        index = torch.tensor(ids, dtype=torch.long, device=cache.device)
        if random:
            values = torch.empty((len(ids), *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
            _fill_random(values, fill_dtype, mean, std)
            cache.index_copy_(0, index, values)
        else:
            cache.index_fill_(0, index, _raw_constant(cache, fill_dtype, mean))
    return int(len(ids) * cache[0].numel() * cache.element_size())


def fill_whole(tensor: torch.Tensor, mean: float, std: float) -> int:
    """Fill a state tensor (not block-indexed) entirely; return bytes written."""
    if std > 0 and tensor.dtype.is_floating_point:
        _fill_random(tensor, tensor.dtype, mean, std)
    else:
        tensor.fill_(_raw_constant(tensor, tensor.dtype, mean))
    return int(tensor.numel() * tensor.element_size())


class FillConnectorWorker(DecodeBenchConnectorWorker):  # type: ignore[misc]
    """Fills the blocks the scheduler side chose, with each request's own values."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, kv_cache_config)
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        config = vllm_config.kv_transfer_config
        self.reporter = Reporter(
            config.get_from_extra_config("control_url", None),
            config.get_from_extra_config("worker_token", None),
            role="worker",
            rank=_tp_rank(),
        )
        # Engine steps timed on TP rank 0 (every rank runs the same steps), unless the
        # server's ``step_timing`` is false; made once the caches say the device.
        self.timing = bool(config.get_from_extra_config("step_timing", True)) and self.reporter.rank == 0
        self.clock: StepClock | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the KV caches; on TP rank 0, start the step clock on their device and
        report the roofline's facts once."""
        super().register_kv_caches(kv_caches)
        if self.timing:
            device = next((t.device for t in kv_caches.values() if isinstance(t, torch.Tensor)), None)
            self.clock = StepClock(self.reporter.add_step, self.reporter.step_dropped, device)
        if self.reporter.provenance_url is None or self.reporter.rank != 0:
            return
        try:
            facts = self.roofline_facts(kv_caches)
        except Exception:
            # A model transformers cannot build, a device torch cannot time: no roofline,
            # never a server that does not start.
            log.warning("FillConnector: no roofline facts for this server", exc_info=True)
            return
        self.reporter.provenance({"roofline": facts})

    def roofline_facts(self, kv_caches: dict[str, Any]) -> dict[str, Any]:
        """Weights, KV bytes per token and bandwidth as this rank holds and measures them."""
        block_sizes = attention_block_sizes(self.kv_cache_config)
        attention = [kv_caches[n] for n in block_sizes if isinstance(kv_caches.get(n), torch.Tensor)]
        device = attention[0].device if attention else torch.device("cpu")
        kv_dtype: torch.dtype | str = (next(iter(self._fp8_dtypes.values())) if self._fp8_dtypes
                                       else attention[0].dtype if attention
                                       else self.vllm_config.cache_config.cache_dtype)
        model = self.vllm_config.model_config
        return roofline.facts(
            model.hf_config,
            model.dtype,
            self.vllm_config.parallel_config.tensor_parallel_size,
            kv_caches,
            block_sizes,
            self.kv_cache_config.num_blocks,
            kv_dtype,
            device,
            cpu_model=cpu_model(),
            trust_remote_code=bool(getattr(model, "trust_remote_code", False)),
        )

    def start_fill_kv(self, metadata: FillConnectorMetadata) -> None:
        """Fill every request's selected blocks, per KV cache group, and count it per run."""
        if not metadata.reqs_to_fill:
            return
        assert self.kv_caches is not None, "KV caches must be registered before filling"
        reported = False
        for req_id, (block_ids_per_group, _num_tokens) in metadata.reqs_to_fill.items():
            mean, std = metadata.fill_values.get(req_id, (self.fill_mean, self.fill_std))
            started = time.perf_counter()
            blocks = nbytes = 0
            device = None
            per_group: dict[int, int] = {}
            for group_idx, block_ids in enumerate(block_ids_per_group):
                if block_ids:
                    written, device = self._fill_group(group_idx, block_ids, mean, std)
                    nbytes += written
                    blocks += len(block_ids)
                    per_group[group_idx] = len(block_ids)
            if device is not None and device.type == "cuda":
                # Count the time the fill really took, not the time to launch it.
                torch.cuda.synchronize(device)
            run_id = metadata.run_ids.get(req_id)
            if run_id is not None:
                self.reporter.add(
                    run_id,
                    requests_filled=1,
                    blocks_filled=blocks,
                    bytes_filled=nbytes,
                    fill_seconds=time.perf_counter() - started,
                )
                self.reporter.add_groups(run_id, per_group)
                reported = True
        if reported:
            self.reporter.soon()

    def _fill_group(
        self, group_idx: int, block_ids: list[int], mean: float, std: float
    ) -> tuple[int, torch.device | None]:
        assert self.kv_caches is not None
        if group_idx in self._zero_fill_group_ids:
            # Circular buffers may pack non-float metadata: only zeros are safe.
            mean, std = 0.0, 0.0
        written = 0
        device = None
        for layer_name in self.group_to_layers.get(group_idx, []):
            cache: Any = self.kv_caches.get(layer_name)
            if isinstance(cache, torch.Tensor):
                fill_dtype = self._fp8_dtypes.get(layer_name, cache.dtype)
                written += fill_block_rows(cache, block_ids, mean, std, fill_dtype)
                device = cache.device
            elif isinstance(cache, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in cache):
                for state in cache:
                    written += fill_whole(state, mean, std)
                    device = state.device
            else:
                log.warning("FillConnector: layer %s has no fillable KV cache (%s)",
                            layer_name, type(cache).__name__)
        return written, device

    def shutdown(self) -> None:
        """Send the last report."""
        self.reporter.close()


def attention_block_sizes(kv_cache_config: KVCacheConfig) -> dict[str, int]:
    """Tokens per block of every attention layer (layers whose cache grows with context)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

    sizes: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        for layer_name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[layer_name]
            if isinstance(spec, AttentionSpec):
                sizes[layer_name] = int(spec.block_size)
    return sizes


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit tests): a single rank
        return 0
