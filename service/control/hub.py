"""Whether the model a run names can be found before a worker is started for it.

A local path needs its ``config.json`` (``RunSpec`` checks that); a Hugging Face repo id
must be in the local Hugging Face cache (a snapshot with a ``config.json``), or, when the
service may ask the hub, known to the hub. vLLM would otherwise fail to start 40 s later.

How far the check goes is the ``hub_check`` setting: ``off`` (no check), ``cache`` (the
local cache only) or ``online`` (the cache, then the hub unless ``HF_HUB_OFFLINE`` is set).
This module reads files and, with ``online``, makes one short HTTP request; it never
imports ``huggingface_hub``, ``vllm`` or ``torch``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import httpx

from service.core.modelconfig import MaxLen, model_dir_max_len
from service.core.shapes import is_bundled

HubCheck = Literal["off", "cache", "online"]
HUB_ENDPOINT = "https://huggingface.co"
HUB_TIMEOUT_S = 3.0
_TRUE = {"1", "true", "yes", "on"}


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where huggingface_hub keeps downloaded repos, by its own rules: ``HF_HUB_CACHE``,
    else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache`` when unset)."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HUGGINGFACE_HUB_CACHE"):  # the older name
        return Path(env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline(env: Mapping[str, str] | None = None) -> bool:
    """Whether Hugging Face libraries are told not to reach the hub."""
    env = os.environ if env is None else env
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(env.get(name, "").strip().lower() in _TRUE for name in names)


def cached_config(repo_id: str, cache: Path) -> Path | None:
    """The ``config.json`` of a cached snapshot of ``repo_id``, or None."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    return next(iter(sorted(repo_dir.glob("snapshots/*/config.json"))), None)


def ask_hub(repo_id: str, env: Mapping[str, str] | None = None,
            transport: httpx.BaseTransport | None = None) -> tuple[bool | None, str]:
    """Whether the hub knows ``repo_id`` (None: it could not be asked), and what was asked
    and answered, for the message."""
    env = os.environ if env is None else env
    url = f"{env.get('HF_ENDPOINT', HUB_ENDPOINT).rstrip('/')}/api/models/{repo_id}"
    headers = {"Authorization": f"Bearer {env['HF_TOKEN']}"} if env.get("HF_TOKEN") else {}
    try:
        with httpx.Client(transport=transport, timeout=HUB_TIMEOUT_S) as client:
            response = client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        return None, f"the hub could not be reached ({url}: {type(exc).__name__}: {exc})"
    if response.status_code == 200:
        return True, f"the hub knows it ({url})"
    if response.status_code in (401, 403, 404):
        # The hub answers 401 for a repo that does not exist (or is private) without a token.
        return False, f"the hub does not know it ({url} answered {response.status_code})"
    return None, f"the hub did not say ({url} answered {response.status_code})"


def model_problem(model: str, check: HubCheck, env: Mapping[str, str] | None = None,
                  transport: httpx.BaseTransport | None = None) -> str | None:
    """Why a worker could not load ``model`` (a repo id), or None when it can or the check
    is off. Local paths and the bundled models are left to ``RunSpec``."""
    if check == "off" or is_bundled(model) or model.startswith("/"):
        return None
    cache = hub_cache_dir(env)
    if cached_config(model, cache) is not None:
        return None
    tried = [f"not in the Hugging Face cache (no {cache}/models--{model.replace('/', '--')}"
             "/snapshots/*/config.json; HF_HUB_CACHE or HF_HOME set where it is)"]
    if check == "cache":
        tried.append("the hub was not asked (DECODEBENCH_HUB_CHECK=cache)")
    elif hub_offline(env):
        tried.append("the hub was not asked (HF_HUB_OFFLINE is set)")
    else:
        known, said = ask_hub(model, env, transport)
        if known:
            return None
        tried.append(said)
    return (f"model {model!r} cannot be loaded: {'; '.join(tried)}. Download it first "
            "(huggingface-cli download " + model + "), or give the absolute path of a local "
            "model directory")


def cached_max_len(model: str, env: Mapping[str, str] | None = None) -> MaxLen | None:
    """The longest sequence a repo id takes, from its cached snapshot's config (None when
    it is not in the cache: then nothing is known before its server starts)."""
    if is_bundled(model) or model.startswith("/"):
        return None
    config = cached_config(model, hub_cache_dir(env))
    return model_dir_max_len(config.parent) if config is not None else None
