"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` in tests.

Same command line (unknown flags are accepted and ignored), answers ``/health``,
``/v1/models`` and streaming ``/v1/completions`` with one token every
``STUB_TOKEN_INTERVAL_S`` seconds. It exists where process control is the point;
the real vLLM server is used where the connector and the metrics are.

Faults, by environment: ``STUB_STARTUP_DELAY_S`` (seconds before /health answers;
``inf`` never), ``STUB_EXIT_AT_START`` (exit code, before serving),
``STUB_CRASH_AFTER`` (the process dies in the middle of that request's stream),
``STUB_HANG_AFTER_TOKENS`` (streams stop after that many tokens, and every stream after
that at once, a stuck engine; /health hangs too,
unless ``STUB_HANG_HEALTHY`` is set: then it answers, as a stuck engine's API server does),
``STUB_HANG_AT_REQUEST`` (that completion request, counted from 1, and every one after it
get no token at all: the same stuck engine, for requests of one output token),
``STUB_FIRST_TOKEN_S`` (each stream is silent this long before its first token, a prefill),
``STUB_REFUSE_REQUESTS`` (every completion is answered 400 with this message, as vLLM
refuses a request too long for its ``--max-model-len``),
``STUB_IGNORE_SIGTERM`` (only SIGKILL stops it), ``STUB_GRANDCHILD`` (spawns a
long-lived grandchild in its process group; its pid goes to /stub/requests),
``STUB_PRINT_LOG`` (a file whose text it prints first: a real vLLM log excerpt, a failure's),
``STUB_ENGINE`` (a child in its process group as vLLM's EngineCore is: ``alive`` stays,
``dead`` exits at once and is never reaped, a zombie under an API server that did not
notice), ``STUB_LISTEN_AFTER_S`` (seconds before it even binds its port; ``inf`` never),
``STUB_SILENT_PORT`` (its port is bound and nothing ever answers, as vLLM's while its
engine starts: vLLM binds it first),
``STUB_BUNCHED`` (each stream is made at the usual pace but sent in one write at its
end, as a starved client or a buffering proxy would see it), ``STUB_MAX_RUNNING``
(at most that many streams run at once; the others wait in the stub's queue,
``/metrics`` shows them waiting and, as vLLM's ``request_queue_time_seconds``, how
long they waited; ``--max-num-seqs`` does the same and reports the value in its engine
settings, as vLLM does), ``STUB_ITL_SLOPE_S`` (each token comes that many seconds later
per stream running: an inter-token time of ``STUB_TOKEN_INTERVAL_S + slope * running``,
which gives a capacity search a known boundary), ``STUB_PREFILL_S_PER_TOKEN`` (each
request's first token waits for a prefill of that many seconds per prompt token, one
prefill at a time: above 1 / (that x prompt tokens) requests/s they queue and TTFT grows,
a known prefill rate; a request of a fill run skips it, its prefill spared). A prefill is
computed in chunks of ``STUB_PREFILL_CHUNK`` tokens (2048 by default, vLLM's
``--max-num-batched-tokens`` on a CPU), one engine step each, and as vLLM 0.32's
``/metrics`` does, the stub's moves after every step before the first token: each chunk's
tokens raise ``kv_cache_usage_perc`` (freed when the request ends).
``STUB_PREFILL_STUCK_AFTER`` (chunks): the engine computes that many chunks of a prefill,
then sticks, a stuck engine mid-prefill: no more tokens for any stream, /health answers, and
``/metrics`` says what it said then for good (as for every hang of the stub).
``/stub/requests`` also shows the
process's pid, the vLLM CPU binding variables it was started with and its
``--max-model-len`` as given.

``/v1/models`` gives its ``max_model_len`` as vLLM resolves it: the flag's value; with
none, the model's own (its directory's ``config.json`` read as vLLM reads it, 8192 for a
model it cannot read); with ``-1``, the model's own if its KV cache (``STUB_KV_BLOCKS``
blocks of 16 tokens, less the one vLLM keeps back) holds one request that long, else the
longest it holds, logged as vLLM logs its auto-fit (and it exits, as vLLM does, when
the cache holds not one token).

Like a server with decodebench's connector, it pulls each tagged run's fill values
from the service named in ``--kv-transfer-config`` and reports the run's
counters back (a request of a ``fill`` run counts as filled, of a ``prefill`` run
as prefilled), after each request ends and off its path, as the connector's report
thread does (``Connector.soon``); ``STUB_NO_CONNECTOR`` turns that off, as a server that cannot reach
the service would be. A stub registered after its start gets the config its
registration answers through ``POST /stub/connector``. At its start (and when it is
given a config) it reports its provenance as the connector does (``connector.provenance``):
the engine settings as vLLM would resolve them from its flags, versions, hardware, its
command line (token hidden) and environment, and with ``STUB_ROOFLINE`` (JSON) the
model's sizes and bandwidth; ``STUB_NO_PROVENANCE`` leaves that out.
What it pulls and reports are the service's own protocol types (``service.core.protocol``),
from this checkout, so a change of the protocol shows here too.

``STUB_STEP_MS`` (JSON ``{"fixed": ms, "per_kv": ns, "per_req": ms, "noise": fraction}``, and
``"first"``, first steps' time as a multiple of a decode step's, 1 by default) makes it time
engine steps as the connector's worker side does: every ``STUB_TOKEN_INTERVAL_S`` while
streams run, one step from its real state (the streams decoding, each reading its prompt and
the tokens it sent so far; a stream's first step is ``first``; in a ``prefill`` run, a
prefill step of its prompt before), numbered upward, whose forward time is that truth times
(1 + noise x a normal draw). The worker report sends each run's new steps
(``ConnectorReport.steps``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

# Starlette, not FastAPI: the stub starts hundreds of times in the suite, and FastAPI's
# import (its OpenAPI models) is a third of a stub's start.
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

# Run as a script (``python tests/stub_vllm.py``): the checkout it belongs to comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.core.modelconfig import model_dir_max_len
from service.core.protocol import (
    ConnectorReport,
    FillAnswer,
    KVCacheGroup,
    RunCounters,
    WorkerProvenance,
)
from service.core.steps import MAX_REPORT_STEPS

BLOCK_SIZE = 16
# The length of a model whose config the stub cannot read.
STUB_MODEL_LEN = 8192


class Connector:
    """What the stub's "connector" knows: the service to ask, each run's mode and counters."""

    def __init__(self, kv_transfer_config: str | None, engine: dict[str, Any] | None = None) -> None:
        self.engine = engine or {}
        self.configure(json.loads(kv_transfer_config) if kv_transfer_config else {})
        self.modes: dict[str, str] = {}
        self.counters: dict[str, dict[str, int]] = {}
        self.lock = asyncio.Lock()
        self._http: httpx.AsyncClient | None = None
        # Engine steps timed per run since the last report (rows of ``STEP_FIELDS``), and
        # how many in all.
        self.steps: dict[str, list[list[float]]] = {}
        self.steps_timed: dict[str, int] = {}
        # The reports in flight (``soon``) and whether counters changed since one began.
        self._reporter: asyncio.Task[None] | None = None
        self._dirty = False

    def http(self) -> httpx.AsyncClient:
        """One client for the stub's life: a new httpx client builds a TLS context (its CA
        file read and parsed), which per report was most of a stub's CPU time."""
        if self._http is None:
            self._http = httpx.AsyncClient()
        return self._http

    def configure(self, kv_transfer_config: dict[str, Any]) -> None:
        """Take a ``--kv-transfer-config`` (a registered server's, given after its start)."""
        extra: dict[str, Any] = {}
        if not os.environ.get("STUB_NO_CONNECTOR"):
            extra = kv_transfer_config.get("kv_connector_extra_config", {})
        self.url = extra.get("control_url")
        self.token = str(extra.get("worker_token", ""))
        self.headers = {"Authorization": f"Bearer {self.token}"}

    def provenance(self) -> WorkerProvenance:
        """What the real connector reports of its server, for this stub."""
        argv = [sys.executable, *sys.argv]
        if self.token:
            argv = [a.replace(self.token, "<redacted>") for a in argv]
        env = {k: v for k, v in sorted(os.environ.items())
               if k.startswith("VLLM_") or k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
        return WorkerProvenance(
            versions={"vllm": "0.0.0-stub", "torch": None, "python": sys.version.split()[0]},
            engine=self.engine,
            kv_cache={"num_blocks": 100000, "block_size": BLOCK_SIZE, "tokens": 1_600_000},
            kv_cache_groups=[KVCacheGroup(index=0, kind="FullAttention", block_size=BLOCK_SIZE, layers=2,
                                          fill="per request")],
            hardware={"cpu_model": "Stub CPU", "cpu_cores": os.cpu_count(),
                      "cpu_cores_usable": len(os.sched_getaffinity(0)), "machine": "x86_64"},
            argv=argv,
            env=env,
            # STUB_ROOFLINE: the model and KV sizes and bandwidth, as JSON, reported as the
            # connector reports them (``RooflineFacts``).
            roofline=json.loads(os.environ["STUB_ROOFLINE"]) if os.environ.get("STUB_ROOFLINE") else None,
        )

    async def send_provenance(self) -> None:
        """Report the provenance once, as the connector's scheduler side does at its start."""
        if self.url is None or os.environ.get("STUB_NO_PROVENANCE"):
            return
        with contextlib.suppress(httpx.HTTPError):
            await self.http().post(f"{self.url}/api/connector/provenance", headers=self.headers,
                                   json=self.provenance().model_dump())

    async def admitted(self, run_id: str, seeding: bool = False) -> None:
        """Count one request of ``run_id`` (``seeding``: of its seeding pass, tagged so),
        pulling the run's mode the first time."""
        if self.url is None:
            return
        async with self.lock:  # one pull per run, however many requests arrive at once
            if run_id not in self.modes:
                answer = await self.http().get(f"{self.url}/api/connector/fill",
                                               params={"run_id": run_id}, headers=self.headers)
                self.modes[run_id] = (FillAnswer.model_validate(answer.json()).mode
                                      if answer.status_code == 200 else "unresolved")
        mode = self.modes[run_id]
        counts = self.counters.setdefault(run_id, {"requests_seen": 0})
        counts["requests_seen"] += 1
        key = {"fill": "filled_requests", "prefill": "prefill_requests",
               "seeded": "seeding_requests" if seeding else "prefill_requests"}.get(
                   mode, "unresolved_requests")
        counts[key] = counts.get(key, 0) + 1

    def soon(self) -> None:
        """Report shortly, off the request's path, as the connector's report thread does: a
        report the stream awaited held the request's place in the batch, and the client's
        view of its end, for as long as the service took to answer (on a busy machine the
        requests queued behind it waited that too: 63% of a latency queued where the batch
        alone makes 43%). One report at a time, in order; counters that change while one is
        in flight go in the next."""
        self._dirty = True
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._report_while_dirty())

    async def _report_while_dirty(self) -> None:
        while self._dirty:
            self._dirty = False
            try:
                await self.report()
            except httpx.HTTPError as e:  # the service gone or restarting: the next one tries again
                print(f"stub: a connector report failed: {e!r}", file=sys.stderr, flush=True)

    async def report(self) -> None:
        """Send both sides' cumulative counters, as the connector does after a request ends."""
        if self.url is None or not self.counters:
            return
        scheduler = ConnectorReport(role="scheduler", rank=0, runs={
            run: RunCounters(**c) for run, c in self.counters.items()})
        steps, self.steps = self.steps, {}
        # Steps beyond what one report may carry go in reports of their own.
        chunks: list[dict[str, list[list[float]]]] = []
        while any(steps.values()):
            chunks.append({run: rows[:MAX_REPORT_STEPS] for run, rows in steps.items() if rows})
            steps = {run: rows[MAX_REPORT_STEPS:] for run, rows in steps.items()}
        worker = ConnectorReport(role="worker", rank=0, runs={
            run: RunCounters(requests_filled=c.get("filled_requests", 0),
                             steps_timed=self.steps_timed.get(run))
            for run, c in self.counters.items()}, steps=chunks[0] if chunks else None)
        reports = [scheduler, worker, *(ConnectorReport(role="worker", rank=0, runs={}, steps=chunk)
                                        for chunk in chunks[1:])]
        for report in reports:
            await self.http().post(f"{self.url}/api/connector/report", headers=self.headers,
                                   json=report.model_dump(exclude_none=True))


def build_app(served_name: str, interval: float, startup_delay: float,
              kv_transfer_config: str | None = None, engine: dict[str, Any] | None = None,
              max_model_len_flag: int | None = None, max_num_seqs: int | None = None) -> Starlette:
    """The stub's app; ``max_model_len_flag``: its ``--max-model-len`` as given."""
    connector = Connector(kv_transfer_config, engine)

    # STUB_STEP_MS: the truth of the engine steps it times; the streams those steps read.
    step_truth = json.loads(os.environ["STUB_STEP_MS"]) if os.environ.get("STUB_STEP_MS") else None
    streams: dict[int, dict[str, Any]] = {}

    async def time_steps() -> None:
        """An engine step every token interval while streams run, from what they hold now."""
        assert step_truth is not None
        draw = random.Random(os.getpid())
        number = 0
        while True:
            await asyncio.sleep(max(interval, 0.002))
            held = list(streams.values())
            if not held:
                continue
            prefill = [s for s in held if s["prefill"]]
            decoding = [s for s in held if not s["prefill"]]
            kv = sum(s["n_in"] + s["tokens"] for s in decoding)
            first = sum(1 for s in decoding if s["first"])
            prefill_tokens = sum(s["n_in"] for s in prefill)
            ms = (step_truth["fixed"] + step_truth["per_kv"] * kv / 1e6
                  + step_truth["per_req"] * len(decoding))
            if prefill_tokens:
                ms += 0.001 * prefill_tokens
            elif first:
                ms *= step_truth.get("first", 1.0)
            ms *= max(0.05, 1 + step_truth.get("noise", 0.0) * draw.gauss(0.0, 1.0))
            row = [float(number), float(len(decoding)), float(prefill_tokens), float(kv), float(first), ms]
            for run in {s["run"] for s in held}:
                connector.steps.setdefault(run, []).append(row)
                connector.steps_timed[run] = connector.steps_timed.get(run, 0) + 1
            for s in held:
                s["first"] = s["prefill"]
                s["prefill"] = False
            number += 1

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await connector.send_provenance()
        ticker = asyncio.create_task(time_steps()) if step_truth is not None else None
        yield
        if ticker is not None:
            ticker.cancel()

    max_running = int(os.environ.get("STUB_MAX_RUNNING", "0"))
    if max_num_seqs:
        max_running = min(max_running, max_num_seqs) if max_running else max_num_seqs
    slope = float(os.environ.get("STUB_ITL_SLOPE_S", "0"))
    slots = asyncio.Semaphore(max_running) if max_running else None
    started = time.monotonic()
    state: dict[str, Any] = {"requests": 0, "open": 0, "waiting": 0, "hung": False,
                             "queue_time_sum": 0.0, "queue_time_count": 0,
                             # Seconds each prefill held the engine: the service times of its queue.
                             "prefill_s": [],
                             "grandchild": None,
                             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                             "max_model_len_flag": max_model_len_flag,
                             "pid": os.getpid(),
                             "cpu_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}}
    bunched = bool(os.environ.get("STUB_BUNCHED"))
    crash_after = int(os.environ.get("STUB_CRASH_AFTER", "0"))
    hang_after = int(os.environ.get("STUB_HANG_AFTER_TOKENS", "0"))
    hang_healthy = bool(os.environ.get("STUB_HANG_HEALTHY"))
    hang_at = int(os.environ.get("STUB_HANG_AT_REQUEST", "0"))
    first_token_s = float(os.environ.get("STUB_FIRST_TOKEN_S", "0"))
    prefill_s_per_token = float(os.environ.get("STUB_PREFILL_S_PER_TOKEN", "0"))
    prefill_chunk = int(os.environ.get("STUB_PREFILL_CHUNK", "2048"))
    stuck_after = int(os.environ.get("STUB_PREFILL_STUCK_AFTER", "0"))
    prefilling = asyncio.Lock()
    # Prompt tokens in the KV cache of the requests being served, and the chunks computed.
    state["kv_tokens"] = 0
    state["chunks"] = 0
    # What /metrics said when the stub hung: a stuck engine's stats move no more.
    frozen: list[str] = []
    refusal = os.environ.get("STUB_REFUSE_REQUESTS")
    if os.environ.get("STUB_GRANDCHILD"):
        state["grandchild"] = subprocess.Popen(["sleep", "3600"]).pid

    async def health(_: Request) -> JSONResponse:
        if state["hung"] and not hang_healthy:
            await asyncio.sleep(3600)
        if time.monotonic() - started < startup_delay:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({})

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": served_name, "object": "model",
                                                         "max_model_len": engine["max_model_len"]}]})

    def render() -> str:
        blocks = kv_blocks()
        labels = f'model_name="{served_name}",engine="0"'
        usage = 0.01 + state["kv_tokens"] / (blocks * BLOCK_SIZE)
        return (
            f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",num_gpu_blocks="{blocks}"}} 1.0\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {state['open'] - state['waiting']}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {state['waiting']}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage!r}\n"
            "# TYPE vllm:num_preemptions counter\n"
            f"vllm:num_preemptions_total{{{labels}}} 0.0\n"
            "# TYPE vllm:request_queue_time_seconds histogram\n"
            f"vllm:request_queue_time_seconds_sum{{{labels}}} {state['queue_time_sum']}\n"
            f"vllm:request_queue_time_seconds_count{{{labels}}} {state['queue_time_count']}\n"
        )

    async def metrics(_: Request) -> PlainTextResponse:
        return PlainTextResponse(frozen[0] if frozen else render())

    def hang() -> None:
        """The engine sticks: /metrics keeps what it says now."""
        if not state["hung"]:
            state["hung"] = True
            frozen.append(render())
            print("stub: hanging as told", flush=True)

    async def prefill(n_in: int, computed: list[int]) -> None:
        """Compute a prompt of ``n_in`` tokens in chunks, one step each, one prefill at a time
        (``computed[0]``: its tokens in the KV cache so far)."""
        async with prefilling:
            held = time.monotonic()
            while computed[0] < n_in:
                if state["hung"]:
                    await asyncio.sleep(3600)
                chunk = min(prefill_chunk, n_in - computed[0])
                await asyncio.sleep(prefill_s_per_token * chunk)
                computed[0] += chunk
                state["kv_tokens"] += chunk
                state["chunks"] += 1
                if stuck_after and state["chunks"] >= stuck_after:
                    hang()
            state["prefill_s"].append(time.monotonic() - held)

    async def connect(request: Request) -> JSONResponse:
        # A registered server learns its connector config after it started (a real one
        # would be restarted with it): the test hands it over here.
        connector.configure(await request.json())
        await connector.send_provenance()
        return JSONResponse({"control_url": connector.url})

    async def seen(_: Request) -> JSONResponse:
        return JSONResponse(state)

    async def completions(request: Request) -> Response:
        body = await request.json()
        state["requests"] += 1
        prompt = body.get("prompt")
        n_out = int(body.get("max_tokens") or 16)
        n_in = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())

        if refusal:  # as vLLM answers a request it cannot take
            return JSONResponse({"error": {"message": refusal, "type": "BadRequestError", "param": None,
                                           "code": 400}}, status_code=400)
        number = state["requests"]
        params = body.get("kv_transfer_params") or {}
        run_id = params.get("decodebench_run_id") if isinstance(params, dict) else None

        async def stream() -> AsyncIterator[bytes]:
            state["open"] += 1
            computed = [0]
            held: list[bytes] = []
            slot = None
            queued_at = time.monotonic()
            try:
                if slots is not None:
                    state["waiting"] += 1
                    try:
                        await slots.acquire()
                        slot = slots
                    finally:
                        state["waiting"] -= 1
                queued_s = time.monotonic() - queued_at
                if run_id:
                    await connector.admitted(run_id, params.get("decodebench_seeding") is True)
                if hang_at and number >= hang_at:
                    hang()
                    await asyncio.sleep(3600)
                await asyncio.sleep(first_token_s)  # a prefill's silence, /metrics still
                if prefill_s_per_token and connector.modes.get(run_id or "") != "fill":
                    await prefill(n_in, computed)
                if step_truth is not None and run_id:
                    streams[id(held)] = {"run": run_id, "n_in": n_in, "tokens": 0, "first": True,
                                         "prefill": connector.modes.get(run_id) == "prefill"}
                for i in range(n_out):
                    if crash_after and number >= crash_after and i == n_out // 2:
                        print("stub: crashing mid-stream as told", flush=True)
                        os._exit(17)
                    # Once hung, the engine is stuck: every stream stops, new ones too.
                    if stuck_after and state["hung"]:
                        await asyncio.sleep(3600)
                    if hang_after and (i >= hang_after or state["hung"]):
                        hang()
                        await asyncio.sleep(3600)
                    # A batch of more streams takes longer per step (STUB_ITL_SLOPE_S).
                    await asyncio.sleep(interval + slope * (state["open"] - state["waiting"]))
                    chunk = {"id": "cmpl-stub", "object": "text_completion",
                             "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                    event = f"data: {json.dumps(chunk)}\n\n".encode()
                    if id(held) in streams:
                        streams[id(held)]["tokens"] = i + 1
                    if bunched:
                        held.append(event)
                    else:
                        yield event
                # Its steps are all timed before the report that sends them.
                streams.pop(id(held), None)
                if held:
                    yield b"".join(held)
                usage = {"prompt_tokens": n_in, "completion_tokens": n_out,
                         "total_tokens": n_in + n_out}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                # As vLLM, the time in the queue is observed when the request finishes.
                state["queue_time_sum"] += queued_s
                state["queue_time_count"] += 1
                yield b"data: [DONE]\n\n"
                if run_id:
                    connector.soon()
            finally:
                streams.pop(id(held), None)
                state["open"] -= 1
                state["kv_tokens"] -= computed[0]
                if slot is not None:
                    slot.release()

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(lifespan=lifespan, routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/stub/connector", connect, methods=["POST"]), Route("/stub/requests", seen),
        Route("/v1/completions", completions, methods=["POST"]),
    ])


def kv_blocks() -> int:
    """The blocks of the stub's KV cache (``STUB_KV_BLOCKS``)."""
    return int(os.environ.get("STUB_KV_BLOCKS", "100000"))


def resolved_max_model_len(model: str, flag: int | None) -> int:
    """``--max-model-len`` as vLLM resolves it (see the module docstring)."""
    if flag is not None and flag != -1:
        return flag
    found = model_dir_max_len(Path(model))
    own = found.tokens if found is not None else STUB_MODEL_LEN
    if flag is None:
        return own
    # vLLM keeps one block back (its null block) from what a request may hold.
    fits = (kv_blocks() - 1) * BLOCK_SIZE
    if fits <= 0:
        print("stub: ValueError: Cannot auto-fit max_model_len: not enough GPU memory available "
              "to serve even a single token. Try increasing `gpu_memory_utilization`.", flush=True)
        sys.exit(1)
    if fits >= own:
        print(f"stub: Auto-fit max_model_len: full model context length {own} fits in available "
              "KV cache memory", flush=True)
        return own
    print(f"stub: Auto-fit max_model_len: reduced from {own} to {fits} to fit in available KV "
          "cache memory", flush=True)
    return fits


def main() -> None:
    """Parse vLLM's flags that matter here and serve."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="stub")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kv-transfer-config", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    args, _unknown = parser.parse_known_args()
    # What vLLM would resolve these to for a small float32 model on a CPU.
    engine = {"dtype": "float32" if args.dtype == "auto" else args.dtype,
              "max_model_len": resolved_max_model_len(args.model, args.max_model_len),
              "gpu_memory_utilization": args.gpu_memory_utilization,
              "tensor_parallel_size": args.tensor_parallel_size, "load_format": args.load_format,
              "enforce_eager": args.enforce_eager, "block_size": BLOCK_SIZE, "kv_cache_dtype": "auto",
              "enable_prefix_caching": True, "enable_chunked_prefill": True,
              "max_num_seqs": args.max_num_seqs or 256, "max_num_batched_tokens": 8192, "device": "cpu"}
    if os.environ.get("STUB_IGNORE_SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("STUB_PRINT_LOG"):
        sys.stdout.write(Path(os.environ["STUB_PRINT_LOG"]).read_text())
        sys.stdout.flush()
    kind = os.environ.get("STUB_ENGINE")
    if kind:
        # Kept and never waited for: a dead one stays a zombie in the process group. It
        # inherits an ignored SIGTERM, as a stuck EngineCore would not stop on one either.
        _ENGINE.append(subprocess.Popen(["sleep", "3600"] if kind == "alive" else ["true"]))
    exit_code = os.environ.get("STUB_EXIT_AT_START")
    if exit_code:
        print("stub: exiting at start as told", flush=True)
        sys.exit(int(exit_code))
    listen_after = float(os.environ.get("STUB_LISTEN_AFTER_S", "0"))
    _sleep(listen_after)
    if os.environ.get("STUB_SILENT_PORT"):
        with socket.create_server((args.host, args.port)):
            _sleep(math.inf)
    app = build_app(
        args.served_model_name or args.model,
        float(os.environ.get("STUB_TOKEN_INTERVAL_S", "0.002")),
        float(os.environ.get("STUB_STARTUP_DELAY_S", "0")),
        args.kv_transfer_config,
        engine,
        args.max_model_len,
        args.max_num_seqs,
    )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    server = _KeepSignals(config) if os.environ.get("STUB_IGNORE_SIGTERM") else uvicorn.Server(config)
    server.run()


# The stand-in for vLLM's EngineCore process (``STUB_ENGINE``).
_ENGINE: list[subprocess.Popen[bytes]] = []


def _sleep(seconds: float) -> None:
    """Sleep, for ever if ``seconds`` is infinite."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 3600))


class _KeepSignals(uvicorn.Server):
    """A server that leaves signal handling alone (so an ignored SIGTERM stays ignored)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


if __name__ == "__main__":
    main()
