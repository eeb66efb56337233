"""A minimal OpenAI-style streaming server that emits one token every ``--interval`` seconds.

Raw asyncio (uvloop when installed), no framework, so that at hundreds of streams
the server adds as little as possible of its own delay: each stream's tokens are
due at absolute times start + k * interval, never drifting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop ships with vLLM
    uvloop = None  # type: ignore[assignment]


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A request body sent with ``Transfer-Encoding: chunked``."""
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


async def _handle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, interval: float, served: bytes
) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            chunked = False
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
                elif line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                    chunked = True
            raw = await _read_chunked(reader) if chunked else await reader.readexactly(length)
            body = json.loads(raw) if raw else {}
            # Keep only what the answer needs: a long prompt is not held while streaming.
            prompt_tokens = len(body.get("prompt", []))
            max_tokens = int(body.get("max_tokens", 16))
            del body, raw
            if not head.startswith(b"POST"):
                # /v1/models names the served model (a registered worker's probe checks it).
                answer = b"{}"
                if head.startswith(b"GET /v1/models"):
                    answer = b'{"data":[{"id":"%s"}]}' % served
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
                continue
            n = max_tokens
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            event = b'data: {"choices":[{"index":0,"text":" x","finish_reason":null}]}\n\n'
            start = time.perf_counter()
            for k in range(n):
                delay = start + (k + 1) * interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            usage = json.dumps({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                         "completion_tokens": n}})
            tail = f"data: {usage}\n\ndata: [DONE]\n\n".encode()
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _serve(port: int, interval: float, served: str) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, interval, served.encode()),
                                        "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    """Serve until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--served-model-name", default="stub")
    args = parser.parse_args()
    if uvloop is not None:
        uvloop.install()
    asyncio.run(_serve(args.port, args.interval, args.served_model_name))


if __name__ == "__main__":
    main()
