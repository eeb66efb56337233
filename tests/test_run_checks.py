"""Every run proves it measured what it says: the connector's account, the server's view,
the client's timing. Pure checks on fixed evidence, then runs through the service against
the stub server, whose faults (a queue of its own, a small KV cache, no connector) are the
point here; the real vLLM server's side is in ``test_e2e_vllm``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.analysis.checks import (
    asked_concurrency,
    client_warnings,
    connector_verdict,
    in_flight,
    infeasible,
    server_warnings,
)
from service.core.protocol import connector_totals
from service.core.sample import Sample
from tests.conftest import ServedTestClient, make_client, wait_finished


def _sample(index: int, start: float, latency: float, due: float | None = None) -> Sample:
    return Sample(index=index, prompt_len=10, output_tokens=4, ttft=0.01, itl=[0.01] * 3,
                  latency=latency, start_time=start, success=True, due_time=due)


def _codes(warnings: list[dict[str, Any]]) -> list[str]:
    return [w["code"] for w in warnings]


# ------------------------------------------------------------------ pure checks


def test_asked_concurrency_is_the_cap_or_everything_at_once() -> None:
    assert asked_concurrency(8, 64, None) == 8
    assert asked_concurrency(8, 3, None) == 3
    assert asked_concurrency(None, 64, None) == 64
    assert asked_concurrency(None, 64, 2.0) is None


def test_infeasible_gives_the_arithmetic() -> None:
    reason = infeasible(8, 32_896, 200_000)
    assert reason is not None
    assert "8 requests at once x 32,896 tokens" in reason and "263,168" in reason
    assert "200,000" in reason
    assert infeasible(4, 32_896, 200_000) is None
    assert infeasible(8, 32_896, None) is None


def test_connector_verdict_fails_a_run_without_any_report() -> None:
    failure, _ = connector_verdict(connector_totals({}), "fill", 5)
    assert failure is not None and "never reported" in failure


def test_connector_verdict_fails_requests_not_treated_as_asked() -> None:
    ranks = {"scheduler:0": {"requests_seen": 5, "filled_requests": 3, "unresolved_requests": 2,
                             "error": "HTTP 404 run not assigned"},
             "worker:0": {"requests_filled": 3}}
    failure, _ = connector_verdict(connector_totals(ranks), "fill", 5)
    assert failure is not None
    assert "2 of 5 requests" in failure and "HTTP 404 run not assigned" in failure


def test_connector_verdict_accepts_a_clean_account_and_flags_a_missing_rank_fill() -> None:
    clean = {"scheduler:0": {"requests_seen": 5, "filled_requests": 5},
             "worker:0": {"requests_filled": 5}, "worker:1": {"requests_filled": 5}}
    assert connector_verdict(connector_totals(clean), "fill", 5) == (None, [])
    short = {**clean, "worker:1": {"requests_filled": 4}}
    failure, warnings = connector_verdict(connector_totals(short), "fill", 5)
    assert failure is None and _codes(warnings) == ["fill_mismatch"]
    assert warnings[0]["figure"] == 1


def test_connector_verdict_fails_a_filled_prefill_run() -> None:
    ranks = {"scheduler:0": {"requests_seen": 3, "filled_requests": 1, "prefill_requests": 2}}
    failure, _ = connector_verdict(connector_totals(ranks), "prefill", 3)
    assert failure is not None and "prefill run were filled" in failure


def test_in_flight_counts_requests_open_at_each_time() -> None:
    samples = [_sample(0, 0.0, 1.0), _sample(1, 0.5, 1.0), _sample(2, 2.0, 1.0)]
    held = in_flight(samples, np.array([0.25, 0.75, 1.25, 1.75, 2.5]))
    assert held.tolist() == [1, 2, 1, 0, 1]


def _points(running: list[float], waiting: list[float], **counters: list[float]) -> list[Any]:
    points = []
    for k, (r, w) in enumerate(zip(running, waiting, strict=True)):
        values = {"vllm:num_requests_running": r, "vllm:num_requests_waiting": w,
                  "vllm:kv_cache_usage_perc": 0.2}
        for name, series in counters.items():
            values[f"vllm:{name}"] = series[k]
        points.append((0.1 + k * 0.5, values))
    return points


def test_server_view_warns_when_the_batch_was_smaller_than_asked() -> None:
    # The client has 4 decoding from 0 to 5 s; the server ran only 2, 2 waiting.
    samples = [_sample(k, 0.0, 5.0) for k in range(4)]
    warnings = server_warnings(_points([2] * 10, [2] * 10), samples, 4)
    assert _codes(warnings) == ["queued_in_server"]
    assert warnings[0]["figure"] == 2
    assert server_warnings(_points([4] * 10, [0] * 10), samples, 4) == []


def test_two_scrapes_find_a_queue_from_the_time_requests_waited_in_it() -> None:
    # No scrape during the run (the default): the start and the end only. 8 requests of
    # 1 s each; half of them waited a whole request in the server's queue.
    samples = [_sample(k, 0.0, 1.0 if k < 4 else 2.0) for k in range(8)]
    start = {"vllm:request_queue_time_seconds_sum": 10.0,
             "vllm:request_queue_time_seconds_count": 20.0}
    queued = [(0.0, start), (3.0, {"vllm:request_queue_time_seconds_sum": 14.0,
                                   "vllm:request_queue_time_seconds_count": 28.0})]
    warnings = server_warnings(queued, samples, 4)
    assert _codes(warnings) == ["queued_in_server"]
    assert "a mean of 500 ms" in warnings[0]["message"] and "8 requests" in warnings[0]["message"]
    assert warnings[0]["figure"] == pytest.approx(0.5 / 1.5, abs=1e-4)
    # Joining the batch at the next step, and one request waiting once for its run's
    # values (a fill run's first), is not a queue.
    for waited in (8 * 0.004, 0.030):
        calm = [(0.0, start), (3.0, {"vllm:request_queue_time_seconds_sum": 10.0 + waited,
                                     "vllm:request_queue_time_seconds_count": 28.0})]
        assert server_warnings(calm, samples, 4) == []
    # A server restarted between the scrapes says nothing.
    restarted = [(0.0, start), (3.0, {"vllm:request_queue_time_seconds_sum": 4.0,
                                      "vllm:request_queue_time_seconds_count": 8.0})]
    assert server_warnings(restarted, samples, 4) == []


def test_server_view_warns_on_preemptions_kv_and_foreign_hits() -> None:
    samples = [_sample(k, 0.0, 5.0) for k in range(2)]
    preempted = _points([2] * 4, [0] * 4, num_preemptions=[3, 3, 5, 6])
    warnings = server_warnings(preempted, samples, 2)
    assert _codes(warnings) == ["preempted"] and warnings[0]["figure"] == 3
    full = _points([2] * 4, [0] * 4)
    full[2][1]["vllm:kv_cache_usage_perc"] = 0.97
    assert _codes(server_warnings(full, samples, 2)) == ["kv_near_full"]
    hits = _points([2] * 4, [0] * 4, prefix_cache_hits=[100, 100, 612, 612])
    warnings = server_warnings(hits, samples, 2)
    assert _codes(warnings) == ["foreign_prefix_hits"] and warnings[0]["figure"] == 512
    # A recomputed (preempted) request may hit its own blocks: not foreign.
    assert "foreign_prefix_hits" not in _codes(server_warnings(hits, samples, 2, recomputed=1))


def test_a_counter_that_went_back_says_nothing() -> None:
    samples = [_sample(0, 0.0, 5.0)]
    restarted = _points([1] * 3, [0] * 3, num_preemptions=[9, 9, 0])
    assert server_warnings(restarted, samples, 1) == []


def test_client_lag_from_due_times_and_driver_beats() -> None:
    late = [_sample(k, k + 0.004, 0.5, due=float(k)) for k in range(9)]
    warnings = client_warnings(late, [], open_loop=True)
    assert _codes(warnings) == ["client_lag"] and warnings[0]["figure"] == pytest.approx(4.0)
    on_time = [_sample(k, k + 0.0002, 0.5, due=float(k)) for k in range(9)]
    assert client_warnings(on_time, [], open_loop=True) == []
    busy = [{"t": k, "cpu": 0.99, "lag_ms": 0.1, "shard": 0} for k in range(5)]
    assert _codes(client_warnings(on_time, busy, open_loop=True)) == ["client_lag"]
    calm = [{"t": k, "cpu": 0.3, "lag_ms": 0.1, "shard": 0} for k in range(5)]
    assert client_warnings(on_time, calm, open_loop=True) == []


def test_waiting_for_a_concurrency_slot_is_not_client_lag() -> None:
    # Two slots, a request due every 0.1 s, each taking 1 s: from the third on every
    # request waits for a slot (seconds, by the end), and leaves 0.2 ms after one frees.
    waited: list[Sample] = []
    for k in range(20):
        due = 0.1 * k
        free = due if k < 2 else waited[k - 2].start_time + 1.0
        waited.append(_sample(k, free + 0.0002, 1.0, due=due))
    assert np.median([s.start_time - s.due_time for s in waited]) > 3
    assert client_warnings(waited, [], open_loop=True) == []
    # Requests that had a free slot (1 s apart, 0.3 s each) but left 4 ms late: the client.
    late = [_sample(k, k + 0.004, 0.3, due=float(k)) for k in range(20)]
    warnings = client_warnings(late, [], open_loop=True)
    assert _codes(warnings) == ["client_lag"] and warnings[0]["figure"] == pytest.approx(4.0)
    # Both in one run: a cap of two, bursts that fill it, and the client 4 ms late in the
    # calm between them.
    mixed: list[Sample] = []
    for k in range(40):
        burst, i = divmod(k, 4)
        due = 10.0 * burst + 0.01 * i
        free = due if i < 2 else mixed[k - 2].start_time + 1.0
        mixed.append(_sample(k, max(free, due + 0.004), 1.0, due=due))
    warnings = client_warnings(mixed, [], open_loop=True)
    assert _codes(warnings) == ["client_lag"] and warnings[0]["figure"] == pytest.approx(4.0)


# ------------------------------------------------------------------ runs against the stub


@pytest.fixture
def stub_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Set ``STUB_*`` variables for the stub servers the service starts in a test."""
    yield monkeypatch


def _service(tmp_path: Path) -> ServedTestClient:
    return make_client(tmp_path)


def test_a_run_records_its_connector_account_and_server_view(
    tmp_path: Path, stub_env: pytest.MonkeyPatch
) -> None:
    # Tokens 20 ms apart: on a busy machine the stub's 2 ms gaps reach a starved client in
    # bursts, which the run would rightly warn of (bunched_streams).
    stub_env.setenv("STUB_TOKEN_INTERVAL_S", "0.02")
    with _service(tmp_path) as client:
        run = client.post("/api/runs", json={"input_len": 64, "output_len": 40, "num_prompts": 6,
                                             "max_concurrency": 3, "warmup_prompts": 1}).json()
        done = wait_finished(client, run["id"])
        assert done["status"] == "succeeded", done["error"]
        connector = done["connector"]
        assert connector["requests_seen"] == 7 and connector["filled_requests"] == 7
        assert connector["other_requests"] == 0
        assert done["warnings"] == []
        view = client.get(f"/api/runs/{run['id']}/server-metrics").json()
        assert len(view["points"]) == 2  # at the start and the end; none during it by default
        assert "vllm:num_requests_running" in view["points"][0]["values"]


def test_a_server_without_the_connector_fails_the_run_with_the_reason(
    tmp_path: Path, stub_env: pytest.MonkeyPatch
) -> None:
    stub_env.setenv("STUB_NO_CONNECTOR", "1")
    with _service(tmp_path) as client:
        run = client.post("/api/runs", json={"input_len": 64, "output_len": 4, "num_prompts": 3,
                                             "max_concurrency": 3}).json()
        done = wait_finished(client, run["id"])
    assert done["status"] == "failed"
    assert "never reported" in done["error"]
    assert done["progress"]["completed"] == 3  # the numbers are kept, the verdict is clear


def test_a_queue_in_the_server_is_a_warning(tmp_path: Path, stub_env: pytest.MonkeyPatch) -> None:
    stub_env.setenv("STUB_MAX_RUNNING", "2")
    stub_env.setenv("STUB_TOKEN_INTERVAL_S", "0.01")
    # The time series needs scrapes during the run, which are off by default.
    with make_client(tmp_path, scrape_every_s=1.0) as client:
        run = client.post("/api/runs", json={"input_len": 64, "output_len": 150, "num_prompts": 8,
                                             "max_concurrency": 4}).json()
        done = wait_finished(client, run["id"])
        assert done["status"] == "succeeded", done["error"]
        queued = [w for w in done["warnings"] if w["code"] == "queued_in_server"]
        assert queued, done["warnings"]
        # The stub runs 2 and keeps the other 2 in its queue, without a first token.
        assert "waited in the server's queue" in queued[0]["message"]
        assert queued[0]["figure"] >= 0.5
        page = client.get(f"/runs/{run['id']}").text
        assert "queued_in_server" in page


def test_a_queue_in_the_server_is_found_without_scrapes_during_the_run(
    tmp_path: Path, stub_env: pytest.MonkeyPatch
) -> None:
    stub_env.setenv("STUB_MAX_RUNNING", "2")
    stub_env.setenv("STUB_TOKEN_INTERVAL_S", "0.01")
    with _service(tmp_path) as client:  # scrapes at the start and the end only
        run = client.post("/api/runs", json={"input_len": 64, "output_len": 40, "num_prompts": 8,
                                             "max_concurrency": 4}).json()
        done = wait_finished(client, run["id"])
        assert done["status"] == "succeeded", done["error"]
        assert len(client.get(f"/api/runs/{run['id']}/server-metrics").json()["points"]) == 2
        queued = [w for w in done["warnings"] if w["code"] == "queued_in_server"]
        assert queued, done["warnings"]
        # 2 run, 2 wait a whole request S (40 tokens x 10 ms), and each pair sent as a pair
        # ends waits S for the one before it: 6 of 8 wait S, 0.75 S against a mean latency of
        # 1.75 S, 3/7 (0.43 measured, whether the service answers the stub's reports at once
        # or 1 s late). The first pair's pull of the run's values lengthens the wait behind
        # it, never past half; a client slow to send the next shortens it. 0.05 over the half
        # for the requests' own jitter.
        assert "in the server's queue before it first scheduled them" in queued[0]["message"]
        assert 0.15 <= queued[0]["figure"] <= 0.55


def test_an_open_loop_that_waits_for_its_slot_has_no_client_lag(tmp_path: Path) -> None:
    # 20 requests/s arrive and one slot holds a request about 0.2 s: later requests wait
    # for the slot (the server is the limit), and each leaves as soon as it has it.
    with _service(tmp_path) as client:
        spec = {"input_len": 8, "output_len": 100, "num_prompts": 8, "max_concurrency": 1,
                "request_rate": 20.0}
        run = client.post("/api/runs", json=spec).json()
        done = wait_finished(client, run["id"])
        assert done["status"] == "succeeded", done["error"]
        samples = client.get(f"/api/runs/{run['id']}/requests").json()
        assert max(s["start_time"] - s["due_time"] for s in samples) > 0.5
        assert "client_lag" not in _codes(done["warnings"]), done["warnings"]


def test_a_sweep_point_that_cannot_fit_is_failed_before_it_runs(
    tmp_path: Path, stub_env: pytest.MonkeyPatch
) -> None:
    stub_env.setenv("STUB_KV_BLOCKS", "100")  # 1,600 tokens of KV cache
    with _service(tmp_path) as client:
        sweep = client.post("/api/sweeps", json={
            "base": {"input_len": 300, "output_len": 100, "num_prompts": 8},
            "grid": {"max_concurrency": [2, 8]},
        }).json()
        runs = {r["spec"]["max_concurrency"]: r for r in sweep["runs"]}
        fits = wait_finished(client, runs[2]["id"])
        too_big = wait_finished(client, runs[8]["id"])
    assert fits["status"] == "succeeded", fits["error"]
    assert too_big["status"] == "failed"
    assert "8 requests at once x 400 tokens" in too_big["error"] and "1,600" in too_big["error"]
    assert too_big["progress"]["completed"] == 0
