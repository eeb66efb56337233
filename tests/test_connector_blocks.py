"""Which blocks the connector fills, through vLLM's real scheduler, against vLLM's own
DecodeBenchConnector on the same requests."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lazy import Lazy
from tests.test_connector_params import Control

# Imported at the first test that runs here (``tests.lazy``): collection needs neither.
vllm_request = Lazy("vllm.v1.request")
h = Lazy("tests.vllm_harness")

BS = 16


def _prompt(n: int, start: int = 3) -> list[int]:
    return [start + (i % 8000) for i in range(n)]


def _both(tmp_path: Path, kv: Any, script: Any, **config: Any) -> tuple[Any, Any]:
    """Run ``script(scheduler)`` with our connector and with vLLM's; return both results."""
    ours = script(h.scheduler(h.vllm_config(tmp_path, h.OURS, **config), kv()))
    upstream = script(h.scheduler(h.vllm_config(tmp_path, h.UPSTREAM, **config), kv()))
    return ours, upstream


@pytest.fixture
def control() -> Iterator[Control]:
    """The fake control service the connector pulls from, up for one test."""
    served = Control()
    yield served
    served.server.shutdown()
    served.server.server_close()


def _one_group() -> Any:
    return h.kv_config([(["layer0", "layer1"], h.attention(BS))])


@pytest.mark.parametrize("n", [2, 17, 100, 1000, 4097])
def test_plain_request_fills_all_prompt_tokens_but_the_last(tmp_path: Path, n: int) -> None:
    def script(sched: Any) -> Any:
        sched.add_request(h.request(_prompt(n), request_id="a"))
        return h.fills(h.run_until_idle(sched))

    ours, upstream = _both(tmp_path, _one_group, script)
    assert ours == upstream
    (blocks,), tokens = ours["a"]
    assert tokens == n - 1
    assert len(blocks) == math.ceil((n - 1) / BS)


def test_one_token_prompt_fills_nothing(tmp_path: Path) -> None:
    def script(sched: Any) -> Any:
        sched.add_request(h.request([5], request_id="a"))
        return h.fills(h.run_until_idle(sched))

    ours, upstream = _both(tmp_path, _one_group, script)
    assert ours == upstream == {}


def test_prefix_cache_hit_fills_only_the_suffix(tmp_path: Path) -> None:
    shared = _prompt(64)

    def script(sched: Any) -> Any:
        sched.add_request(h.request(shared + _prompt(40, 1000), request_id="first"))
        h.run_until_idle(sched)
        sched.add_request(h.request(shared + _prompt(60, 2000), request_id="second"))
        return h.fills(h.run_until_idle(sched))

    ours, upstream = _both(tmp_path, _one_group, script)
    assert ours == upstream
    (blocks,), tokens = ours["second"]
    # 64 shared tokens (4 full blocks) come from the prefix cache; 124 - 1 - 64 are filled.
    assert tokens == 123 - 64
    assert len(blocks) == math.ceil(123 / BS) - 64 // BS


def test_other_cache_salt_never_hits_another_runs_blocks(tmp_path: Path) -> None:
    prompt = _prompt(200)

    def script(sched: Any) -> Any:
        sched.add_request(h.request(prompt, request_id="first", salt="r-1"))
        h.run_until_idle(sched)
        sched.add_request(h.request(prompt, request_id="other-run", salt="r-2"))
        other = h.fills(h.run_until_idle(sched))["other-run"]
        sched.add_request(h.request(prompt, request_id="same-run", salt="r-1"))
        same = h.fills(h.run_until_idle(sched))["same-run"]
        return other, same

    ours, upstream = _both(tmp_path, _one_group, script)
    assert ours == upstream
    other, same = ours
    # Another run's salt: no prefix hit, every token but the last is filled afresh.
    assert other[1] == 199
    # The same salt hits the 12 cached full blocks: only the rest is filled.
    assert same[1] == 199 - 12 * BS


def test_external_range_starting_inside_a_block(tmp_path: Path) -> None:
    # 40 shared tokens: 2 full cached blocks plus 8 tokens into the third, which is not cached,
    # so the fill starts at block 2 even though the cache covers part of it.
    shared = _prompt(40)

    def script(sched: Any) -> Any:
        sched.add_request(h.request(shared + _prompt(30, 3000), request_id="first"))
        h.run_until_idle(sched)
        sched.add_request(h.request(shared + _prompt(57, 4000), request_id="second"))
        return h.fills(h.run_until_idle(sched))

    ours, upstream = _both(tmp_path, _one_group, script)
    assert ours == upstream
    (blocks,), tokens = ours["second"]
    assert tokens == 96 - 32
    assert len(blocks) == math.ceil(96 / BS) - 2


def _hybrid() -> Any:
    return h.kv_config([
        (["layer0", "layer2"], h.attention(BS)),
        (["layer1", "layer3"], h.sliding(window=64, block_size=BS)),
    ])


def test_hybrid_groups_fill_their_own_blocks_and_skip_null_ones(tmp_path: Path) -> None:
    def script(sched: Any) -> Any:
        sched.add_request(h.request(_prompt(1000), request_id="a"))
        return h.fills(h.run_until_idle(sched))

    ours, upstream = _both(tmp_path, _hybrid, script)
    assert ours == upstream
    (full, window), tokens = ours["a"]
    assert tokens == 999
    assert len(full) == math.ceil(999 / BS)
    # The window group keeps only the blocks its window needs: the rest are null and skipped.
    assert 0 < len(window) < len(full)
    assert not set(full) & set(window)


def _until_filled(sched: Any, want: set[str], max_steps: int = 2000) -> dict[str, Any]:
    """Step (as the engine does, 1 ms apart when idle) until every request in ``want``
    was scheduled; return the merged metadata and the steps taken, per request."""
    import time

    values: dict[str, tuple[float, float]] = {}
    runs: dict[str, str] = {}
    filled: set[str] = set()
    scheduled_at: dict[str, int] = {}
    for n in range(max_steps):
        out, meta = h.step(sched)
        for req_id in out.num_scheduled_tokens:
            scheduled_at.setdefault(req_id, n)
        filled |= set(meta.reqs_to_fill)
        values.update(meta.fill_values)
        runs.update(meta.run_ids)
        if want <= set(scheduled_at):
            break
        time.sleep(0.001)
    return {"filled": filled, "values": values, "runs": runs, "scheduled_at": scheduled_at}


def test_requests_of_two_runs_carry_their_own_values(tmp_path: Path, control: Control) -> None:
    config = h.vllm_config(tmp_path, h.OURS, {"control_url": control.url, "worker_token": "t"})
    sched = h.scheduler(config, _one_group())
    sched.add_request(h.request(_prompt(300), run_id="r-a", request_id="a"))
    sched.add_request(h.request(_prompt(300, 500), run_id="p-b", request_id="b"))
    sched.add_request(h.request(_prompt(300, 900), request_id="c"))
    seen = _until_filled(sched, {"a", "b", "c"})
    # "r-a" is a fill run (service values), "p-b" a prefill run (no fill), "c" untagged (defaults).
    assert seen["filled"] == {"a", "c"}
    assert seen["values"] == {"a": (0.25, 0.5), "c": (0.015, 0.0)}
    assert seen["runs"] == {"a": "r-a"}
    assert control.hits == 2
    # Each request lands in its run's counters as its mode says (the step counts and finished
    # requests, which depend on when each was scheduled, are test_connector_steps.py's).
    def counters(run_id: str) -> dict[str, float]:
        got = sched.connector.connector_scheduler.reporter.snapshot(run_id)
        return {k: v for k, v in got.items()
                if k not in ("steps_shared", "steps_tagged", "requests_finished")}

    assert counters("r-a") == {"requests_seen": 1, "waited_requests": 1, "filled_requests": 1}
    assert counters("p-b") == {"requests_seen": 1, "waited_requests": 1, "prefill_requests": 1}


def test_a_slow_pull_holds_only_its_own_run_in_the_queue(tmp_path: Path, control: Control) -> None:
    control.delay = 0.3
    config = h.vllm_config(tmp_path, h.OURS, {"control_url": control.url, "worker_token": "t"})
    sched = h.scheduler(config, _one_group())
    sched.add_request(h.request(_prompt(300), run_id="r-slow", request_id="slow"))
    sched.add_request(h.request(_prompt(300, 900), request_id="untagged"))
    import time

    started = time.perf_counter()
    out, meta = h.step(sched)
    first_step = time.perf_counter() - started
    # The engine thread did not wait for the pull, the untagged request went ahead, and
    # the run's request waits in vLLM's queue instead of being guessed.
    assert first_step < 0.1, first_step
    assert set(out.num_scheduled_tokens) == {"untagged"}
    assert "slow" not in meta.reqs_to_fill
    assert [r.request_id for r in sched.waiting] == ["slow"]
    seen = _until_filled(sched, {"slow"})
    assert seen["values"]["slow"] == (0.25, 0.5)
    assert seen["scheduled_at"]["slow"] > 10  # it was asked again, step after step


def test_a_prefill_run_after_a_fill_run_fills_nothing(tmp_path: Path, control: Control) -> None:
    config = h.vllm_config(tmp_path, h.OURS, {"control_url": control.url, "worker_token": "t"})
    sched = h.scheduler(config, _one_group())
    sched.add_request(h.request(_prompt(300), run_id="r-1", request_id="f1"))
    fill = _until_filled(sched, {"f1"})
    h.run_until_idle(sched)
    sched.add_request(h.request(_prompt(300, 2000), run_id="p-2", request_id="p1"))
    sched.add_request(h.request(_prompt(300, 4000), run_id="p-2", request_id="p2"))
    prefill = _until_filled(sched, {"p1", "p2"})
    h.run_until_idle(sched)
    assert fill["filled"] == {"f1"}
    assert prefill["filled"] == set() and prefill["values"] == {}
    counters = sched.connector.connector_scheduler.reporter.snapshot("p-2")
    assert counters["prefill_requests"] == 2 and "filled_requests" not in counters


def test_a_seeded_runs_seeding_requests_are_counted_apart_from_its_measured_ones(
        tmp_path: Path, control: Control) -> None:
    config = h.vllm_config(tmp_path, h.OURS, {"control_url": control.url, "worker_token": "t"})
    sched = h.scheduler(config, _one_group())
    for k in range(3):
        sched.add_request(h.request(_prompt(300, 100 * k), run_id="s-1", request_id=f"seed{k}",
                                    max_tokens=1, seeding=True))
    sched.add_request(h.request(_prompt(300), run_id="s-1", request_id="measured"))
    seen = _until_filled(sched, {"seed0", "seed1", "seed2", "measured"})
    h.run_until_idle(sched)
    assert seen["filled"] == set()
    counters = sched.connector.connector_scheduler.reporter.snapshot("s-1")
    assert counters["seeding_requests"] == 3 and counters["prefill_requests"] == 1
    assert counters["requests_seen"] == 4 and "filled_requests" not in counters


def test_no_state_left_after_thousands_of_finished_and_aborted_requests(tmp_path: Path) -> None:
    sched = h.scheduler(h.vllm_config(tmp_path, h.OURS, max_batched=2048), _one_group())
    connector = sched.connector.connector_scheduler
    aborted = 0
    for i in range(3000):
        sched.add_request(h.request(_prompt(40 + i % 50, i), run_id=f"r-{i % 7}",
                                    request_id=f"q{i}", max_tokens=3))
        if i % 100 == 99:
            h.step(sched)
            # Abort some of what is in flight: scheduled (filled) ones and still waiting ones.
            live = sorted(sched.requests)[::9]
            sched.finish_requests(live, vllm_request.RequestStatus.FINISHED_ABORTED)
            aborted += len(live)
    h.run_until_idle(sched)
    assert aborted > 300
    assert connector.tracked_requests() == 0
    assert not connector._pending_values and not connector._pending_runs


def test_preempted_request_is_recomputed_not_filled_again(tmp_path: Path) -> None:
    # Few blocks: the second request's growth preempts the first.
    kv = h.kv_config([(["layer0"], h.attention(BS))], num_blocks=12)
    sched = h.scheduler(h.vllm_config(tmp_path, h.OURS), kv)
    sched.add_request(h.request(_prompt(80), request_id="a", max_tokens=60))
    sched.add_request(h.request(_prompt(80, 500), request_id="b", max_tokens=60))
    selected: dict[str, int] = {}
    preempted = False
    for _ in range(400):
        if not sched.has_requests():
            break
        out, meta = h.step(sched)
        preempted = preempted or bool(getattr(out, "preempted_req_ids", None))
        for req_id in meta.reqs_to_fill:
            selected[req_id] = selected.get(req_id, 0) + 1
    assert preempted, "the test did not manage to preempt a request"
    assert selected == {"a": 1, "b": 1}
    assert sched.connector.connector_scheduler.tracked_requests() == 0


def test_failed_pull_is_never_filled_with_other_values_and_is_reported(
    tmp_path: Path, control: Control
) -> None:
    control.behaviour = "error"
    config = h.vllm_config(tmp_path, h.OURS, {"control_url": control.url, "worker_token": "t",
                                              "pull_deadline_s": 0.3, "fill_mean": 0.2})
    sched = h.scheduler(config, _one_group())
    sched.add_request(h.request(_prompt(100), run_id="r-x", request_id="a"))
    sched.add_request(h.request(_prompt(100, 700), run_id="r-x", request_id="b"))
    seen = _until_filled(sched, {"a", "b"})
    # Neither request was filled (no guess with the extra-config values): vLLM prefills them,
    # and the run's counters say so with the reason, for the service to fail the run.
    assert seen["filled"] == set() and seen["values"] == {}
    connector = sched.connector.connector_scheduler
    counters = connector.reporter.snapshot("r-x")
    assert counters["unresolved_requests"] == 2 and counters["requests_seen"] == 2
    assert "HTTP 500" in connector.reporter._notes["r-x"]


def test_startup_fill_leaves_the_full_group_alone_and_still_accounts_for_the_request(tmp_path: Path) -> None:
    def script(sched: Any) -> Any:
        sched.add_request(h.request(_prompt(1000), request_id="a"))
        return h.fills(h.run_until_idle(sched))

    ours, upstream = _both(tmp_path, _hybrid, script, extra={"startup_fill": True})
    (full, window), tokens = ours["a"]
    # Both groups were filled at start (no circular buffer, no zeroing engine): nothing is
    # written per request, but the worker side still hears of the request to count it.
    assert tokens == 999 and full == [] and window == []
    assert "a" not in upstream  # vLLM's own sends nothing for it
