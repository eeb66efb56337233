"""Who may call what: the API token for people, per-worker tokens for connectors.

Mutating calls need ``Authorization: Bearer <api token>`` (or the login cookie the
pages set); reads need it too unless ``DECODEBENCH_PUBLIC_READ`` is on. Worker
tokens open only the connector endpoints. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from service import store
from service.errors import Forbidden, LoginRequired, Unauthorized
from service.models import Worker

COOKIE = "decodebench_token"


def presented_token(request: Request) -> str | None:
    """The bearer token of a request, or its login cookie."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token:
        return token.strip()
    return request.cookies.get(COOKIE)


def is_admin(request: Request, token: str | None) -> bool:
    """True if ``token`` is the service's API token."""
    expected: str = request.app.state.api_token
    return token is not None and hmac.compare_digest(token.encode(), expected.encode())


def require_worker(request: Request) -> Worker:
    """Connector calls: the active worker whose bearer token this is, or 401/403."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("a worker bearer token is required")
    worker = store.worker_by_token(request.app.state.engine, token.strip())
    if worker is None:
        raise Unauthorized("unknown worker token")
    # A registered server that missed a probe is still the same server: its pulls go on.
    if worker.status not in ("starting", "ready", "unavailable"):
        raise Forbidden("this worker is no longer active")
    return worker


def require_admin(request: Request) -> None:
    """Mutating calls: the API token, nothing else."""
    token = presented_token(request)
    if is_admin(request, token):
        return
    if token is None:
        raise Unauthorized("this call needs the API token: Authorization: Bearer <token>")
    if store.worker_by_token(request.app.state.engine, token) is not None:
        raise Forbidden("a worker token may only call the connector endpoints")
    raise Unauthorized("wrong API token")


def require_reader(request: Request) -> None:
    """Reads: open with DECODEBENCH_PUBLIC_READ, else like mutating calls."""
    if request.app.state.settings.public_read:
        return
    require_admin(request)


def require_page_reader(request: Request) -> None:
    """Pages: like reads, but a browser without credentials goes to the login page."""
    if request.app.state.settings.public_read or is_admin(request, presented_token(request)):
        return
    raise LoginRequired("log in first")
