"""The facts a decode roofline needs, as the server holds them: weights read per step, KV
bytes per token of context, and the memory bandwidth of the server's device.

The service computes a run's minimum decode step time as (weight bytes + the sum over
decoding sequences of context x KV bytes per token) / bandwidth. The worker side of the
connector (TP rank 0) gathers these once, when vLLM registers its KV caches, and reports
them as ``roofline`` in the server's provenance. The counts here need neither vLLM nor a
GPU: weights are counted on the meta device (no memory), KV bytes come from whatever
tensors are passed in, and the bandwidth is measured on any torch device.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping
from typing import Any

import torch

MIB = 1 << 20
# Large enough to leave every cache level behind, small enough to fit beside the KV cache.
GPU_BUFFER_BYTES = 256 * MIB
CPU_BUFFER_BYTES = 64 * MIB
MIN_BUFFER_BYTES = 16 * MIB
REPEATS = 5


def _text_config(config: Any) -> Any:
    """The language model's part of a config (multimodal configs nest it)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def meta_model(config: Any, trust_remote_code: bool = False) -> torch.nn.Module:
    """The causal LM of ``config`` with every parameter on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, trust_remote_code=trust_remote_code)
        except (ValueError, KeyError):
            # A multimodal config AutoModelForCausalLM has no class for: its text model.
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                _text_config(config), trust_remote_code=trust_remote_code)
    assert isinstance(model, torch.nn.Module)
    return model


def streamed_params(config: Any, trust_remote_code: bool = False) -> int:
    """Parameters a decode step reads: all of them but the input embedding table (a gather
    of a few rows). A tied embedding is read once per step, as the LM head."""
    return counted_params(config, trust_remote_code)[0]


def counted_params(config: Any, trust_remote_code: bool = False) -> tuple[int, int]:
    """``streamed_params``, and how many of them are routed experts' (parameters under an
    ``experts`` module: a step reads only the experts its tokens are routed to; shared
    experts and the router are read every step)."""
    model = meta_model(config, trust_remote_code)
    total = sum(p.numel() for p in model.parameters())  # shared parameters once
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}")
    embedding = model.get_input_embeddings()
    table = getattr(embedding, "weight", None)
    if not isinstance(table, torch.Tensor):
        return int(total), int(experts)
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is table:
        return int(total), int(experts)
    return int(total - table.numel()), int(experts)


def routing(config: Any) -> tuple[int, int] | None:
    """(routed experts per layer, experts per token) of a mixture of experts, else None."""
    text = _text_config(config)
    experts = next((getattr(text, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(text, k, None), int) and getattr(text, k) > 0), None)
    per_token = getattr(text, "num_experts_per_tok", None)
    if experts is None or not isinstance(per_token, int) or per_token <= 0:
        return None
    return experts, per_token


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` as ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def element_size(dtype: torch.dtype | str) -> int:
    """Bytes of one element of ``dtype`` (a torch dtype or its name)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return int(torch.empty((), dtype=dtype, device="meta").element_size())


def kv_bytes_per_token(
    kv_caches: Mapping[str, Any], block_sizes: Mapping[str, int], num_blocks: int
) -> int:
    """Bytes of KV cache one token of context takes on this rank, summed over layers.

    Layout-free: each layer's tensor holds ``num_blocks`` blocks of its group's block size
    whether the block dimension comes first (FlashInfer, MLA's one latent tensor), second
    (FlashAttention's ``(2, num_blocks, ...)``, the CPU backend's) or is split into smaller
    kernel blocks, so its bytes divided by the tokens it holds is the layer's K and V of
    one token. Only layers in ``block_sizes`` count: state tensors (Mamba and other linear
    attention) are per sequence, not per token.
    """
    total = 0
    for name, block_size in block_sizes.items():
        cache = kv_caches.get(name)
        if not isinstance(cache, torch.Tensor):
            continue
        nbytes = cache.numel() * cache.element_size()
        per_token, rest = divmod(nbytes, num_blocks * block_size)
        if rest:
            raise ValueError(f"layer {name}: {nbytes} bytes is not {num_blocks} blocks of "
                             f"{block_size} tokens")
        total += per_token
    return total


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def layer_window(config: Any, index: int) -> tuple[str, int] | None:
    """How far back layer ``index`` attends, where it does not attend to the whole context:
    ("sliding", window) for a sliding window layer (Gemma 3's local layers, gpt-oss's), or
    ("chunked", chunk) for chunked local attention (Llama 4's RoPE layers), read from the
    config's ``layer_types``; None for a layer that reads every token of context."""
    text = _text_config(config)
    kinds = getattr(text, "layer_types", None)
    if not isinstance(kinds, (list, tuple)) or not 0 <= index < len(kinds):
        return None
    window = getattr(text, "sliding_window", None)
    chunk = getattr(text, "attention_chunk_size", None)
    if kinds[index] == "sliding_attention" and isinstance(window, int) and window > 0:
        return "sliding", window
    if kinds[index] == "chunked_attention" and isinstance(chunk, int) and chunk > 0:
        return "chunked", chunk
    return None


def windowed_kv(
    config: Any, kv_caches: Mapping[str, Any], block_sizes: Mapping[str, int], num_blocks: int
) -> list[dict[str, Any]]:
    """The part of ``kv_bytes_per_token`` held by layers that attend over a window, per
    (kind, window): a decode step reads at most the window's tokens of those, not the whole
    context (``service.analysis.roofline``)."""
    found: dict[tuple[str, int], int] = {}
    for name in block_sizes:
        match = _LAYER_INDEX.search(name)
        reach = layer_window(config, int(match.group(1))) if match else None
        if reach is not None:
            per_token = kv_bytes_per_token(kv_caches, {name: block_sizes[name]}, num_blocks)
            found[reach] = found.get(reach, 0) + per_token
    return [{"kind": kind, "window": window, "bytes_per_token": nbytes}
            for (kind, window), nbytes in sorted(found.items())]


def state_bytes_per_sequence(
    kv_caches: Mapping[str, Any], block_sizes: Mapping[str, int], num_blocks: int
) -> int:
    """Bytes of fixed-size state one sequence holds on this rank, summed over the layers
    that keep state rather than KV (Mamba, gated DeltaNet, other linear attention): each such
    layer's tensors hold one state per block, and a decode step reads a sequence's whole
    state whatever its context."""
    total = 0
    for name, cache in kv_caches.items():
        if name in block_sizes:
            continue
        if isinstance(cache, torch.Tensor):
            tensors = [cache]
        else:
            tensors = list(cache) if isinstance(cache, (list, tuple)) else []
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and tensor.shape[0] == num_blocks:
                total += tensor[0].numel() * tensor.element_size()
    return total


def _synchronize(device: torch.device) -> None:
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if device.type != "cpu" and callable(sync):
        sync(device)


def _best_seconds(work: Any, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``work`` after one untimed call."""
    work()
    _synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            work()
            _synchronize(device)
            seconds = time.perf_counter() - began
        best = min(best, seconds)
    return best


def _time_copy_and_fill(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float]:
    """Best seconds of a copy of ``nbytes`` into another buffer, and of a fill of one."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    source.fill_(1)  # touch every page before timing (first-touch faults on a CPU)
    copy = _best_seconds(lambda: target.copy_(source), device, repeats)
    fill = _best_seconds(lambda: target.fill_(7), device, repeats)
    return copy, fill


def measure_bandwidth(
    device: torch.device | str, nbytes: int | None = None, repeats: int = REPEATS
) -> dict[str, Any]:
    """Memory bandwidth of ``device``: a copy of one buffer into another (bytes read plus
    bytes written) and a fill of one (bytes written), best of ``repeats``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if nbytes is None:
        nbytes = CPU_BUFFER_BYTES if device.type == "cpu" else GPU_BUFFER_BYTES
    while True:
        try:
            copy, fill = _time_copy_and_fill(device, nbytes, repeats)
            break
        except torch.OutOfMemoryError:
            # The KV cache took the memory: a smaller buffer, still far beyond the caches.
            if nbytes <= MIN_BUFFER_BYTES:
                raise
            torch.cuda.empty_cache()
            nbytes = max(MIN_BUFFER_BYTES, nbytes // 4)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the buffers' memory back at once
    return {
        "measured_bytes_per_s": 2 * nbytes / copy,
        "how": f"copy of {nbytes / MIB:g} MiB on {device}, best of {repeats}",
        "fill_bytes_per_s": nbytes / fill,
    }


def spec_bandwidth(device: torch.device | str) -> tuple[float | None, str | None]:
    """The GPU's rated memory bandwidth from NVML: the top memory clock x the bus width x 2
    (double data rate); ``(None, None)`` on a CPU or where NVML cannot say."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    try:
        import pynvml

        uuid = str(torch.cuda.get_device_properties(device).uuid)
        pynvml.nvmlInit()
    except Exception:
        return None, None
    try:
        prefix = "" if uuid.startswith(("GPU-", "MIG-")) else "GPU-"
        handle = pynvml.nvmlDeviceGetHandleByUUID(prefix + uuid)
        mhz = int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM))
        bits = int(pynvml.nvmlDeviceGetMemoryBusWidth(handle))
    except Exception:
        return None, None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    rate = mhz * 1e6 * bits * 2 / 8
    return rate, f"NVML: max memory clock {mhz} MHz x bus width {bits} bits x 2 (DDR) / 8"


def device_name(device: torch.device | str, cpu_model: str | None = None) -> str:
    """The device in words: ``cuda:0 NVIDIA H100 80GB HBM3``, ``cpu <model>``."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"{device} {cpu_model}" if cpu_model else str(device)


def bandwidth(device: torch.device | str) -> dict[str, Any]:
    """The ``bandwidth`` block of the report: measured, and rated where NVML says."""
    measured = measure_bandwidth(device)
    spec, spec_how = spec_bandwidth(device)
    return {**measured, "spec_bytes_per_s": spec, "spec_how": spec_how}


def facts(
    config: Any,
    weight_dtype: torch.dtype | str,
    tensor_parallel_size: int,
    kv_caches: Mapping[str, Any],
    block_sizes: Mapping[str, int],
    num_blocks: int,
    kv_dtype: torch.dtype | str,
    device: torch.device | str,
    cpu_model: str | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """The ``roofline`` block of the provenance report, for one tensor-parallel rank."""
    tp = max(1, int(tensor_parallel_size))
    params, expert_params = counted_params(config, trust_remote_code)
    routed = routing(config)
    moe: dict[str, Any] = {}
    if routed is not None and expert_params:
        moe = {"expert_weight_bytes": expert_params * element_size(weight_dtype) // tp,
               "num_experts": routed[0], "experts_per_token": routed[1]}
    # Only where the model has them: layers that attend over a window, per-sequence state.
    windowed = windowed_kv(config, kv_caches, block_sizes, num_blocks)
    state = state_bytes_per_sequence(kv_caches, block_sizes, num_blocks)
    extra: dict[str, Any] = {**({"windowed_kv": windowed} if windowed else {}),
                             **({"state_bytes_per_sequence": state} if state else {})}
    return {
        **moe,
        **extra,
        "weight_bytes": params * element_size(weight_dtype) // tp,
        "weight_params": params,
        "kv_bytes_per_token": kv_bytes_per_token(kv_caches, block_sizes, num_blocks),
        "kv_dtype": dtype_name(kv_dtype),
        "weight_dtype": dtype_name(weight_dtype),
        "tensor_parallel_size": tp,
        "bandwidth": bandwidth(device),
        "device": device_name(device, cpu_model),
    }
