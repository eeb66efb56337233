"""The engine's own clock on a real vLLM (CPU) server: the connector inside vLLM times every
forward pass and says what the step held; the service keeps the steps per run and fits the
run's step model (``GET /api/runs/{id}/steps``), for fill, prefill and seeded runs alike.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import wait_finished

pytestmark = pytest.mark.e2e

# Each run's prompts are its own (distinct seeds): no prefix cache helps a prefill run.
RUN = {"input_len": 2048, "output_len": 48, "num_prompts": 8, "max_concurrency": 4}


@pytest.fixture(scope="module")
def service(real_tiny_service: httpx.Client) -> httpx.Client:
    return real_tiny_service  # one service and tiny server for the tiny model's e2e modules


def _run(client: httpx.Client, **spec: Any) -> dict[str, Any]:
    response = client.post("/api/runs", json={**RUN, **spec})
    assert response.status_code == 201, response.text
    done = wait_finished(client, response.json()["id"], timeout=600)
    assert done["status"] == "succeeded", done["error"]
    return done


def _steps(client: httpx.Client, run: dict[str, Any]) -> dict[str, Any]:
    """The run's step model, once the connector's last report is in (it sends every second)."""
    answer = client.get(f"/api/runs/{run['id']}/steps")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


@pytest.mark.parametrize("mode", ["fill", "prefill", "seeded"])
def test_every_mode_gets_its_steps_timed_inside_vllm(service: httpx.Client, mode: str) -> None:
    run = _run(service, mode=mode, seed={"fill": 11, "prefill": 12, "seeded": 13}[mode])
    connector = run["connector"]
    # The worker timed the run's steps and the service kept every one it was sent.
    assert connector["steps_timed"] > 0 and connector["steps_dropped"] == 0, connector
    steps = _steps(service, run)
    counted = steps["steps"] + steps["first_steps"] + steps["prefill_steps"]
    assert 0 < counted <= connector["steps_timed"]
    # Each wave's first decode step is counted apart: after a fill (or a prefix-cache hit)
    # it computes the last prompt token; after a real prefill the first token's step.
    assert steps["first_steps"] >= 1
    if mode == "prefill":
        # Real prefills ran (2,048 tokens each) and never entered the fit; steps where a
        # prompt's chunk ran beside decodes are prefill steps too, so fewer decode steps are
        # left than in a fill run (how many depends on when the requests arrived).
        assert steps["prefill_steps"] >= 2
    else:
        # 8 requests of 48 tokens at 4 at a time: two waves of about 48 decode steps each.
        assert steps["steps"] >= 60, steps
    if mode == "fill":
        # No prompt computed but the last token of each request (a decode step). A seeded
        # run's seeding pass prefilled its prompts under its id: those are its prefill steps.
        assert steps["prefill_steps"] == 0, steps
    # The fit, on the decode steps: its figures are intervals, over steps that took time.
    assert steps["steps"] >= 20, steps
    assert steps["fixed_ms"][1] <= steps["fixed_ms"][0] <= steps["fixed_ms"][2]
    assert steps["method"]
    decode = [p for p in steps["points"] if p["kind"] == "decode"]
    assert decode and all(p["forward_ms"] > 0 for p in decode)
    if mode != "prefill":
        assert steps["first_step_ratio"] is not None
