"""Who may call what: the API token for people, per-worker tokens for connectors.

Mutating calls need ``Authorization: Bearer <api token>`` or the login session the
pages set; reads need it too unless ``DECODEBENCH_PUBLIC_READ`` is on. Worker
tokens open only the connector endpoints. Tokens are compared in constant time.

The login session is a cookie holding a signed timestamp, never the token: it proves
that its holder typed the API token at ``/login`` within ``SESSION_MAX_AGE_S``.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

from fastapi import Request
from itsdangerous import BadSignature, SignatureExpired, TimestampSigner

from service.core.errors import Forbidden, LoginRequired, Unauthorized
from service.storage import workers
from service.storage.tables import Worker

COOKIE = "decodebench_session"
# Before sessions the pages kept the raw API token in this cookie. It no longer logs anyone
# in; login and logout clear it so that no browser keeps a copy of the token.
LEGACY_COOKIE = "decodebench_token"
SESSION_MAX_AGE_S = 7 * 24 * 3600
# What a session vouches for; there is one kind of person, the API token's holder.
_SUBJECT = b"admin"

SessionState = Literal["absent", "valid", "expired", "invalid"]
_SESSION_REFUSED: dict[SessionState, str] = {
    "expired": "the login session expired: log in again at /login",
    "invalid": "the login cookie is not valid (altered, older than the API token, or of an "
               "old kind): log in again at /login",
}


def session_signer(api_token: str) -> TimestampSigner:
    """The signer of login sessions for the service whose API token is ``api_token``."""
    # The key is derived from the API token (HMAC under a fixed label) rather than kept as a
    # second secret in the data dir: rotating the token then ends every session at once, so a
    # session never outlives the credential it was opened with, and there is no other secret
    # to store, back up or leak. Forging a session needs the token, which opens everything
    # anyway; the label keeps the key apart from any other use of the token.
    key = hmac.new(api_token.encode(), b"decodebench login session v1", hashlib.sha256).digest()
    return TimestampSigner(key, salt="decodebench.session", digest_method=hashlib.sha256)


def new_session(request: Request) -> str:
    """A fresh login session cookie value: signed and timestamped, without the token."""
    return session_signer(request.app.state.api_token).sign(_SUBJECT).decode()


def session_state(request: Request) -> SessionState:
    """What the request's login cookie is worth; the age limit is checked here, not left to
    the browser."""
    value = request.cookies.get(COOKIE)
    if value is None:
        return "invalid" if LEGACY_COOKIE in request.cookies else "absent"
    try:
        subject = session_signer(request.app.state.api_token).unsign(value, max_age=SESSION_MAX_AGE_S)
    except SignatureExpired:
        return "expired"
    except BadSignature:
        return "invalid"
    return "valid" if hmac.compare_digest(subject, _SUBJECT) else "invalid"


def presented_token(request: Request) -> str | None:
    """The bearer token of a request, if it sent one."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token:
        return token.strip()
    return None


def is_admin(request: Request, token: str | None) -> bool:
    """True if ``token`` is the service's API token."""
    expected: str = request.app.state.api_token
    return token is not None and hmac.compare_digest(token.encode(), expected.encode())


def is_authenticated(request: Request) -> bool:
    """True if the request comes from the API token's holder: its bearer token, or, with
    no bearer token, a valid login session."""
    token = presented_token(request)
    if token is not None:
        return is_admin(request, token)
    return session_state(request) == "valid"


def require_worker(request: Request) -> Worker:
    """Connector calls: the active worker whose bearer token this is, or 401/403."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("a worker bearer token is required")
    worker = workers.worker_by_token(request.app.state.engine, token.strip())
    if worker is None:
        raise Unauthorized("unknown worker token")
    # A registered server that missed a probe is still the same server: its pulls go on.
    if worker.status not in ("starting", "ready", "unavailable"):
        raise Forbidden("this worker is no longer active")
    return worker


def require_admin(request: Request) -> None:
    """Mutating calls: the API token, as a bearer token or through a login session."""
    token = presented_token(request)
    if token is not None:
        # A bearer token is judged on its own, whatever cookie comes with it.
        if is_admin(request, token):
            return
        if workers.worker_by_token(request.app.state.engine, token) is not None:
            raise Forbidden("a worker token may only call the connector endpoints")
        raise Unauthorized("wrong API token")
    state = session_state(request)
    if state == "valid":
        return
    if state == "absent":
        raise Unauthorized("this call needs the API token: Authorization: Bearer <token>")
    raise Unauthorized(_SESSION_REFUSED[state])


def require_reader(request: Request) -> None:
    """Reads: open with DECODEBENCH_PUBLIC_READ, else like mutating calls."""
    if request.app.state.settings.public_read:
        return
    require_admin(request)


def require_page_reader(request: Request) -> None:
    """Pages: like reads, but a browser without valid credentials goes to the login page."""
    if request.app.state.settings.public_read or is_authenticated(request):
        return
    raise LoginRequired("log in first")
