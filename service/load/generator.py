"""The load generator: streaming completions with exact prompt lengths, like ``vllm bench serve``.

Prompts are token ids, so the server sees exactly ``input_len`` tokens. Every
request is tagged with its run id for the connector and salted with it so no run
reuses prefix-cache blocks another run filled (a seeded run's requests are salted with
their seed set instead, which later runs of the same point share). Timing follows vLLM's client: the
clock starts after the concurrency slot is taken, just before the POST; TTFT is
the first streamed chunk with choices, ITL the gaps between later ones, latency
ends at the last such chunk.

What it sends is a ``Plan`` (``service.load.plan``): lengths and arrival offsets, each
prompt drawn as its request is sent, and a long one streamed to the server block by block
(chunked transfer encoding), so no whole prompt is ever held, as Python ints or as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np

from service.core.sample import Sample
from service.load.plan import PROMPT_BLOCK, Plan

if TYPE_CHECKING:
    pass

def _sent_time_trace() -> aiohttp.TraceConfig:
    """Stamps ``Sample.sent_time`` as each piece of a request is written: the last stamp
    is when the request's last byte left, after its concurrency slot, its connection and
    the encoding of its body (``start_time`` is taken before all three, as vLLM's client
    takes it)."""

    async def written(_session: aiohttp.ClientSession, context: Any, _params: Any) -> None:
        sample = (context.trace_request_ctx or {}).get("sample")
        if sample is not None:
            sample.sent_time = time.perf_counter()

    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(written)
    trace.on_request_chunk_sent.append(written)
    return trace


class LoadGenerator:
    """Drives requests of one run against one OpenAI-compatible server.

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
        cache_salt: str | None = None,
        seeding: bool = False,
    ) -> None:
        self.url = f"{base_url}/v1/completions"
        self.served_model = served_model
        self.run_id = run_id
        self.cache_salt = cache_salt or run_id
        # The run's tag for the connector; a seeded run's seeding pass says so, so that the
        # connector counts its requests apart from the measured ones.
        self.tag: dict[str, str | bool] = {"decodebench_run_id": run_id}
        if seeding:
            self.tag["decodebench_seeding"] = True
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None
        # Set by ``stop_sending`` (a stop rule was met): no request is sent after it;
        # requests already sent are awaited and measured.
        self._stop: asyncio.Event | None = None
        self.sent = 0
        # Progress, for hang detection (``service.control.runner``): when each open stream
        # started, oldest first (``time.perf_counter``), and when any stream last got bytes.
        self._open_since: dict[int, float] = {}
        self._streams = itertools.count()
        self.last_data = time.perf_counter()

    @property
    def open(self) -> int:
        """How many streams are open now."""
        return len(self._open_since)

    @property
    def oldest_open(self) -> float | None:
        """When the oldest stream open now started (None: none is open)."""
        return next(iter(self._open_since.values()), None)

    @property
    def stopping(self) -> asyncio.Event:
        """Set once no more requests may be sent (made inside the event loop)."""
        if self._stop is None:
            self._stop = asyncio.Event()
        return self._stop

    def stop_sending(self) -> None:
        """Send no more measured requests; the ones already sent finish and count."""
        self.stopping.set()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The HTTP session, made on first use (it must be made inside the event loop)."""
        if self._session is None:
            limit = self.max_concurrency or 0  # 0: no limit
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit),
                trace_configs=[_sent_time_trace()],
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

    def _body(self, plan: Plan, position: int) -> bytes | AsyncIterator[bytes]:
        """The request's JSON body: whole when the prompt fits one block, else a stream."""
        rest = json.dumps({
            "model": self.served_model,
            "max_tokens": int(plan.output_lens[position]),
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": self.cache_salt,
            "kv_transfer_params": self.tag,
        }).encode()
        blocks = plan.prompt_blocks(position)

        def encode(block: np.ndarray) -> bytes:
            return ",".join(map(str, block.tolist())).encode()

        if int(plan.input_lens[position]) <= PROMPT_BLOCK:
            return b'{"prompt":[' + encode(next(blocks)) + b"]," + rest[1:]

        async def stream() -> AsyncIterator[bytes]:
            yield b'{"prompt":['
            for i, block in enumerate(blocks):
                yield (b"," if i else b"") + encode(block)
                await asyncio.sleep(0)  # let other streams' tokens be timed between blocks
            yield b"]," + rest[1:]

        return stream()

    async def send(self, plan: Plan, position: int, due: float | None) -> Sample:
        """Send the request at ``position`` of ``plan`` and measure it; the sample's index
        counts measured requests from 0."""
        sample = Sample(
            index=position - plan.warmups,
            prompt_len=int(plan.input_lens[position]),
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
        last = start
        got_first = False
        buffer = b""
        # Streams start in time order, so the dict's first entry is the oldest open one.
        stream = next(self._streams)
        self._open_since[stream] = start
        try:
            async with self.session.post(
                self.url, data=self._body(plan, position), headers={"Content-Type": "application/json"},
                trace_request_ctx={"sample": sample},
            ) as response:
                if response.status != 200:
                    body = (await response.read()).decode("utf-8", errors="replace")
                    sample.error = f"HTTP {response.status}: {body[:500]}"
                    return sample
                async for data in response.content.iter_any():
                    now = self.last_data = time.perf_counter()
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
        finally:
            del self._open_since[stream]
        return sample

    async def _run_all(
        self,
        plan: Plan,
        positions: Sequence[int],
        start: float | None,
        on_done: Callable[[Sample], None] | None,
    ) -> float:
        slots = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        # Make the session (and its TLS context) before the clock starts, as vLLM's client does.
        assert not self.session.closed
        if start is None:
            start = time.perf_counter()
        elif (delay := start - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        measured = on_done is not None
        stopping = self.stopping

        async def one(position: int, due: float) -> None:
            try:
                sample = await self.send(plan, position, due if measured else None)
            finally:
                if slots is not None:
                    slots.release()
            if on_done is not None:
                on_done(sample)

        # The dispatcher takes a request's slot before making its task (the order is the
        # one a semaphore inside each task gives, vLLM's way), so a run of 100,000 requests
        # at concurrency 8 has 8 tasks, not 100,000 waiting ones, and stopping is at once.
        tasks: set[asyncio.Task[None]] = set()
        failures: list[BaseException] = []

        def finished(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())  # type: ignore[arg-type]

        async def wait_for_stop(seconds: float) -> None:
            # A sleep that ends early when a stop rule is met.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), seconds)

        try:
            for position in positions:
                due = start
                if measured:
                    due += float(plan.offsets[position - plan.warmups])
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await wait_for_stop(delay)
                    if stopping.is_set():
                        break
                if slots is not None:
                    await slots.acquire()
                    if measured and stopping.is_set():
                        slots.release()
                        break
                if measured:
                    self.sent += 1
                task = asyncio.create_task(one(position, due))
                tasks.add(task)
                task.add_done_callback(finished)
                if failures:
                    raise failures[0]
            while tasks:
                await asyncio.gather(*tasks)
            if failures:
                raise failures[0]
        except BaseException:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return time.perf_counter() - start

    async def warmup(self, plan: Plan, positions: Sequence[int] | None = None) -> None:
        """Send the warmup requests (all, or those at ``positions``); their samples are dropped."""
        if positions is None:
            positions = range(plan.warmups)
        if positions:
            await self._run_all(plan, positions, None, None)

    async def measure(
        self,
        plan: Plan,
        on_done: Callable[[Sample], None],
        positions: Sequence[int] | None = None,
        start: float | None = None,
    ) -> float:
        """Send the measured requests (all, or those at ``positions``) on their schedule,
        which begins at ``start`` (``time.perf_counter``; now by default); return the
        time from the schedule's start to the last response's end (s)."""
        if positions is None:
            positions = range(plan.warmups, len(plan.input_lens))
        return await self._run_all(plan, positions, start, on_done)
