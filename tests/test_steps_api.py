"""A run's engine steps through the service: the stub times steps of a known cost, the
connector report stores them, ``GET /api/runs/{id}/steps`` fits them back, the run page
draws them; and how the store keeps them (the cap and its bins, a report sent twice, a
deleted run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.analysis.step_model import fit
from service.core.spec import RunSpec
from service.core.steps import StepRow
from service.storage import steps, store
from service.storage.db import make_engine, upgrade, write_session
from service.storage.tables import Run
from tests.conftest import wait_finished

TRUTH = {"fixed": 5.0, "per_kv": 400.0, "per_req": 0.8, "noise": 0.02, "first": 2.0}
# Poisson arrivals at 12/s against 6 slots of half-second streams: the batch moves between
# 1 and 6 through the run, so the fixed and per-request costs are told apart.
SPEC = {"input_len": 1024, "range_ratio": 0.5, "output_len": 48, "num_prompts": 24,
        "max_concurrency": 6, "request_rate": 12}


def holds(figure: list[float] | None, value: float) -> bool:
    return figure is not None and figure[1] <= value <= figure[2]


def test_a_run_on_a_stub_of_known_step_cost_gets_it_back(stub_service: Any) -> None:
    client = stub_service({"STUB_STEP_MS": json.dumps(TRUTH), "STUB_TOKEN_INTERVAL_S": "0.01"})
    run = wait_finished(client, client.post("/api/runs", json=SPEC).json()["id"])
    assert run["status"] == "succeeded", run["error"]
    found = client.get(f"/api/runs/{run['id']}/steps").json()
    assert found["steps"] >= 100 and found["prefill_steps"] == 0
    # Every request's first step was apart, on the whole (a few may share one step).
    assert 12 <= found["first_steps"] <= 24
    assert "Newey-West" in found["method"] and found["batch"] is None
    assert len(found["points"]) == found["steps"] + found["first_steps"]
    assert {p["kind"] for p in found["points"]} == {"decode", "first"}
    # Each 95% interval holds its truth 95% of the time (test_step_model shows it over 800
    # simulated runs; 32 runs of this test gave each figure's error over its stated standard
    # error a spread of 0.96-1.05). The check reads the 99.99% ones, so that four of them hold
    # together all but about once in 2,500 runs: at 99.9% (once in 250) the first-step ratio
    # missed once in about 20 fresh-clone CI runs, 1.970 in [1.942, 1.997] for 2.
    wide = client.get(f"/api/runs/{run['id']}/steps", params={"confidence": 0.9999}).json()
    assert holds(wide["fixed_ms"], TRUTH["fixed"]), wide
    assert holds(wide["ns_per_kv_token"], TRUTH["per_kv"]), wide
    assert holds(wide["ms_per_request"], TRUTH["per_req"]), wide
    assert holds(wide["first_step_ratio"], TRUTH["first"]), wide
    for key in ("fixed_ms", "ns_per_kv_token", "ms_per_request", "first_step_ratio"):
        value, lo, hi = found[key]
        assert wide[key][0] == value and wide[key][1] < lo < value < hi < wide[key][2]
    # Capped at 0.9999: near 1 the t quantile, and so the interval, is infinite, which JSON
    # cannot carry.
    certain = client.get(f"/api/runs/{run['id']}/steps", params={"confidence": 0.99999})
    assert certain.status_code == 422 and "less than or equal to 0.9999" in certain.text

    page = client.get(f"/runs/{run['id']}")
    assert page.status_code == 200
    assert 'id="steps"' in page.text and "Forward time per engine step" in page.text
    assert 'id="step-model"' in page.text and "first steps" in page.text


def test_a_run_whose_server_times_no_steps_says_why(client: Any) -> None:
    run = wait_finished(client, client.post("/api/runs", json={**SPEC, "request_rate": None,
                                                               "num_prompts": 6}).json()["id"])
    found = client.get(f"/api/runs/{run['id']}/steps")
    assert found.status_code == 200
    body = found.json()
    assert body["steps"] == body["first_steps"] == body["prefill_steps"] == 0
    assert body["fixed_ms"] is body["ns_per_kv_token"] is body["ms_per_request"] is None
    assert body["points"] == [] and "connector" in body["notes"][0]
    page = client.get(f"/runs/{run['id']}").text
    assert "no engine steps were reported" in page and "Forward time per engine step" not in page


def test_an_unknown_run_is_404(client: Any) -> None:
    response = client.get("/api/runs/r-nothere/steps")
    assert response.status_code == 404
    assert response.json() == {"detail": "run 'r-nothere' not found"}


@pytest.fixture
def engine_with_run(tmp_path: Path) -> tuple[Any, str]:
    engine = make_engine(tmp_path / "db.sqlite")
    upgrade(engine)
    run, _ = store.create_run(engine, RunSpec())
    with write_session(engine) as session:
        row = session.get(Run, run.id)
        assert row is not None
        row.worker_id, row.status = "w-1", "succeeded"
        session.add(row)
    return engine, run.id


def _steps(n: int, seed: int = 0) -> list[StepRow]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        batch = 2 + (i // 50) % 4
        kv = 4000.0 * batch + 3 * (i % 50)
        ms = 4.0 + 100 * kv / 1e6 + 0.5 * batch
        rows.append(StepRow(step=i, decode_requests=batch, prefill_tokens=0, kv_tokens=kv,
                            first=1 if i % 50 == 0 else 0, forward_ms=ms * (1 + 0.02 * rng.normal())))
    return rows


def test_steps_past_the_cap_are_binned_and_fit_alike(engine_with_run: tuple[Any, str]) -> None:
    engine, run_id = engine_with_run
    rows = _steps(2000)
    assert steps.record_steps(engine, "w-1", {run_id: rows}, cap=300) == 2000
    stored = steps.run_steps(engine, run_id)
    assert len(stored) < 700 and sum(r.count for r in stored) == 2000
    assert steps.count_steps(engine, run_id) == 2000
    assert any(r.count > 1 for r in stored)
    whole, binned = fit(rows), fit(stored)
    assert binned.steps == whole.steps and binned.first_steps == whole.first_steps
    for a, b in ((whole.fixed_ms, binned.fixed_ms), (whole.ns_per_kv_token, binned.ns_per_kv_token),
                 (whole.ms_per_request, binned.ms_per_request)):
        assert a is not None and b is not None
        assert b.lo <= a.value <= b.hi and a.lo <= b.value <= a.hi


def test_a_report_sent_twice_stores_each_step_once(engine_with_run: tuple[Any, str]) -> None:
    engine, run_id = engine_with_run
    rows = _steps(400)
    assert steps.record_steps(engine, "w-1", {run_id: rows[:250]}, cap=300) == 250
    # Sent again with the next ones: only the new are stored, past the cap binned.
    assert steps.record_steps(engine, "w-1", {run_id: rows}, cap=300) == 150
    assert steps.record_steps(engine, "w-1", {run_id: rows}, cap=300) == 0
    assert steps.count_steps(engine, run_id) == 400
    # Another worker's report of the run is not trusted.
    assert steps.record_steps(engine, "w-2", {run_id: _steps(500)[450:]}, cap=300) == 0


def test_deleting_a_run_deletes_its_steps(stub_service: Any) -> None:
    client = stub_service({"STUB_STEP_MS": json.dumps(TRUTH)})
    run = wait_finished(client, client.post("/api/runs", json={**SPEC, "num_prompts": 6,
                                                               "request_rate": None}).json()["id"])
    engine = client.app.state.engine
    assert steps.count_steps(engine, run["id"]) > 0
    assert client.delete(f"/api/runs/{run['id']}").status_code == 204
    assert steps.count_steps(engine, run["id"]) == 0 and steps.run_steps(engine, run["id"]) == []
