"""Load shapes: seeded plans, length ranges, arrivals, warmup, and client-side queueing."""

from __future__ import annotations

import itertools
import statistics

import httpx
import pytest
from fastapi.testclient import TestClient

from service.loadgen import make_plan
from service.models import RunSpec
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
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0
    assert statistics.mean(gaps) == pytest.approx(1 / 40, rel=0.05)
    # Gamma gaps with shape k have coefficient of variation 1 / sqrt(k); 1.0 is Poisson.
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(burstiness ** -0.5, rel=0.07)


def test_warmup_requests_are_sent_but_not_measured(client: TestClient) -> None:
    spec = {"input_len": 16, "output_len": 3, "num_prompts": 5, "warmup_prompts": 3}
    run = client.post("/api/runs", json=spec).json()
    done = wait_finished(client, run["id"])
    assert done["status"] == "succeeded"
    assert done["summary"]["completed"] == 5
    assert len(client.get(f"/api/runs/{run['id']}/requests").json()) == 5
    worker = client.get("/api/workers").json()[0]
    assert httpx.get(f"{worker['url']}/stub/requests").json()["requests"] == 8


def test_client_side_queueing_is_recorded(client: TestClient) -> None:
    # 20 requests/s arrive, each takes about 0.2 s on the stub, one slot: later requests
    # wait for the slot before they are sent.
    spec = {"input_len": 8, "output_len": 100, "num_prompts": 8, "max_concurrency": 1,
            "request_rate": 20.0}
    run = client.post("/api/runs", json=spec).json()
    assert wait_finished(client, run["id"])["status"] == "succeeded"
    samples = sorted(client.get(f"/api/runs/{run['id']}/requests").json(), key=lambda s: s["index"])
    waits = [s["sent_time"] - s["due_time"] for s in samples]
    assert all(w >= 0 for w in waits)
    assert waits[-1] > waits[0] + 0.05  # the queue builds up
    dues = [s["due_time"] for s in samples]
    assert dues == sorted(dues) and dues[-1] > dues[0]
    export = client.get(f"/api/runs/{run['id']}/export?format=vllm").json()
    assert export["queue_times"] == pytest.approx(waits)
