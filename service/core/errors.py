"""The service's errors, each with the HTTP status it maps to.

Raised by any package (the store, the fleet, the comparisons) for what a client asked
that cannot be done; ``service.web.errors`` turns them into the one error answer.
"""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """Base of errors that reach a client; ``status`` is the HTTP status."""

    status = 400

    def __init__(self, detail: Any) -> None:
        super().__init__(detail)
        self.detail = detail


class NotFound(ServiceError):
    """The thing asked for does not exist."""

    status = 404


class Conflict(ServiceError):
    """The request conflicts with the current state (e.g. cancel of a finished run)."""

    status = 409


class Invalid(ServiceError):
    """Well-formed but unacceptable input."""

    status = 422


class Unauthorized(ServiceError):
    """Missing or wrong credentials."""

    status = 401


class Forbidden(ServiceError):
    """Valid credentials that may not do this."""

    status = 403


class LoginRequired(ServiceError):
    """A page asked for without credentials: the browser is sent to the login page."""

    status = 303


# What an error echoes of a value the client sent is cut to this many characters.
ECHO_CHARS = 200


def shown(value: Any) -> str:
    """``repr(value)`` cut to ``ECHO_CHARS``: an error names what was asked for without
    echoing a client's whole input back (a path id is as long as the request line)."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "..."
