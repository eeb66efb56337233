"""Who may call what: the API token for people, per-worker tokens for connectors.

Mutating calls need ``Authorization: Bearer <api token>`` (or the login cookie the
pages set); reads need it too unless ``DECODEBENCH_PUBLIC_READ`` is on. Worker
tokens open only the connector endpoints. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from sqlmodel import Session, select

from service.errors import Forbidden, LoginRequired, Unauthorized
from service.launcher import hash_token
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


def _is_worker_token(request: Request, token: str) -> bool:
    with Session(request.app.state.engine) as session:
        digest = hash_token(token)
        return session.exec(select(Worker.id).where(Worker.token_hash == digest)).first() is not None


def require_admin(request: Request) -> None:
    """Mutating calls: the API token, nothing else."""
    token = presented_token(request)
    if is_admin(request, token):
        return
    if token is None:
        raise Unauthorized("this call needs the API token: Authorization: Bearer <token>")
    if _is_worker_token(request, token):
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
