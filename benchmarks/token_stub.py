"""A minimal OpenAI-style streaming server that emits one token every ``--interval`` seconds.

Raw asyncio (uvloop when installed), no framework, so that at hundreds of streams
the server adds as little as possible of its own delay: each stream's tokens are
due at absolute times start + k * interval, never drifting.

Given the ``--kv-transfer-config`` a registration answers, it stands in for the
connector too, as the service requires of every server: it pulls each tagged run's
mode once and reports the counters (filled or prefilled requests) of the runs that
changed shortly after requests end, off the streams' path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.parse
import urllib.request
from typing import Any

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop ships with vLLM
    uvloop = None  # type: ignore[assignment]


class Account:
    """The connector's side of a run: its mode from the service, its counters back."""

    def __init__(self, kv_transfer_config: str | None) -> None:
        extra = json.loads(kv_transfer_config or "{}").get("kv_connector_extra_config", {})
        self.url = extra.get("control_url")
        self.headers = {"Authorization": f"Bearer {extra.get('worker_token', '')}",
                        "Content-Type": "application/json"}
        self.modes: dict[str, asyncio.Future[str]] = {}
        self.counts: dict[str, dict[str, int]] = {}
        # Runs whose counters changed since the last report: only those are sent, as the
        # connector does (``connector/report.py``).
        self.dirty: set[str] = set()
        self.sending: asyncio.Task[None] | None = None

    def _call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=self.headers)
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    async def admitted(self, run_id: str) -> None:
        if self.url is None:
            return
        mode = self.modes.get(run_id)
        if mode is None:
            mode = self.modes[run_id] = asyncio.get_running_loop().create_future()
            query = urllib.parse.urlencode({"run_id": run_id})
            try:
                answer = await asyncio.to_thread(self._call, f"/api/connector/fill?{query}")
                if not isinstance(answer, dict) or "mode" not in answer:
                    raise OSError(f"the fill pull answered {answer!r}")
            except Exception as exc:
                # Requests waiting on this pull fail with it; the next one asks again.
                del self.modes[run_id]
                mode.set_exception(OSError(f"the fill pull failed: {exc!r}"))
                mode.exception()
                raise OSError(f"the fill pull failed: {exc!r}") from exc
            mode.set_result(answer["mode"])
        key = "filled_requests" if await mode == "fill" else "prefill_requests"
        counts = self.counts.setdefault(run_id, {"requests_seen": 0, key: 0})
        counts["requests_seen"] += 1
        counts[key] += 1
        self.dirty.add(run_id)

    def finished(self) -> None:
        if self.url is not None and self.sending is None:
            self.sending = asyncio.create_task(self._send_soon())

    async def _send_soon(self) -> None:
        await asyncio.sleep(0.2)
        self.sending = None
        runs = {run: dict(self.counts[run]) for run in self.dirty}
        self.dirty.clear()
        filled = {run: {"requests_filled": c.get("filled_requests", 0)} for run, c in runs.items()}
        try:
            for role, counters in (("scheduler", runs), ("worker", filled)):
                await asyncio.to_thread(self._call, "/api/connector/report",
                                        {"role": role, "rank": 0, "runs": counters})
        except Exception:
            self.dirty.update(runs)  # sent again with the next report
            raise


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
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, interval: float, served: bytes,
    account: Account,
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
            params = body.get("kv_transfer_params") or {}
            run_id = params.get("decodebench_run_id") if isinstance(params, dict) else None
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
            if run_id:
                try:
                    await account.admitted(run_id)
                except OSError as exc:  # the service did not answer the pull: say so, keep the line
                    print(f"token_stub: fill pull for {run_id} failed: {exc!r}", file=sys.stderr, flush=True)
                    answer = b'{"error": "the fill pull failed"}'
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(answer), answer))
                    await writer.drain()
                    continue
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
            if run_id:
                account.finished()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _serve(port: int, interval: float, served: str, kv_transfer_config: str | None) -> None:
    account = Account(kv_transfer_config)
    server = await asyncio.start_server(
        lambda r, w: _handle(r, w, interval, served.encode(), account),
        "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    """Serve until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--served-model-name", default="stub")
    parser.add_argument("--kv-transfer-config", default=None)
    args = parser.parse_args()
    if uvloop is not None:
        uvloop.install()
    asyncio.run(_serve(args.port, args.interval, args.served_model_name, args.kv_transfer_config))


if __name__ == "__main__":
    main()
