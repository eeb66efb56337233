"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` in tests.

Same command line (unknown flags are accepted and ignored), answers ``/health``,
``/v1/models`` and streaming ``/v1/completions`` with one token every
``STUB_TOKEN_INTERVAL_S`` seconds. It exists where process control is the point;
the real vLLM server is used where the connector and the metrics are.

Faults, by environment: ``STUB_STARTUP_DELAY_S`` (seconds before /health answers;
``inf`` never), ``STUB_EXIT_AT_START`` (exit code, before serving),
``STUB_CRASH_AFTER`` (the process dies in the middle of that request's stream),
``STUB_HANG_AFTER_TOKENS`` (streams stop after that many tokens, /health hangs too),
``STUB_IGNORE_SIGTERM`` (only SIGKILL stops it), ``STUB_GRANDCHILD`` (spawns a
long-lived grandchild in its process group; its pid goes to /stub/requests),
``STUB_BUNCHED`` (each stream is made at the usual pace but sent in one write at its
end, as a starved client or a buffering proxy would see it). ``/stub/requests``
also shows the process's pid and the vLLM CPU binding variables it was started with.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def build_app(served_name: str, interval: float, startup_delay: float) -> FastAPI:
    """The stub's app."""
    app = FastAPI()
    started = time.monotonic()
    state: dict[str, Any] = {"requests": 0, "open": 0, "hung": False, "grandchild": None,
                             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                             "pid": os.getpid(),
                             "cpu_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}}
    bunched = bool(os.environ.get("STUB_BUNCHED"))
    crash_after = int(os.environ.get("STUB_CRASH_AFTER", "0"))
    hang_after = int(os.environ.get("STUB_HANG_AFTER_TOKENS", "0"))
    if os.environ.get("STUB_GRANDCHILD"):
        state["grandchild"] = subprocess.Popen(["sleep", "3600"]).pid

    @app.get("/health")
    async def health() -> JSONResponse:
        if state["hung"]:
            await asyncio.sleep(3600)
        if time.monotonic() - started < startup_delay:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_name, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        blocks = os.environ.get("STUB_KV_BLOCKS", "100000")
        return PlainTextResponse(
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{blocks}"}} 1.0\n'
        )

    @app.get("/stub/requests")
    async def seen() -> dict[str, Any]:
        return state

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        state["requests"] += 1
        prompt = body.get("prompt")
        n_out = int(body.get("max_tokens") or 16)
        n_in = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())

        number = state["requests"]

        async def stream() -> AsyncIterator[bytes]:
            state["open"] += 1
            held: list[bytes] = []
            try:
                for i in range(n_out):
                    if crash_after and number >= crash_after and i == n_out // 2:
                        print("stub: crashing mid-stream as told", flush=True)
                        os._exit(17)
                    if hang_after and i >= hang_after:
                        state["hung"] = True
                        print("stub: hanging as told", flush=True)
                        await asyncio.sleep(3600)
                    await asyncio.sleep(interval)
                    chunk = {"id": "cmpl-stub", "object": "text_completion",
                             "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                    event = f"data: {json.dumps(chunk)}\n\n".encode()
                    if bunched:
                        held.append(event)
                    else:
                        yield event
                if held:
                    yield b"".join(held)
                usage = {"prompt_tokens": n_in, "completion_tokens": n_out,
                         "total_tokens": n_in + n_out}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                state["open"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main() -> None:
    """Parse vLLM's flags that matter here and serve."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="stub")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args, _unknown = parser.parse_known_args()
    if os.environ.get("STUB_IGNORE_SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_code = os.environ.get("STUB_EXIT_AT_START")
    if exit_code:
        print("stub: exiting at start as told", flush=True)
        sys.exit(int(exit_code))
    app = build_app(
        args.served_model_name or args.model,
        float(os.environ.get("STUB_TOKEN_INTERVAL_S", "0.002")),
        float(os.environ.get("STUB_STARTUP_DELAY_S", "0")),
    )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    server = _KeepSignals(config) if os.environ.get("STUB_IGNORE_SIGTERM") else uvicorn.Server(config)
    server.run()


class _KeepSignals(uvicorn.Server):
    """A server that leaves signal handling alone (so an ignored SIGTERM stays ignored)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


if __name__ == "__main__":
    main()
