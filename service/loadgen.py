"""The load generator: streaming completions with exact prompt lengths, like ``vllm bench serve``.

Prompts are token ids, so the server sees exactly ``input_len`` tokens. Every
request is tagged with its run id for the connector and salted with it so no run
reuses prefix-cache blocks another run filled. Timing follows vLLM's client: the
clock starts after the concurrency slot is taken, just before the POST; TTFT is
the first streamed chunk with choices, ITL the gaps between later ones, latency
ends at the last such chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import numpy as np

from service.metrics import Sample
from service.models import RunSpec
from service.tinymodel import FIRST_ORDINARY_ID

# Without a known vocabulary, draw ids below this bound: every current LLM vocabulary is larger.
DEFAULT_VOCAB_BOUND = 32_000


@dataclass
class Plan:
    """What to send: prompts, output lengths and arrival offsets (s) of measured requests."""

    prompts: list[list[int]]
    output_lens: list[int]
    offsets: list[float]
    warmup_prompts: list[list[int]]
    warmup_output_lens: list[int]


def _lengths(rng: np.random.Generator, center: int, ratio: float, n: int) -> list[int]:
    low = max(1, math.floor(center * (1 - ratio)))
    high = max(low, math.floor(center * (1 + ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def make_plan(spec: RunSpec, vocab_size: int | None) -> Plan:
    """Build the seeded request schedule for ``spec``; the same seed gives the same plan."""
    rng = np.random.default_rng(spec.seed)
    high = vocab_size if vocab_size is not None else DEFAULT_VOCAB_BOUND
    total = spec.warmup_prompts + spec.num_prompts
    input_lens = _lengths(rng, spec.input_len, spec.range_ratio, total)
    output_lens = _lengths(rng, spec.output_len, spec.range_ratio, total)
    prompts = [rng.integers(FIRST_ORDINARY_ID, high, size=n).tolist() for n in input_lens]
    if spec.request_rate is None:
        offsets = [0.0] * spec.num_prompts
    else:
        # Gamma gaps with mean 1/rate; shape = burstiness (1.0 is Poisson).
        scale = 1.0 / (spec.request_rate * spec.burstiness)
        gaps = rng.gamma(spec.burstiness, scale, size=spec.num_prompts)
        offsets = [0.0, *np.cumsum(gaps[:-1]).tolist()]
    w = spec.warmup_prompts
    return Plan(
        prompts=prompts[w:],
        output_lens=output_lens[w:],
        offsets=offsets,
        warmup_prompts=prompts[:w],
        warmup_output_lens=output_lens[:w],
    )


class LoadGenerator:
    """Drives one run's requests against one OpenAI-compatible server.

    aiohttp, not httpx: on a 2-core machine httpx's per-chunk overhead made the
    client, not the server, the limit at a few hundred streams
    (``benchmarks/loadgen.py``).
    """

    def __init__(
        self,
        base_url: str,
        served_model: str,
        run_id: str,
        max_concurrency: int | None,
        request_timeout_s: float,
    ) -> None:
        self.url = f"{base_url}/v1/completions"
        self.served_model = served_model
        self.run_id = run_id
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The HTTP session, made on first use (it must be made inside the event loop)."""
        if self._session is None:
            limit = self.max_concurrency or 0  # 0: no limit
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit),
                # A stream that sends nothing for this long has hung.
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=30, sock_read=self.request_timeout_s
                ),
            )
        return self._session

    async def aclose(self) -> None:
        """Close the HTTP session (and with it any open streams)."""
        if self._session is not None:
            await self._session.close()

    def _payload(self, prompt: list[int], output_len: int) -> dict[str, object]:
        return {
            "model": self.served_model,
            "prompt": prompt,
            "max_tokens": output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": self.run_id,
            "kv_transfer_params": {"decodebench_run_id": self.run_id},
        }

    async def send(self, index: int, prompt: list[int], output_len: int, due: float | None) -> Sample:
        """Send one streaming request and measure it."""
        sample = Sample(
            index=index,
            prompt_len=len(prompt),
            output_tokens=0,
            ttft=0.0,
            itl=[],
            latency=0.0,
            start_time=0.0,
            success=False,
            due_time=due,
        )
        text: list[str] = []
        start = time.perf_counter()
        sample.start_time = start
        sample.sent_time = start
        last = start
        got_first = False
        buffer = b""
        try:
            async with self.session.post(self.url, json=self._payload(prompt, output_len)) as response:
                if response.status != 200:
                    body = (await response.read()).decode("utf-8", errors="replace")
                    sample.error = f"HTTP {response.status}: {body[:500]}"
                    return sample
                async for data in response.content.iter_any():
                    now = time.perf_counter()
                    buffer += data
                    # Server-sent events end with a blank line; keep a partial one for later.
                    *events, buffer = buffer.split(b"\n\n")
                    for event in events:
                        event = event.strip()
                        if not event.startswith(b"data:"):
                            continue
                        payload = event[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        chunk = json.loads(payload)
                        choices = chunk.get("choices")
                        if choices:
                            if not got_first:
                                got_first = True
                                sample.ttft = now - start
                            else:
                                sample.itl.append(now - last)
                            last = now
                            text.append(choices[0].get("text") or "")
                        elif usage := chunk.get("usage"):
                            sample.output_tokens = int(usage.get("completion_tokens") or 0)
                            if usage.get("prompt_tokens") is not None:
                                sample.prompt_len = int(usage["prompt_tokens"])
            sample.latency = last - start
            sample.generated_text = "".join(text)
            if got_first:
                sample.success = True
            else:
                sample.error = "no chunk with tokens was received"
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
            sample.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return sample

    async def _run_all(
        self,
        prompts: list[list[int]],
        output_lens: list[int],
        offsets: list[float] | None,
        on_done: Callable[[Sample], None] | None,
    ) -> float:
        slots = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        # Make the session (and its TLS context) before the clock starts, as vLLM's client does.
        assert not self.session.closed
        start = time.perf_counter()

        async def one(i: int) -> None:
            due = start + offsets[i] if offsets is not None else start
            if slots is None:
                sample = await self.send(i, prompts[i], output_lens[i], due)
            else:
                async with slots:
                    sample = await self.send(i, prompts[i], output_lens[i], due)
            if on_done is not None:
                on_done(sample)

        tasks: list[asyncio.Task[None]] = []
        try:
            for i in range(len(prompts)):
                if offsets is not None:
                    delay = start + offsets[i] - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return time.perf_counter() - start

    async def warmup(self, plan: Plan) -> None:
        """Send the warmup requests; their samples are dropped."""
        if plan.warmup_prompts:
            await self._run_all(plan.warmup_prompts, plan.warmup_output_lens, None, None)

    async def measure(self, plan: Plan, on_done: Callable[[Sample], None]) -> float:
        """Send the measured requests on their schedule; return the duration (s)."""
        return await self._run_all(plan.prompts, plan.output_lens, plan.offsets, on_done)
