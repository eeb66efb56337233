"""The connector's step clock: what each engine step holds, through vLLM's real scheduler,
and how the worker side times it (the CPU clock; CUDA events without a synchronisation)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.core import steps as service_steps
from tests.lazy import Lazy
from tests.test_connector_params import Control

h = Lazy("tests.vllm_harness")
connector_steps = Lazy("connector.steps")
BS = 16


def _prompt(n: int, start: int = 3) -> list[int]:
    return [start + (i % 8000) for i in range(n)]


@pytest.fixture
def control() -> Iterator[Control]:
    served = Control()
    yield served
    served.server.shutdown()
    served.server.server_close()


def _scheduler(tmp_path: Path, control: Control, max_batched: int = 4096) -> Any:
    config = h.vllm_config(tmp_path, h.OURS, {"control_url": control.url, "worker_token": "t"},
                           max_batched=max_batched)
    return h.scheduler(config, h.kv_config([(["layer0", "layer1"], h.attention(BS))]))


def _values_in_hand(sched: Any, run_id: str) -> None:
    """Pull a run's values before its requests come (a pull in flight holds them back)."""
    params = sched.connector.connector_scheduler.params
    deadline = time.monotonic() + 10
    while params.lookup(run_id) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _steps(sched: Any, max_steps: int = 500) -> list[Any]:
    """Every computing step's ``StepInfo``, stepping until no request is left (a request
    waiting for its run's values makes steps that compute nothing: they have none)."""
    infos = []
    for _ in range(max_steps):
        if not sched.has_requests():
            return infos
        _, meta = h.step(sched)
        if meta.step is not None:
            infos.append(meta.step)
        else:
            time.sleep(0.001)
    raise AssertionError("the scheduler did not drain")


def test_the_service_reads_step_rows_in_the_order_the_connector_writes_them() -> None:
    assert connector_steps.STEP_FIELDS == service_steps.STEP_FIELDS


def test_a_fill_runs_steps_are_decode_steps_from_the_first(tmp_path: Path, control: Control) -> None:
    sched = _scheduler(tmp_path, control)
    _values_in_hand(sched, "r-fill")  # both requests are then admitted in one step
    for name in ("a", "b"):
        sched.add_request(h.request(_prompt(300, ord(name)), run_id="r-fill", request_id=name, max_tokens=5))
    infos = _steps(sched)
    assert [i.step for i in infos] == sorted({i.step for i in infos})  # numbered upward
    assert {i.run_id for i in infos} == {"r-fill"}
    # The first step computes each filled request's last prompt token over its 299 filled
    # tokens: a decode step of two requests, both in their first decode step.
    first, *rest = infos
    assert (first.decode_requests, first.prefill_tokens, first.first, first.kv_tokens) == (2, 0, 2, 600)
    # Then plain decode steps, the context one token longer each step.
    assert [(i.decode_requests, i.prefill_tokens, i.first) for i in rest] == [(2, 0, 0)] * 4
    assert [i.kv_tokens for i in rest] == [602, 604, 606, 608]
    # The run is told how many steps it had alone (the worker times those) once its requests
    # have finished: what the service waits for before it reads the run's steps.
    counted = sched.connector.connector_scheduler.reporter.snapshot("r-fill")
    assert counted["steps_tagged"] == 5 and counted.get("steps_shared", 0) == 0
    assert counted["requests_finished"] == 2


def test_a_real_prefill_is_prompt_tokens_and_its_first_decode_comes_after(
        tmp_path: Path, control: Control) -> None:
    # Runs whose id starts with "p" are prefill runs (the fake control service's rule).
    sched = _scheduler(tmp_path, control, max_batched=256)
    sched.add_request(h.request(_prompt(300), run_id="p-run", request_id="a", max_tokens=4))
    infos = _steps(sched)
    prefill = [i for i in infos if i.prefill_tokens]
    # Chunks of 256 tokens at most, the whole prompt computed in them (the scheduler's count:
    # this harness's engine hands back a token with the first chunk), none of them a decode.
    computed = sum(i.prefill_tokens for i in prefill)
    assert len(prefill) == 2 and computed >= 300 and all(i.decode_requests == 0 for i in prefill)
    assert max(i.prefill_tokens for i in prefill) == 256
    decode = [i for i in infos if not i.prefill_tokens]
    assert [(i.decode_requests, i.first) for i in decode] == [(1, 1), (1, 0)]
    assert [i.kv_tokens for i in decode] == [computed + 1, computed + 2]


def test_a_step_that_holds_two_runs_belongs_to_neither(tmp_path: Path, control: Control) -> None:
    sched = _scheduler(tmp_path, control)
    _values_in_hand(sched, "r-one")
    _values_in_hand(sched, "r-two")
    sched.add_request(h.request(_prompt(100), run_id="r-one", request_id="a", max_tokens=3))
    sched.add_request(h.request(_prompt(100, 500), run_id="r-two", request_id="b", max_tokens=3))
    infos = _steps(sched)
    both = [i for i in infos if i.decode_requests == 2]
    assert both and all(i.run_id is None for i in both)
    # Each run is told how many of its steps were shared (not timed) and how many were its own.
    reporter = sched.connector.connector_scheduler.reporter
    for run_id in ("r-one", "r-two"):
        counted = reporter.snapshot(run_id)
        alone = sum(i.run_id == run_id for i in infos)
        assert counted.get("steps_tagged", 0) == alone and counted["steps_shared"] == len(both), counted


def test_the_cpu_clock_times_the_forward_less_the_fill() -> None:
    rows: list[tuple[str, list[float]]] = []
    clock = connector_steps.StepClock(lambda run, row: rows.append((run, row)), lambda run: None)
    info = connector_steps.StepInfo(7, "r", 4, 0, 4000, 0)
    clock.begin(info)
    clock.load_begin()
    time.sleep(0.2)  # the fill
    clock.load_end()
    time.sleep(0.02)  # the forward
    clock.end()
    [(run, row)] = rows
    assert run == "r" and row[:5] == [7, 4, 0, 4000, 0]
    # The forward's 20 ms, not the fill's 200 with it: a bound of 200 leaves a busy machine
    # 180 ms to wake the sleeper late (one of 45 would fail on a wake 25 ms late).
    assert 15 <= row[5] < 200, row
    # A step of no run (mixed or untagged) is not timed.
    clock.begin(connector_steps.StepInfo(8, None, 4, 0, 4000, 0))
    clock.end()
    clock.begin(None)
    clock.end()
    assert len(rows) == 1


class _Event:
    """A stand-in CUDA event (no GPU here: the order of reads is the point)."""

    now = 0.0

    def __init__(self) -> None:
        self.at = _Event.now
        self.done = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: _Event) -> float:
        return other.at - self.at


def test_cuda_steps_are_read_once_done_and_never_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[_Event] = []

    def record() -> _Event:
        made.append(_Event())
        return made[-1]

    monkeypatch.setattr(connector_steps.StepClock, "_record", staticmethod(record))
    rows: list[list[float]] = []
    dropped: list[str] = []
    clock = connector_steps.StepClock(lambda run, row: rows.append(row), dropped.append,
                                      device=type("Device", (), {"type": "cuda"})())
    for n in range(3):
        clock.begin(connector_steps.StepInfo(n + 1, "r", 2, 0, 100, 0))
        _Event.now += 1.0
        clock.load_begin()
        _Event.now += 0.5
        clock.load_end()
        _Event.now += 2.0
        clock.end()
    # Launched, not done: nothing read, nothing waited for.
    assert rows == []
    for event in made[:8]:  # the first two steps are done
        event.done = True
    clock.flush()
    assert [(r[0], r[5]) for r in rows] == [(1, 3.0), (2, 3.0)]  # 3.5 ms less the 0.5 ms fill
    made[-1].done = True
    clock.flush()
    assert [r[0] for r in rows] == [1, 2, 3]
    # A stream that never drains: past the bound the oldest steps are dropped and counted.
    for n in range(connector_steps.MAX_PENDING_EVENTS + 5):
        clock.begin(connector_steps.StepInfo(100 + n, "r", 2, 0, 100, 0))
        clock.end()
    assert dropped == ["r"] * 5


torch = pytest.importorskip("torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine)")
def test_cuda_events_time_a_forward_without_a_synchronisation(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    rows: list[list[float]] = []
    clock = connector_steps.StepClock(lambda run, row: rows.append(row), lambda run: None, device=device)
    torch.cuda.synchronize()

    def no_sync(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the step clock synchronised the device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    launched = []
    for n in range(5):
        clock.begin(connector_steps.StepInfo(n + 1, "r", 1, 0, 10, 0))
        started = time.perf_counter()
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        launched.append(time.perf_counter() - started)
        clock.end()
    monkeypatch.undo()
    torch.cuda.synchronize()
    clock.flush()
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5]
    # Eight 4096^3 matmuls take milliseconds of GPU time; their launch returns sooner.
    assert all(r[5] > 0.5 for r in rows), rows
