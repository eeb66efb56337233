"""Load shapes: seeded plans, length ranges, arrivals, warmup, and client-side queueing."""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.core.spec import RunSpec
from service.load.plan import RampUp, arrival_offsets, make_plan
from tests.conftest import wait_finished


def test_same_seed_gives_the_same_plan_and_another_seed_another() -> None:
    spec = RunSpec(input_len=100, output_len=20, range_ratio=0.5, num_prompts=20, request_rate=5)
    a, b = make_plan(spec, 8192), make_plan(spec, 8192)
    assert a == b
    assert [a.prompt(i) for i in range(20)] == [b.prompt(i) for i in range(20)]
    c = make_plan(spec.model_copy(update={"seed": 1}), 8192)
    assert c.prompt(0) != a.prompt(0) and list(c.offsets) != list(a.offsets)
    assert a.prompt(0) != a.prompt(1)


def test_prompts_are_drawn_when_sent_not_held_by_the_plan() -> None:
    # 1,000 prompts of 130,000 tokens: the plan is a few arrays of lengths and offsets.
    spec = RunSpec(input_len=130_000, output_len=128, num_prompts=1000, warmup_prompts=2, seed=7)
    plan = make_plan(spec, 8192)
    held = sum(getattr(plan, k).nbytes for k in ("input_lens", "output_lens", "offsets"))
    assert held < 64 * 1024
    prompt = plan.prompt(999)
    assert len(prompt) == 130_000 and min(prompt) >= 3 and max(prompt) < 8192
    assert prompt == make_plan(spec, 8192).prompt(999)


def test_range_ratio_spreads_input_and_output_lengths_within_bounds() -> None:
    spec = RunSpec(input_len=1000, output_len=100, range_ratio=0.25, num_prompts=400)
    plan = make_plan(spec, 8192)
    inputs = [len(plan.prompt(i)) for i in range(400)]
    assert min(inputs) >= 750 and max(inputs) <= 1250
    assert max(inputs) - min(inputs) > 400  # really spread, not constant
    assert min(plan.output_lens) >= 75 and max(plan.output_lens) <= 125
    assert statistics.mean(inputs) == pytest.approx(1000, rel=0.03)


def test_no_range_ratio_means_exact_lengths() -> None:
    plan = make_plan(RunSpec(input_len=777, output_len=33, num_prompts=10), 8192)
    assert {len(plan.prompt(i)) for i in range(10)} == {777}
    assert set(plan.output_lens) == {33}


def test_prompt_ids_stay_inside_the_vocabulary_and_skip_special_tokens() -> None:
    plan = make_plan(RunSpec(input_len=5000, num_prompts=4), 100)
    ids = [t for i in range(4) for t in plan.prompt(i)]
    assert min(ids) >= 3 and max(ids) < 100


def test_all_at_once_without_a_request_rate() -> None:
    assert set(make_plan(RunSpec(num_prompts=50), 8192).offsets) == {0.0}


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.25])
def test_arrivals_have_the_asked_rate_and_burstiness(burstiness: float) -> None:
    spec = RunSpec(num_prompts=20_000, request_rate=40.0, burstiness=burstiness, input_len=1)
    offsets = make_plan(spec, 8192).offsets.tolist()
    # The first request waits its own gap, like every other one.
    gaps = [b - a for a, b in itertools.pairwise([0.0, *offsets])]
    assert offsets[0] > 0.0 and all(g >= 0 for g in gaps)
    # Stretched as vLLM does: the last request is due at exactly num_prompts / request_rate.
    assert offsets[-1] == pytest.approx(20_000 / 40, rel=1e-12)
    assert statistics.mean(gaps) == pytest.approx(1 / 40, rel=1e-9)
    # Gamma gaps with shape k have coefficient of variation 1 / sqrt(k); 1.0 is Poisson.
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(burstiness ** -0.5, rel=0.07)


def test_arrivals_do_not_depend_on_the_length_draws() -> None:
    base = RunSpec(num_prompts=50, request_rate=8.0, seed=3)
    other = base.model_copy(update={"range_ratio": 0.5, "warmup_prompts": 7, "input_len": 99})
    assert np.array_equal(make_plan(base, 8192).offsets, make_plan(other, 8192).offsets)
    assert np.array_equal(make_plan(base, 8192).offsets, arrival_offsets(50, 8.0, 1.0, 3))


def test_infinite_burstiness_gives_evenly_spaced_arrivals() -> None:
    offsets = arrival_offsets(10, 4.0, math.inf, 0)
    np.testing.assert_allclose(offsets, np.arange(1, 11) / 4.0, rtol=1e-12)


def test_ramp_up_raises_the_rate_from_start_to_end_without_stretching() -> None:
    n = 20_000
    ramp = RampUp(strategy="linear", start_rps=10.0, end_rps=100.0)
    offsets = make_plan(RunSpec(num_prompts=n, input_len=1, ramp_up=ramp.model_dump()), 8192).offsets
    gaps = np.diff(offsets, prepend=0.0)
    rates = 10.0 + 90.0 * np.arange(n) / (n - 1)
    # Each gap has mean 1 / (its request's rate): gap * rate has mean 1, early and late.
    assert np.mean(gaps[:2000] * rates[:2000]) == pytest.approx(1.0, rel=0.06)
    assert np.mean(gaps[-2000:] * rates[-2000:]) == pytest.approx(1.0, rel=0.06)
    assert np.mean(gaps[:2000]) > 5 * np.mean(gaps[-2000:])
    # Not stretched: the sum of the drawn gaps, which is not n / any one rate.
    assert offsets[-1] == pytest.approx(np.sum(1 / rates), rel=0.03)


# --- the same schedule as ``vllm bench serve`` -----------------------------------------


@pytest.fixture(scope="module")
def vllm_serve() -> ModuleType:
    """vLLM's benchmark client module (imported only here: it pulls in torch)."""
    from vllm.benchmarks import serve

    return serve


def _vllm_schedule(serve: ModuleType, monkeypatch: pytest.MonkeyPatch, n: int, request_rate: float,
                   burstiness: float, seed: int, ramp: RampUp | None) -> np.ndarray:
    """Each request's target delay as vLLM's ``get_request`` schedules it after
    ``np.random.seed(seed)``, on a fake clock that stands at 0, so every sleep asks for
    exactly the request's delay and nothing really waits."""
    asked: list[float] = []

    async def sleep(seconds: float) -> None:
        asked.append(seconds)

    monkeypatch.setattr(serve, "time", SimpleNamespace(time=lambda: 0.0))
    monkeypatch.setattr(serve, "asyncio", SimpleNamespace(sleep=sleep))
    np.random.seed(seed)
    delays: list[float] = []

    async def collect() -> None:
        generator = serve.get_request(
            list(range(n)), request_rate, burstiness,
            ramp.strategy if ramp else None,
            ramp.start_rps if ramp else None,
            ramp.end_rps if ramp else None,
        )
        async for _request, _rate in generator:
            # A request due at 0 is yielded without a sleep.
            delays.append(asked.pop() if asked else 0.0)

    asyncio.run(collect())
    monkeypatch.undo()
    return np.array(delays)


VLLM_CASES: dict[str, Callable[[], tuple[int, float, float, RampUp | None]]] = {
    "poisson": lambda: (64, 4.0, 1.0, None),
    "bursty": lambda: (64, 4.0, 0.5, None),
    "smooth": lambda: (64, 4.0, 3.0, None),
    "constant": lambda: (64, 4.0, math.inf, None),
    "all-at-once": lambda: (16, math.inf, 1.0, None),
    "one-request": lambda: (1, 2.5, 1.0, None),
    "linear-ramp": lambda: (64, math.inf, 1.0, RampUp(strategy="linear", start_rps=1, end_rps=10)),
    "exponential-ramp": lambda: (64, math.inf, 1.0,
                                 RampUp(strategy="exponential", start_rps=1, end_rps=16)),
    "bursty-exponential-ramp": lambda: (500, math.inf, 0.3,
                                        RampUp(strategy="exponential", start_rps=2, end_rps=300)),
    "constant-linear-ramp": lambda: (32, math.inf, math.inf,
                                     RampUp(strategy="linear", start_rps=3, end_rps=5)),
}


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 - 1])
@pytest.mark.parametrize("case", list(VLLM_CASES))
def test_arrivals_match_vllm_bench_serve(vllm_serve: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                         case: str, seed: int) -> None:
    n, rate, burstiness, ramp = VLLM_CASES[case]()
    theirs = _vllm_schedule(vllm_serve, monkeypatch, n, rate, burstiness, seed, ramp)
    ours = arrival_offsets(n, None if math.isinf(rate) else rate, burstiness, seed, ramp)
    assert len(theirs) == len(ours) == n
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", [0, 9])
def test_a_run_spec_plans_vllms_arrivals(vllm_serve: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                         seed: int) -> None:
    spec = RunSpec(num_prompts=40, request_rate=6.0, burstiness=0.7, warmup_prompts=3,
                   range_ratio=0.3, seed=seed)
    theirs = _vllm_schedule(vllm_serve, monkeypatch, 40, 6.0, 0.7, seed, None)
    np.testing.assert_allclose(make_plan(spec, 8192).offsets, theirs, rtol=1e-12, atol=0)


def test_warmup_requests_are_sent_but_not_measured(client: TestClient) -> None:
    spec = {"input_len": 16, "output_len": 3, "num_prompts": 5, "warmup_prompts": 3}
    run = client.post("/api/runs", json=spec).json()
    done = wait_finished(client, run["id"])
    assert done["status"] == "succeeded"
    assert done["summary"]["completed"] == 5
    assert len(client.get(f"/api/runs/{run['id']}/requests").json()) == 5
    worker = client.get("/api/workers").json()[0]
    assert httpx.get(f"{worker['url']}/stub/requests").json()["requests"] == 8


def test_a_ramp_up_run_is_sent_on_its_ramp(client: TestClient) -> None:
    spec = {"input_len": 8, "output_len": 2, "num_prompts": 12, "max_concurrency": None, "seed": 4,
            "ramp_up": {"strategy": "exponential", "start_rps": 20, "end_rps": 200}}
    response = client.post("/api/runs", json=spec)
    assert response.status_code == 201, response.text
    run = response.json()
    assert run["spec"]["ramp_up"] == {"strategy": "exponential", "start_rps": 20.0, "end_rps": 200.0}
    assert wait_finished(client, run["id"])["status"] == "succeeded"
    samples = sorted(client.get(f"/api/runs/{run['id']}/requests").json(), key=lambda s: s["index"])
    dues = np.array([s["due_time"] for s in samples])
    offsets = make_plan(RunSpec.model_validate(spec), None).offsets
    # The driver processes got the ramp: every request was due on the ramp's schedule.
    np.testing.assert_allclose(dues - dues[0], offsets - offsets[0], atol=1e-6)
    # The vLLM-format export carries the ramp under vLLM's own keys.
    exported = client.get(f"/api/runs/{run['id']}/export?format=vllm").json()
    assert (exported["ramp_up_strategy"], exported["ramp_up_start_rps"],
            exported["ramp_up_end_rps"]) == ("exponential", 20.0, 200.0)


def test_client_side_queueing_is_recorded(client: TestClient) -> None:
    # 20 requests/s arrive, each takes about 0.2 s on the stub, one slot: later requests
    # wait for the slot before they are sent.
    spec = {"input_len": 8, "output_len": 100, "num_prompts": 8, "max_concurrency": 1,
            "request_rate": 20.0}
    run = client.post("/api/runs", json=spec).json()
    assert wait_finished(client, run["id"])["status"] == "succeeded"
    samples = sorted(client.get(f"/api/runs/{run['id']}/requests").json(), key=lambda s: s["index"])
    waits = [s["start_time"] - s["due_time"] for s in samples]
    assert all(w >= 0 for w in waits)
    assert waits[-1] > waits[0] + 0.05  # the queue builds up
    dues = [s["due_time"] for s in samples]
    assert dues == sorted(dues) and dues[-1] > dues[0]
    export = client.get(f"/api/runs/{run['id']}/export?format=vllm").json()
    assert export["queue_times"] == pytest.approx(waits)


def test_sent_time_is_when_the_last_byte_of_the_request_left(client: TestClient) -> None:
    # Prompts of 40,000 tokens go out as a stream of blocks: the request leaves after its
    # slot, its connection and its body's encoding, before its first token comes back.
    spec = {"input_len": 40_000, "output_len": 2, "num_prompts": 3, "max_concurrency": 1}
    run = client.post("/api/runs", json=spec).json()
    assert wait_finished(client, run["id"])["status"] == "succeeded"
    for s in client.get(f"/api/runs/{run['id']}/requests").json():
        assert s["start_time"] < s["sent_time"] <= s["start_time"] + s["ttft"], s
