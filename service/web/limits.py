"""Request bodies: the size limit, held however the body arrives, and UTF-8 for JSON.

A ``Content-Length`` over the limit is refused before any of the body is read. A body
without one (``Transfer-Encoding: chunked``) or with a false one is read chunk by
chunk and refused as soon as the bytes read pass the limit: the service never holds
more than the limit plus one chunk, whatever the client sends. A body under the
limit is handed to the app unchanged, unless it is sent as JSON and is not UTF-8
(RFC 8259): Python's parser would guess UTF-16 or UTF-32 from the bytes, and what the
service stores must read the same to every other client.

This is plain ASGI rather than an ``@app.middleware("http")`` function: that form
lets the route read the body itself, so a limit there could only look at the header.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from service.web.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 1 << 20
# Paths whose bodies may be larger: an imported result file holds every request's gaps.
LARGER_BODIES = {"/api/imports": 64 << 20}


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes (``larger``: per path) with a 413 (see the
    module docstring)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES,
                 larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.default = limit
        self.larger = LARGER_BODIES if larger is None else larger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.larger.get(scope.get("path", ""), self.default)
        declared = _content_length(scope)
        if declared is not None and declared < 0:
            await _answer(send, 400, "Content-Length is not a number")
            return
        if declared is not None and declared > limit:
            await _answer(send, 413, f"request body over the limit of {limit} bytes "
                                     f"(Content-Length: {declared})")
            return
        # Read the whole body here, up to the limit: the app then gets it in one piece.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away; nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _answer(send, 413, f"request body over the limit of {limit} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = _not_utf8_json(scope, body)
        if problem is not None:
            await _answer(send, 400, problem)
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            # After the body, the app only ever waits for the client to go away.
            return await receive()

        await self.app(scope, replay, send)


async def _answer(send: Send, status: int, detail: str) -> None:
    """An error answer in the API's error format, closing the connection."""
    payload = json.dumps(error_body(detail)).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            # The rest of the body is never read: the connection cannot be reused.
            (b"connection", b"close"),
        ],
    })
    await send({"type": "http.response.body", "body": payload})


def _not_utf8_json(scope: Scope, body: bytes) -> str | None:
    """Why a JSON body is not UTF-8, or None (also for bodies that are not JSON)."""
    media = _header(scope, b"content-type").split(";", 1)[0].strip().lower()
    if not body or not (media == "application/json" or media.endswith("+json")):
        return None
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"a JSON body must be UTF-8: byte {exc.start} is not ({exc.reason})"
    if b"\x00" in body:
        # Valid UTF-8, but never in JSON text; UTF-16 and UTF-32 bodies have them.
        return f"a JSON body must be UTF-8: byte {body.index(0)} is a NUL (UTF-16 or UTF-32?)"
    return None


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def _content_length(scope: Scope) -> int | None:
    """The declared length; -1 when the header is there but is not a number."""
    if not any(key == b"content-length" for key, _ in scope.get("headers", [])):
        return None
    text = _header(scope, b"content-length").strip()
    if not text.isdigit():
        return -1
    return int(text) if len(text) <= 18 else 1 << 62  # int() refuses over 4300 digits
