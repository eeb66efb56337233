"""What the server a connector runs in really is: versions, resolved engine settings, hardware.

The scheduler side builds this once at its start and the reporter sends it to
``POST {control_url}/api/connector/provenance``, so every run can record the setup its
numbers came from as vLLM resolved it (defaults included), not as it was asked for.
Everything here is read defensively: a field vLLM renamed is reported as missing,
never an error in the engine's start. The worker token never leaves in it: it is
replaced in the command line, and environment variables that look like secrets are
reported by name only.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

REDACTED = "<redacted>"
# Environment variables that change what a server does or where it runs.
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS")
ENV_PREFIXES = ("VLLM_",)
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
# Command-line options whose value is a secret.
SECRET_OPTIONS = ("--api-key",)
MAX_ARGS = 256
MAX_ARG_CHARS = 4096

# Engine settings as (name in the report, config section, attribute).
ENGINE_FIELDS = (
    ("model", "model_config", "model"),
    ("served_model_name", "model_config", "served_model_name"),
    ("dtype", "model_config", "dtype"),
    ("max_model_len", "model_config", "max_model_len"),
    ("quantization", "model_config", "quantization"),
    ("enforce_eager", "model_config", "enforce_eager"),
    ("seed", "model_config", "seed"),
    ("gpu_memory_utilization", "cache_config", "gpu_memory_utilization"),
    ("kv_cache_memory_bytes", "cache_config", "kv_cache_memory_bytes"),
    ("block_size", "cache_config", "block_size"),
    ("kv_cache_dtype", "cache_config", "cache_dtype"),
    ("enable_prefix_caching", "cache_config", "enable_prefix_caching"),
    ("tensor_parallel_size", "parallel_config", "tensor_parallel_size"),
    ("pipeline_parallel_size", "parallel_config", "pipeline_parallel_size"),
    ("data_parallel_size", "parallel_config", "data_parallel_size"),
    ("distributed_executor_backend", "parallel_config", "distributed_executor_backend"),
    ("max_num_seqs", "scheduler_config", "max_num_seqs"),
    ("max_num_batched_tokens", "scheduler_config", "max_num_batched_tokens"),
    ("enable_chunked_prefill", "scheduler_config", "enable_chunked_prefill"),
    ("async_scheduling", "scheduler_config", "async_scheduling"),
    ("load_format", "load_config", "load_format"),
    ("device", "device_config", "device_type"),
)


def _plain(value: Any) -> str | int | float | bool | None:
    """A config value as JSON: torch dtypes as ``float32``, enums by name, the rest as text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    name = getattr(value, "name", None)
    if isinstance(name, str) and type(value).__module__ != "torch":
        return name.lower()  # an enum member
    text = str(value)
    return text.removeprefix("torch.")


def engine_settings(vllm_config: VllmConfig) -> dict[str, Any]:
    """The engine settings the server resolved (vLLM's defaults filled in)."""
    settings: dict[str, Any] = {}
    for name, section, attribute in ENGINE_FIELDS:
        part = getattr(vllm_config, section, None)
        if part is not None and hasattr(part, attribute):
            settings[name] = _plain(getattr(part, attribute))
    compilation = getattr(vllm_config, "compilation_config", None)
    for attribute in ("mode", "cudagraph_mode"):
        if compilation is not None and hasattr(compilation, attribute):
            settings[f"compilation_{attribute}"] = _plain(getattr(compilation, attribute))
    return settings


def kv_cache(kv_cache_config: KVCacheConfig | None, block_size: int | None) -> dict[str, Any]:
    """The KV cache the scheduler was given: blocks, tokens per block, tokens in all."""
    blocks = getattr(kv_cache_config, "num_blocks", None)
    out: dict[str, Any] = {"num_blocks": blocks, "block_size": block_size, "tokens": None}
    if isinstance(blocks, int) and isinstance(block_size, int):
        out["tokens"] = blocks * block_size
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None:
        out["groups"] = len(groups)
    return out


def kv_cache_groups(kv_cache_config: KVCacheConfig, startup_fill: bool) -> list[dict[str, Any]]:
    """Each KV cache group: its kind, tokens per block, window, layers, and how the
    connector fills it: ``at start`` (startup fill), ``per request``, or ``zeroed per
    request`` (circular buffers, which may pack non-float metadata). vLLM's own rules
    decide which groups a startup fill covers."""
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        _get_startup_fill_group_ids,
    )
    from vllm.v1.kv_cache_interface import CircularBufferSpec, iter_layer_specs

    at_start = _get_startup_fill_group_ids(kv_cache_config) if startup_fill else set()
    out: list[dict[str, Any]] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        specs = list(iter_layer_specs(group.kv_cache_spec))
        first = specs[0] if specs else group.kv_cache_spec
        if index in at_start:
            fill = "at start"
        elif any(isinstance(s, CircularBufferSpec) for s in specs):
            fill = "zeroed per request"
        else:
            fill = "per request"
        window = getattr(first, "sliding_window", None)
        out.append({
            "index": index,
            "kind": type(first).__name__.removesuffix("Spec"),
            "block_size": _plain(getattr(first, "block_size", None)),
            "sliding_window": window if isinstance(window, int) else None,
            "layers": len(group.layer_names),
            "fill": fill,
        })
    return out


def versions() -> dict[str, str | None]:
    """vLLM, torch and Python of this process."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("vllm", "torch"):
        module = sys.modules.get(name)
        found[name] = getattr(module, "__version__", None) if module is not None else None
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if cuda:
        found["cuda"] = str(cuda)
    return found


def cpu_model(cpuinfo: str | None = None) -> str | None:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model") and value.strip():
            return value.strip()
    return platform.processor() or None


def gpus(environ: dict[str, str]) -> list[dict[str, Any]]:
    """The GPUs this process may use (``CUDA_VISIBLE_DEVICES``, all when unset), through
    NVML: no CUDA context is made in the engine's process. Empty where NVML is missing."""
    try:
        from vllm.utils.import_utils import import_pynvml

        nvml = import_pynvml()
        nvml.nvmlInit()
    except Exception:
        return []
    try:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        ids = ([v.strip() for v in visible.split(",") if v.strip()] if visible is not None
               else [str(i) for i in range(nvml.nvmlDeviceGetCount())])
        found: list[dict[str, Any]] = []
        for device in ids:
            try:
                handle = (nvml.nvmlDeviceGetHandleByIndex(int(device)) if device.isdigit()
                          else nvml.nvmlDeviceGetHandleByUUID(device))
                name = nvml.nvmlDeviceGetName(handle)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle).total
            except Exception:
                found.append({"id": device, "name": None, "memory_bytes": None})
                continue
            text = name.decode() if isinstance(name, bytes) else str(name)
            found.append({"id": device, "name": text, "memory_bytes": int(memory)})
        return found
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def hardware(device: str | None, environ: dict[str, str]) -> dict[str, Any]:
    """CPU model and cores (all, and those this process may run on); GPUs on a GPU server."""
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    found: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "machine": platform.machine(),
    }
    if device == "cuda":
        listed = gpus(environ)
        found["gpus"] = listed
        found["gpu_count"] = len(listed)
    return found


def environment(environ: dict[str, str]) -> dict[str, str]:
    """The variables that matter (CUDA device choice, vLLM's own), secrets by name only."""
    chosen = {}
    for name, value in sorted(environ.items()):
        if name in ENV_NAMES or name.startswith(ENV_PREFIXES):
            secret = any(word in name.upper() for word in SECRET_WORDS)
            chosen[name] = REDACTED if secret else value
    return chosen


def command_line(argv: list[str], token: str | None) -> list[str]:
    """The server's command line, with the worker token and secret options replaced."""
    out: list[str] = []
    hide_next = False
    for arg in argv[:MAX_ARGS]:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if name in SECRET_OPTIONS:
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        if token:
            arg = arg.replace(token, REDACTED)
        out.append(arg[:MAX_ARG_CHARS])
    return out


def build(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig | None,
    token: str | None,
    argv: list[str] | None = None,
    environ: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The provenance report of the server this connector runs in."""
    env = dict(os.environ if environ is None else environ)
    engine = engine_settings(vllm_config)
    block_size = engine.get("block_size")
    cache = kv_cache(kv_cache_config, block_size if isinstance(block_size, int) else None)
    groups: list[dict[str, Any]] = []
    if kv_cache_config is not None:
        transfer = vllm_config.kv_transfer_config
        startup = bool(transfer.get_from_extra_config("startup_fill", False)) if transfer else False
        groups = kv_cache_groups(kv_cache_config, startup)
        cache["startup_fill"] = startup
    return {
        "versions": versions(),
        "engine": engine,
        "kv_cache": cache,
        "kv_cache_groups": groups,
        "hardware": hardware(engine.get("device"), env),
        "argv": command_line(list(sys.argv if argv is None else argv), token),
        "env": environment(env),
    }
