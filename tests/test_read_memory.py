"""Reading a large run costs bounded memory: every route that shows, exports or compares
samples reads them in slices, or only the columns it draws, never every sample with its
generated text at once.

The service's side is measured with tracemalloc inside this process, the app driven over
ASGI directly with a sink that counts the body's bytes and keeps none of them (a test
client would hold the whole body, which is the client's memory, not the service's).
"""

from __future__ import annotations

import asyncio
import tracemalloc
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI

from service.analysis import comparison
from service.analysis.metrics import summarize
from service.app import create_app
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.core.status import RunStatus
from service.core.sweep import SweepCreate
from service.settings import Settings
from service.storage import measurements, store, sweeps
from service.storage.db import make_engine
from tests.conftest import make_settings

REQUESTS = 4000
OUTPUT_TOKENS = 512
# What one route may add to the service's memory while it answers: the routes that read
# samples take them a slice at a time (each held well under this before: 125-205 MB).
LIMIT_MB = 100
# A comparison's interval over requests pools every gap of both runs (2 x 2 million here):
# ``intervals.PooledValues`` keeps them sorted with their request's number (12 bytes a
# gap), plus a sort's temporaries while it is made. Before, every sample with its text
# was held as well: 458 MB.
COMPARE_LIMIT_MB = 150
WORDS = ("the", "model", "decode", "token", "cache", "block", "fill", "value", "server", "request",
         "latency", "context", "long", "prefix", "batch", "engine", "a", "of", "and", "to")


def _samples(rng: np.random.Generator, start: int, count: int) -> list[Sample]:
    gaps = rng.uniform(0.008, 0.03, (count, OUTPUT_TOKENS - 1))
    ttfts = rng.uniform(0.2, 0.6, count)
    words = np.array(WORDS)[rng.integers(0, len(WORDS), (count, OUTPUT_TOKENS))]
    out = []
    for j, i in enumerate(range(start, start + count)):
        begin = i * 0.05
        ttft = float(ttfts[j])
        out.append(Sample(index=i, prompt_len=32768, output_tokens=OUTPUT_TOKENS, ttft=ttft,
                          itl=gaps[j].tolist(), latency=ttft + float(gaps[j].sum()), start_time=begin,
                          success=True, due_time=begin, sent_time=begin, generated_text=" ".join(words[j])))
    return out


@dataclass
class BigSweep:
    settings: Settings
    sweep: str
    fill: str
    prefill: str


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> BigSweep:
    """A sweep over mode (fill against real prefill), each run 4,000 requests x 512 output
    tokens with their generated texts, stored through the store as a finished run would be."""
    settings = make_settings(tmp_path_factory.mktemp("big"), public_read=True)
    engine = make_engine(settings.db_path)
    base = RunSpec(num_prompts=REQUESTS, output_len=OUTPUT_TOKENS, input_len=32768, max_concurrency=32)
    sweep = sweeps.create_sweep(engine, SweepCreate(base=base, grid={"mode": ["fill", "prefill"]}))
    _, runs = sweeps.get_sweep(engine, sweep.id)
    rng = np.random.default_rng(0)
    for run in runs:
        store.transition(engine, run.id, RunStatus.starting)
        store.transition(engine, run.id, RunStatus.running)
        every: list[Sample] = []
        for start in range(0, REQUESTS, 500):
            batch = _samples(rng, start, 500)
            measurements.save_samples(engine, run.id, batch)
            every += [Sample(**{**s.__dict__, "generated_text": ""}) for s in batch]
        summary = summarize(every, duration=REQUESTS * 0.05)
        store.transition(engine, run.id, RunStatus.succeeded, summary=summary,
                         completed=REQUESTS, failed=0)
    engine.dispose()
    by_mode = {r.spec["mode"]: r.id for r in runs}
    return BigSweep(settings, sweep.id, by_mode["fill"], by_mode["prefill"])


async def _get(app: FastAPI, path: str) -> tuple[int, int]:
    """GET ``path`` from the app; its status and how many body bytes it sent (kept nowhere)."""
    route, _, query = path.partition("?")
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": route, "raw_path": route.encode(), "query_string": query.encode(),
        "root_path": "", "headers": [(b"host", b"testserver")], "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    status, sent = 0, 0
    done = asyncio.Event()
    asked = False

    async def receive() -> dict[str, Any]:
        # The request once, then nothing until the answer is complete (a streaming response
        # listens for the client leaving meanwhile).
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, sent
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            sent += len(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    return status, sent


def peak_mb(settings: Settings, path: str) -> tuple[int, int, float]:
    """Serve one GET of ``path`` from a fresh app: status, bytes sent, and the most memory
    the service held for it above what it held before (MB, tracemalloc)."""

    async def main() -> tuple[int, int, float]:
        # Comparisons of finished runs are cached process-wide: each route measures its own work.
        comparison._CACHE.clear()
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                status, sent = await _get(app, path)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        return status, sent, (peak - before) / 1e6

    return asyncio.run(main())


# Every gap of every request, at 9 characters or more each (``0.012345 `` in the CSV).
ALL_GAPS = REQUESTS * (OUTPUT_TOKENS - 1) * 9
# Each route that reads samples: its path (of the fill run, or the sweep), its bound, and
# the fewest bytes its answer has when it holds what it should.
ROUTES: dict[str, tuple[str, float, int]] = {
    "requests page": ("/api/runs/{fill}/requests", LIMIT_MB, 100 * OUTPUT_TOKENS * 9),
    "requests, largest page": ("/api/runs/{fill}/requests?limit=1000&offset=2000", LIMIT_MB,
                               1000 * OUTPUT_TOKENS * 9),
    "csv export": ("/api/runs/{fill}/export?format=csv", LIMIT_MB, ALL_GAPS),
    "vllm export": ("/api/runs/{fill}/export?format=vllm", LIMIT_MB, ALL_GAPS),
    "run page": ("/runs/{fill}", LIMIT_MB, 1),
    "sweep page": ("/sweeps/{sweep}", LIMIT_MB, 1),
    "sweep api": ("/api/sweeps/{sweep}", LIMIT_MB, 1),
    "compare page": ("/compare?ids={fill},{prefill}", COMPARE_LIMIT_MB, 1),
    "compare api": ("/api/compare?ids={fill},{prefill}", COMPARE_LIMIT_MB, 1),
}


@pytest.mark.parametrize("name", list(ROUTES))
def test_reading_a_large_run_holds_bounded_memory(big: BigSweep, name: str) -> None:
    template, limit, least = ROUTES[name]
    path = template.format(fill=big.fill, prefill=big.prefill, sweep=big.sweep)
    status, sent, peak = peak_mb(big.settings, path)
    print(f"{name}: {path} -> {status}, {sent / 1e6:.1f} MB sent, peak {peak:.1f} MB")
    assert status == 200
    assert sent >= least
    assert peak < limit, f"{name} held {peak:.0f} MB at its peak"
