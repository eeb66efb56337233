"""The watchdog's sign of progress on a real vLLM CPU server: its /metrics moves while a
long prompt is prefilled in chunks, before the first token (``service.control.watchdog``).

A plain server on the bundled tiny model, in steps of 64 tokens, so a prompt of 16,000 is
250 engine steps; the watchdog's own reader (``EngineProgress``) reads /metrics while the
stream is silent, as it does during a run.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from service.analysis.server_metrics import KV_USAGE, Scraper
from service.control.watchdog import EngineProgress
from service.core.tinymodel import TINY_MODEL_NAME, ensure_tiny_model
from tests.vllm_process import start_vllm, stop, wait_healthy

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = 16_000


async def _prefill_watched(url: str) -> tuple[float, list[float]]:
    """Send one long prompt; until its first token, read /metrics every 0.1 s. Its time to
    first token, and the KV cache usage at each read that saw /metrics move."""
    async with httpx.AsyncClient(timeout=300) as client:
        progress = EngineProgress(Scraper(client, url))
        moves: list[float] = []

        async def watch() -> None:
            while True:
                await asyncio.sleep(0.1)
                before = progress.moved_at
                await progress.look(time.monotonic(), 0.0)
                if progress.moved_at != before and progress.values is not None:
                    moves.append(progress.values[KV_USAGE])

        body = {"model": TINY_MODEL_NAME, "prompt": [5 + i * 7 % 4000 for i in range(PROMPT_TOKENS)],
                "max_tokens": 2, "ignore_eos": True, "stream": True}
        sent = time.monotonic()
        watching = asyncio.create_task(watch())
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        return time.monotonic() - sent, moves
        finally:
            watching.cancel()
    raise AssertionError("the stream ended without a token")


def test_a_real_chunked_prefill_moves_the_metrics_the_watchdog_reads(tmp_path: Path) -> None:
    model = ensure_tiny_model(tmp_path / "models")
    log = tmp_path / "vllm.log"
    proc, url = start_vllm(model, log, "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                           served_name=TINY_MODEL_NAME)
    try:
        wait_healthy(proc, url, log)
        ttft, moves = asyncio.run(_prefill_watched(url))
    finally:
        stop(proc)
    # Reads 0.1 s apart over the prefill: most see a step or more computed since the one
    # before, each with the KV cache fuller, though no token has come.
    assert ttft > 0.5, f"the prefill took {ttft:.2f} s: too fast to watch"
    assert len(moves) >= max(2, int(ttft / 0.1) // 3), (ttft, moves)
    assert moves == sorted(moves) and moves[0] < moves[-1], moves
