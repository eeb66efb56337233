"""The service's side of provenance: the facts only this process can read.

- the service itself: decodebench's version and git commit, read once at start
  (``service_facts``);
- a worker as this service started it: its command line and the environment variables
  that matter, secrets hidden (``launch``), stored on the worker row.

``service.core.provenance.snapshot`` joins them with what the worker's connector reports
into the record stored with each run.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
GIT_TIMEOUT_S = 2.0
REDACTED = "<redacted>"
# The worker environment variables that change what a server does or where it runs.
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS")
ENV_PREFIXES = ("VLLM_",)
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")

def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def service_facts() -> dict[str, Any]:
    """decodebench's version, and its git commit (with whether the tree had changes) when
    it runs from a checkout; read once per process."""
    try:
        version: str | None = importlib.metadata.version("decodebench")
    except importlib.metadata.PackageNotFoundError:
        version = None
    commit = _git("rev-parse", "HEAD") if (REPO_ROOT / ".git").exists() else None
    dirty = None
    if commit is not None:
        status = _git("status", "--porcelain", "--untracked-files=no")
        dirty = bool(status) if status is not None else None
    return {"version": version, "commit": commit, "dirty": dirty,
            "python": sys.version.split()[0]}


def worker_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of a worker's environment that matter, secrets by name only."""
    chosen = {}
    for name, value in sorted(env.items()):
        if name in ENV_NAMES or name.startswith(ENV_PREFIXES):
            chosen[name] = REDACTED if any(w in name.upper() for w in SECRET_WORDS) else value
    return chosen


def redact(argv: list[str], token: str) -> list[str]:
    """A command line with the worker token replaced."""
    return [arg.replace(token, REDACTED) for arg in argv]


def launch(argv: list[str], env: Mapping[str, str], token: str) -> dict[str, Any]:
    """A started worker's part: its command line and environment, the token hidden."""
    return {"argv": redact(argv, token), "env": worker_env(env)}
