"""vLLM's real scheduler classes on CPU, driven step by step, for connector tests.

No model runs: a step's "model output" is one sampled token per scheduled
request, which is all the scheduler needs to move requests along. Block
selection, prefix caching, null blocks of sliding-window groups and request
lifecycles are vLLM's own.
"""

from __future__ import annotations

from itertools import count
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from service.core.tinymodel import ensure_tiny_model

OURS = ("FillConnector", "connector")
UPSTREAM = ("DecodeBenchConnector", None)
EOS = 2
_ids = count()
init_none_hash(sha256)


def model_dir(tmp: Path) -> Path:
    """The bundled tiny model's config, for vLLM's ModelConfig (no weights are loaded)."""
    return ensure_tiny_model(tmp)


def attention(block_size: int = 16, dtype: torch.dtype = torch.float32) -> FullAttentionSpec:
    """A full-attention spec of the tiny model's shape."""
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=dtype)


def sliding(window: int, block_size: int = 16) -> SlidingWindowSpec:
    """A sliding-window spec of the tiny model's shape."""
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=32,
                             dtype=torch.float32, sliding_window=window)


def kv_config(groups: list[tuple[list[str], KVCacheSpec]], num_blocks: int = 2000) -> KVCacheConfig:
    """A KV cache config with the given (layer names, spec) groups."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups],
    )


def vllm_config(
    tmp: Path,
    connector: tuple[str, str | None],
    extra: dict[str, Any] | None = None,
    block_size: int = 16,
    max_batched: int = 4096,
    cache_dtype: str = "auto",
) -> VllmConfig:
    """A VllmConfig for the tiny model on CPU with ``connector`` loaded."""
    model = ModelConfig(model=str(model_dir(tmp)), dtype="float32", seed=0, max_model_len=8192)
    cache = CacheConfig(block_size=block_size, gpu_memory_utilization=0.5, cache_dtype=cache_dtype,
                        enable_prefix_caching=True)
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=256, max_num_batched_tokens=max_batched, max_model_len=8192,
            enable_chunked_prefill=True, is_encoder_decoder=False,
        ),
        cache_config=cache,
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector[0], kv_connector_module_path=connector[1], kv_role="kv_both",
            kv_connector_extra_config=extra or {},
        ),
        device_config=DeviceConfig("cpu"),
    )


def scheduler(config: VllmConfig, kv: KVCacheConfig) -> Scheduler:
    """vLLM's scheduler (it builds the connector's scheduler side itself)."""
    config.cache_config.num_gpu_blocks = kv.num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=config.cache_config.block_size,
    )


def request(
    prompt: list[int],
    run_id: str | None = None,
    max_tokens: int = 2,
    salt: str | None = None,
    block_size: int = 16,
    request_id: str | None = None,
    seeding: bool = False,
) -> Request:
    """A request as the API server would make it, tagged with a run id if given (and as of
    a seeded run's seeding pass with ``seeding``)."""
    tag: dict[str, Any] = {"decodebench_run_id": run_id, **({"decodebench_seeding": True} if seeding else {})}
    extra = {"kv_transfer_params": tag} if run_id else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def step(sched: Scheduler) -> tuple[SchedulerOutput, Any]:
    """One scheduling step; every scheduled request samples one token. Returns the output
    and the connector metadata built for it."""
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    finished_prefill = []
    for req_id in req_ids:
        req = sched.requests[req_id]
        done = req.num_computed_tokens + out.num_scheduled_tokens[req_id]
        finished_prefill.append(done >= req.num_prompt_tokens)
    runner = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] if ok else [] for ok in finished_prefill],
    )
    sched.update_from_output(out, runner)
    return out, out.kv_connector_metadata


def run_until_idle(sched: Scheduler, max_steps: int = 10_000) -> list[Any]:
    """Step until no request is left; return every step's connector metadata."""
    metas = []
    for _ in range(max_steps):
        if not sched.has_requests():
            return metas
        metas.append(step(sched)[1])
    raise AssertionError("scheduler did not drain")


def fills(metas: list[Any]) -> dict[str, tuple[tuple[list[int], ...], int]]:
    """All requests' selected blocks over a list of metadata."""
    selected: dict[str, tuple[tuple[list[int], ...], int]] = {}
    for meta in metas:
        selected.update(meta.reqs_to_fill)
    return selected
