"""A vLLM server started elsewhere and registered with the service: what a user sends."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from pydantic import (
    Field,
    field_validator,
)

from service.core.spec import _REPO_ID, EngineSpec, Int, Strict, worker_key
from service.core.tinymodel import TINY_MODEL_NAME

_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*|[0-9A-Fa-f:.]+)$")


def _base_url(value: str) -> str:
    """An http(s) base URL without credentials, query or fragment, with no trailing slash."""
    problem = (
        "must be an http:// or https:// base URL such as http://10.0.0.5:8000 "
        "(no user, query or fragment)"
    )
    if any(c.isspace() or not c.isprintable() for c in value) or "?" in value or "#" in value:
        raise ValueError(problem)
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or parts.username is not None or not parts.hostname:
        raise ValueError(problem)
    if not _HOST.match(parts.hostname):
        raise ValueError(f"{parts.hostname!r} is not a host name or IP address")
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when asked
    except ValueError as exc:
        raise ValueError(f"bad port: {exc}") from exc
    return value.rstrip("/")


class WorkerRegister(Strict):
    """A vLLM server started elsewhere (a pod, a Slurm job, another host), to be driven
    by this service; it must load the connector with the token this call returns."""

    url: str = Field(max_length=512, description="Base URL of the vLLM server, as this service reaches it")
    model: str = Field(
        min_length=1, max_length=512,
        description="The model name the server serves (its --served-model-name); runs ask for it",
    )
    engine: EngineSpec = Field(default_factory=EngineSpec)
    vocab_size: Int | None = Field(
        default=None, ge=16, le=1 << 24,
        description="Prompt token ids are drawn below this; default 32000 (8192 for the tiny model)",
    )
    control_url: str | None = Field(
        default=None, max_length=512,
        description="This service's URL as the server's host reaches it, for the command shown",
    )
    token: str | None = Field(
        default=None, min_length=32, max_length=256, pattern=r"^[A-Za-z0-9._~+/=-]+$",
        description="A worker token you chose (e.g. from a Kubernetes Secret); made for you if left out",
    )

    @field_validator("url", "control_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else _base_url(value)

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        if value != TINY_MODEL_NAME and ("://" in value or ".." in value or not _REPO_ID.match(value)):
            raise ValueError(
                "model must be the name the server serves: a Hugging Face repo id like 'org/name' "
                "or a bare name (start the server with --served-model-name NAME)"
            )
        return value

    def worker_key(self) -> str:
        """The key of the runs this server can take."""
        return worker_key(self.model, self.engine)
