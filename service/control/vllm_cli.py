"""The vLLM server command line: engine flags, the connector's KV transfer config, the
argv of a worker this service starts and the ``vllm serve`` line of a registered one."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from service.core.servers import WorkerRegister
from service.core.shapes import PREFIX, SHAPES, ensure_bundled, is_bundled, is_shape
from service.core.spec import EngineSpec, FillSpec, RunSpec, effective_load_format
from service.settings import Settings

_LABEL = re.compile(r'(\w+)="([^"]*)"')
# vLLM's ``--max-model-len`` value for "the longest that fits the KV cache memory".
AUTO_FIT = "-1"


def read_model_config(model_path: str | Path) -> dict[str, Any] | None:
    """A model directory's config.json, or None if it cannot be read as a JSON object."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def model_vocab_size(model_path: str) -> int | None:
    """The vocabulary size a model directory's config.json gives, if it gives one."""
    vocab = (read_model_config(model_path) or {}).get("vocab_size")
    return int(vocab) if isinstance(vocab, int) else None


def local_model_config(settings: Settings, model: str, layers: int | None = None) -> dict[str, Any] | None:
    """The config.json of a model on this machine (a bundled model, built with ``layers``
    layers for a shape, or a local directory); None for a hub id, whose config only the
    vLLM server fetches."""
    if is_bundled(model):
        return read_model_config(ensure_bundled(settings.models_dir, model, layers))
    if model.startswith("/"):
        return read_model_config(model)
    return None


def kv_transfer_config(control_url: str, token: str, mean: float, std: float,
                       startup_fill: bool = False) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` that loads the FillConnector, pulling from ``control_url``;
    with ``startup_fill`` the connector fills the whole cache with ``mean``/``std`` at start."""
    extra: dict[str, Any] = {"startup_fill": True} if startup_fill else {}
    return {
        "kv_connector": "FillConnector",
        "kv_connector_module_path": "connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "control_url": control_url,
            "worker_token": token,
            "fill_mean": mean,
            "fill_std": std,
            **extra,
        },
    }


def engine_flags(model: str, engine: EngineSpec, on_cpu: bool) -> list[str]:
    """vLLM server flags for an engine spec (CPU defaults where vLLM's own fail on CPU)."""
    flags = [
        "--dtype", engine.dtype or ("float32" if on_cpu else "auto"),
        "--tensor-parallel-size", str(engine.tensor_parallel_size),
    ]  # fmt: skip
    kv_bytes = engine.kv_cache_bytes()
    if kv_bytes is not None:
        flags += ["--kv-cache-memory-bytes", str(kv_bytes)]
    mem = engine.gpu_memory_utilization or (0.3 if on_cpu and kv_bytes is None else None)
    if mem is not None:
        flags += ["--gpu-memory-utilization", str(mem)]
    # Without engine.max_model_len, -1: vLLM takes the model's own length when its KV cache
    # memory holds one request that long, else the longest it holds (it logs "Auto-fit
    # max_model_len"), where with no flag it would refuse to start.
    flags += ["--max-model-len", str(engine.max_model_len) if engine.max_model_len is not None else AUTO_FIT]
    if effective_load_format(model, engine.load_format) == "dummy":
        flags += ["--load-format", "dummy"]
    if engine.speculative is not None:
        flags += ["--speculative-config", json.dumps(engine.speculative.vllm_config(), separators=(",", ":"))]
    if on_cpu:
        flags += ["--enforce-eager"]
        flags += shape_cpu_flags(model, engine.extra_args)
    return flags + list(engine.extra_args)


def shape_cpu_flags(model: str, extra_args: list[str]) -> list[str]:
    """The flags a bundled shape needs on a CPU (``Shape.cpu_flags``), but for those whose
    setting the run's ``extra_args`` chose itself (``--x`` or ``--no-x``)."""
    shape = SHAPES.get(model.removeprefix(PREFIX)) if is_shape(model) else None
    if shape is None:
        return []
    chosen = {a.split("=", 1)[0].removeprefix("--").removeprefix("no-") for a in extra_args}
    return [flag for flag, _why in shape.cpu_flags
            if flag.removeprefix("--").removeprefix("no-") not in chosen]


def serve_command(body: WorkerRegister, control_url: str, token: str) -> tuple[str, dict[str, Any]]:
    """The ``vllm serve`` line a registered server is to be started with, and its KV config."""
    fill = FillSpec()
    config = kv_transfer_config(control_url, token, fill.mean, fill.std)
    port = urlsplit(body.url).port or 8000
    argv = [
        "vllm", "serve", body.model, "--served-model-name", body.model,
        "--host", "0.0.0.0", "--port", str(port),
        "--kv-transfer-config", json.dumps(config, separators=(",", ":")),
        *engine_flags(body.model, body.engine, on_cpu=False),
    ]  # fmt: skip
    return shlex.join(argv), config


def worker_argv(settings: Settings, spec: RunSpec, port: int, token: str, gpus: list[str],
                host: str = "127.0.0.1", models_dir: Path | None = None) -> tuple[list[str], str]:
    """A started worker's argv (never a shell string) and the model path it serves.
    ``host``: the address it listens on; ``models_dir``: where the bundled tiny model is on
    the host that runs it (the service's data dir by default)."""
    if is_bundled(spec.model):
        written = ensure_bundled(settings.models_dir, spec.model, spec.engine.num_layers)
        # The same place under the host's own models dir (a Ray node writes its copy there).
        model_path = str(models_dir / written.relative_to(settings.models_dir) if models_dir else written)
    else:
        model_path = spec.model
    kv_config = kv_transfer_config(settings.control_base_url(), token, spec.fill.mean, spec.fill.std,
                                   spec.fill.startup)
    argv = [
        *settings.worker_command(),
        "--model", model_path,
        "--served-model-name", spec.model,
        "--host", host,
        "--port", str(port),
        "--kv-transfer-config", json.dumps(kv_config),
        *engine_flags(spec.model, spec.engine, on_cpu=not gpus),
    ]  # fmt: skip
    return argv, model_path


async def cache_config(client: httpx.AsyncClient, url: str) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` metric (its ``CacheConfig``:
    ``block_size``, ``num_gpu_blocks``, ``enable_prefix_caching``, ...); {} without them."""
    try:
        text = (await client.get(f"{url}/metrics", timeout=10.0)).text
    except httpx.HTTPError:
        return {}
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(_LABEL.findall(line))
    return {}


async def kv_capacity(client: httpx.AsyncClient, url: str) -> int | None:
    """KV cache size in tokens from vLLM's ``cache_config_info`` metric, if it is there."""
    try:
        text = (await client.get(f"{url}/metrics", timeout=10.0)).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(_LABEL.findall(line))
            try:
                return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            except (KeyError, ValueError):
                return None
    return None


def _card_max_model_len(listed: Any, served_model: str) -> int | None:
    """The ``max_model_len`` a ``/v1/models`` answer gives for ``served_model``; None when it
    lists no such model or gives no positive length. Raises KeyError or TypeError on an
    answer that is no model list."""
    for card in listed["data"]:
        if card["id"] == served_model:
            length = card.get("max_model_len")
            return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
    return None


async def answers_as(client: httpx.AsyncClient, url: str, served_model: str, timeout: float) -> bool:
    """True if ``url`` answers ``/health`` with 200 and its ``/v1/models`` lists ``served_model``:
    the server started there, not another program on its port. vLLM binds its port at once
    but listens only once its engine is up, tens of seconds later; another program can
    listen there in between (both binding with ``SO_REUSEADDR``), and its ``/health`` would
    pass for the server's. That server then fails to listen and exits, saying why."""
    try:
        if (await client.get(f"{url}/health", timeout=timeout)).status_code != 200:
            return False
        listed = (await client.get(f"{url}/v1/models", timeout=timeout)).json()
        return any(card["id"] == served_model for card in listed["data"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False


async def served_max_model_len(client: httpx.AsyncClient, url: str, served_model: str) -> int | None:
    """The longest sequence a server takes, as its ``/v1/models`` says (for a server started
    with ``--max-model-len -1``, what vLLM fitted to its KV cache memory); None if it does
    not say."""
    try:
        listed = (await client.get(f"{url}/v1/models", timeout=10.0)).json()
        return _card_max_model_len(listed, served_model)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
