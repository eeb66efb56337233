"""The watchdog's hang rule: silence on every open stream without progress in the server's
/metrics (``service/control/watchdog.py``).

Through fakes of its seams (the drivers' ``quiet``, the scraper, the fleet, a clock), each
case in milliseconds; the stub server's prefills are in ``test_reliability.py``. The first
test holds the rule to vLLM's own classes: what moves in its /metrics while a long prompt
is prefilled in chunks, before its first token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from service.analysis.server_metrics import KV_USAGE, RUNNING, Point, parse
from service.control.fleet import Fleet, LoadDrivers
from service.control.handles import WorkerError, WorkerHandle
from service.control.watchdog import Watchdog, blind_limit, stall_limit
from service.core.spec import RunSpec
from service.settings import Settings


def test_vllms_metrics_move_on_every_chunk_of_a_prefill_before_its_first_token(
        tmp_path: Path) -> None:
    # vLLM's real scheduler and stat logger (no model runs): a prompt of 8,000 tokens in
    # steps of 2,048 (vLLM's CPU default). Each step's scheduler stats are recorded, as
    # AsyncLLM's output handler does with no request output (no iteration stats).
    from prometheus_client import REGISTRY, generate_latest
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.loggers import PrometheusStatLogger, unregister_vllm_metrics
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    from tests.vllm_harness import UPSTREAM, attention, kv_config, request, vllm_config

    config = vllm_config(tmp_path, UPSTREAM, max_batched=2048)
    config.kv_transfer_config = None  # vLLM prefills every token itself
    kv = kv_config([(["layer.0"], attention())], num_blocks=2000)
    config.cache_config.num_gpu_blocks = kv.num_blocks
    sched = Scheduler(vllm_config=config, kv_cache_config=kv, block_size=16, log_stats=True,
                      structured_output_manager=StructuredOutputManager(config))
    logger = PrometheusStatLogger(config, engine_indexes=[0])
    sched.add_request(request(list(range(100, 8100)), max_tokens=2))
    seen: list[dict[str, float]] = []
    try:
        for _ in range(3):  # 6,144 of 8,000 tokens: no token sampled yet
            out = sched.schedule()
            ids = list(out.num_scheduled_tokens)
            outputs = sched.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[] for _ in ids]))
            assert not any(o.new_token_ids for eco in outputs.values() for o in eco.outputs)
            logger.record(outputs[0].scheduler_stats, None, engine_idx=0)
            seen.append(parse(generate_latest(REGISTRY).decode()))
    finally:
        unregister_vllm_metrics()
    # The KV cache usage rises with each chunk; the token counters do not move.
    usage = [s[KV_USAGE] for s in seen]
    assert usage[0] < usage[1] < usage[2], usage
    assert all(s[RUNNING] == 1 for s in seen)
    assert {s["vllm:prompt_tokens"] for s in seen} == {0.0}
    assert {s["vllm:generation_tokens"] for s in seen} == {0.0}


# ---- the rule, through fakes ---------------------------------------------------------------


class FakeDrivers:
    """``LoadDrivers.quiet`` as told."""

    def __init__(self) -> None:
        self.open = 1
        self.quiet_s = 0.0

    def quiet(self) -> tuple[int, float]:
        return self.open, self.quiet_s


class FakeScraper:
    """/metrics as told: ``values`` (None: no answer); counts the reads."""

    def __init__(self) -> None:
        self.values: dict[str, float] | None = {RUNNING: 1.0, KV_USAGE: 0.1}
        self.reads = 0

    async def scrape(self) -> Point | None:
        self.reads += 1
        return None if self.values is None else Point(0.0, dict(self.values))


class FakeFleet:
    client: Any = None

    def __init__(self) -> None:
        self.retired: list[str] = []

    async def retire(self, handle: WorkerHandle, error: str) -> None:
        self.retired.append(error)


class FakeHandle:
    url = "http://stub"

    def tail(self) -> str:
        return "last line"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Case:
    """A watchdog over fakes; ``advance`` moves the silence and the clock together."""

    def __init__(self, stall_s: float = 2.0, **spec: Any) -> None:
        self.settings = Settings(stall_s=stall_s)
        self.spec = RunSpec.model_validate({"input_len": 64, **spec})
        self.drivers, self.fleet, self.scraper, self.clock = (
            FakeDrivers(), FakeFleet(), FakeScraper(), Clock())
        self.watch = Watchdog(self.settings, self.spec, cast(Fleet, self.fleet),
                              cast(WorkerHandle, FakeHandle()), cast(LoadDrivers, self.drivers))
        self.watch.scraper = self.watch.engine.scraper = cast(Any, self.scraper)
        self.watch.now = self.clock

    def advance(self, seconds: float, moving: bool = False) -> WorkerError | None:
        """Let ``seconds`` of silence pass in watchdog ticks of 0.5 s (``moving``: the
        KV cache usage rises every tick); the finding, if any."""
        for _ in range(round(seconds / 0.5)):
            self.clock.t += 0.5
            self.drivers.quiet_s += 0.5
            if moving and self.scraper.values is not None:
                self.scraper.values[KV_USAGE] += 0.01
            if (found := asyncio.run(self.watch._stalled())) is not None:
                return found
        return None

    def tokens_came(self) -> None:
        """A stream got bytes: the silence ends (one tick sees it)."""
        self.drivers.quiet_s = 0.0
        assert asyncio.run(self.watch._stalled()) is None


def test_silence_with_metrics_that_move_is_never_a_hang() -> None:
    case = Case(stall_s=2.0, mode="prefill", input_len=100_000)
    assert case.advance(600.0, moving=True) is None
    assert case.fleet.retired == []


def test_silence_with_still_metrics_is_a_hang_at_the_stall_limit() -> None:
    # A real prefill of 100,000 tokens: the blind allowance would be 100 s; the server's
    # /metrics answers, so its stillness counts from the start of the silence.
    case = Case(stall_s=2.0, mode="prefill", input_len=100_000)
    assert case.advance(1.5) is None
    found = case.advance(1.0)
    assert found is not None and case.drivers.quiet_s == 2.0
    assert "none of the 1 open streams got a token for 2 s and its /metrics did not move" in str(found)
    assert case.fleet.retired == ["hung: no token on any open stream for 2 s"]


def test_a_server_that_moved_then_stopped_hangs_a_stall_limit_after_its_last_move() -> None:
    case = Case(stall_s=2.0, mode="prefill", input_len=100_000)
    assert case.advance(40.0, moving=True) is None
    assert case.advance(1.5) is None
    found = case.advance(1.0)
    assert found is not None
    assert "got a token for 42 s and its /metrics did not move for 2 s" in str(found)


def test_steps_that_slow_as_the_context_grows_stay_progress() -> None:
    # A chunk costs more the longer the prompt before it: steps of 2 and 3 s, longer than
    # the stall limit of 2 s, each within three times the longest step seen before. A
    # stuck server is then found three of its longest steps after its last move.
    case = Case(stall_s=2.0, mode="prefill", input_len=100_000)
    for step in (1.0, 2.0, 3.0):
        assert case.advance(step - 0.5) is None
        assert case.advance(0.5, moving=True) is None
    assert case.watch.stall_limit() == 9.0
    assert case.advance(8.5) is None
    found = case.advance(0.5)
    assert found is not None and "did not move for 9 s (the limit: 9 s" in str(found)


def test_a_new_silence_starts_from_a_fresh_reading() -> None:
    # Metrics that differ from the last silence's (decode steps ran between) are not
    # progress of this one.
    case = Case(stall_s=2.0)
    case.advance(1.0)
    case.tokens_came()
    case.scraper.values = {RUNNING: 3.0, KV_USAGE: 0.5}
    found = case.advance(2.0)
    assert found is not None and "its /metrics did not move (the limit: 2 s" in str(found)


def test_metrics_are_not_read_while_tokens_flow() -> None:
    # Silences under a sixth of the limit (a decode step's gap) cost the server no render.
    case = Case(stall_s=30.0)
    for _ in range(100):
        case.tokens_came()
        assert case.advance(4.5) is None
    assert case.scraper.reads == 0
    # A longer one is read every 5 s (a sixth of the limit), not on every tick.
    case.tokens_came()
    case.advance(29.5, moving=True)
    assert case.scraper.reads == 5


@pytest.mark.parametrize(("mode", "hung_after_s"), [("prefill", 16.5), ("fill", 2.0)])
def test_a_server_whose_metrics_say_nothing_gets_the_blind_allowance(mode: str,
                                                                     hung_after_s: float) -> None:
    # No answer from /metrics (or none of vLLM's series): progress cannot be seen, and a
    # real prefill of 16,384 tokens gets 16.4 s before its first token, as before.
    case = Case(stall_s=2.0, mode=mode, input_len=16_384)
    case.scraper.values = None
    assert case.advance(hung_after_s - 0.5) is None
    found = case.advance(0.5)
    assert found is not None and "its /metrics said nothing of its progress" in str(found)


def test_limits() -> None:
    settings = Settings(stall_s=30.0)
    prefill = RunSpec.model_validate({"mode": "prefill", "input_len": 65_536})
    # No tokens/s floor where progress is seen; three times the longest TTFT once known.
    assert stall_limit(settings) == 30.0
    assert stall_limit(settings, longest_ttft=20.0) == 60.0
    assert blind_limit(settings, prefill) == pytest.approx(65.536)
    assert blind_limit(settings, prefill, longest_ttft=5.0) == 30.0
    assert blind_limit(settings, RunSpec.model_validate({"input_len": 65_536})) == 30.0
