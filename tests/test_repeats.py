"""Repeats, points with their spread, compare, baselines and regressions, through the API."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from scipy import stats

from service.analysis.intervals import T_LOGS
from service.analysis.metrics import summarize
from service.analysis.summary_intervals import summary_intervals
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.core.status import RunStatus
from service.storage import measurements, store
from service.storage.db import make_engine
from tests.conftest import wait_finished

BASE = {"input_len": 16, "output_len": 6, "num_prompts": 4, "max_concurrency": 2}


def test_sweep_repeats_are_interleaved_trials_with_distinct_seeds(client: TestClient) -> None:
    body = {"base": {**BASE, "seed": 7}, "grid": {"input_len": [8, 16], "mode": ["fill", "prefill"]},
            "repeats": 3}
    sweep = client.post("/api/sweeps", json=body).json()
    runs = sweep["runs"]
    assert sweep["repeats"] == 3 and len(runs) == 12
    # A B C D A B C D A B C D: trial k of every point before trial k + 1 of any.
    assert [r["trial"] for r in runs] == [0] * 4 + [1] * 4 + [2] * 4
    assert [r["spec"]["seed"] for r in runs] == [7] * 4 + [8] * 4 + [9] * 4
    groups = [r["group_id"] for r in runs]
    # The same points in every trial (fill and prefill of a point in an order drawn per pair).
    assert set(groups[:4]) == set(groups[4:8]) == set(groups[8:]) and len(set(groups)) == 4
    done = [wait_finished(client, r["id"]) for r in runs]
    assert all(r["status"] == "succeeded" for r in done)
    started = sorted(done, key=lambda r: r["started_at"])
    assert [r["id"] for r in started] == [r["id"] for r in runs]

    sweep = client.get(f"/api/sweeps/{sweep['id']}").json()
    assert len(sweep["points"]) == 4
    point = sweep["points"][0]
    mine = [r for r in done if r["group_id"] == point["arm"]]
    assert point["succeeded"] == 3 and point["runs"] == [r["id"] for r in mine]
    tpots = [r["summary"]["median_tpot_ms"] for r in mine]
    fig = point["figures"]["median_tpot_ms"]
    lo, hi = stats.t.interval(0.95, 2, loc=np.mean(tpots), scale=stats.sem(tpots))
    method = "Student t over trials"
    if lo <= 0:  # noisy trials: a positive figure's interval is taken on the logs (docs/statistics.md)
        logs = np.log(tpots)
        lo, hi = np.exp(stats.t.interval(0.95, 2, loc=logs.mean(), scale=stats.sem(logs)))
        hi, method = max(hi, np.mean(tpots)), T_LOGS
    assert fig["value"] == pytest.approx(np.mean(tpots))
    assert fig["ci"] == pytest.approx([lo, hi])
    assert fig["cv"] == pytest.approx(np.std(tpots, ddof=1) / np.mean(tpots))
    assert fig["n"] == 3 and fig["method"] == method
    # Fill against prefill at both input lengths, over the pairs, with a verdict.
    assert len(sweep["fill_vs_prefill"]) == 2
    for pair in sweep["fill_vs_prefill"]:
        assert pair["verdict"] in {"matches", "differs", "undecided"}
        assert [r["metric"] for r in pair["ratios"]] == ["decode_median_itl_ms", "decode_median_tpot_ms"]
        assert all(r["method"] == "paired t over pairs" for r in pair["ratios"] if r["ci"])

    group = client.get(f"/api/groups/{point['arm']}").json()
    assert [r["trial"] for r in group["runs"]] == [0, 1, 2]
    assert group["figures"]["median_tpot_ms"] == fig
    page = client.get(f"/groups/{point['arm']}").text
    assert page.count('href="/runs/r-') >= 3 and "CV" in page
    run_page = client.get(f"/runs/{runs[0]['id']}").text
    assert f"Trial 1 of 3 of point <a href=\"/groups/{point['arm']}\"" in run_page
    assert client.get("/api/groups/g-nope").status_code == 404


def test_a_run_with_repeats_is_one_group_and_a_retry_makes_no_more(client: TestClient) -> None:
    headers = {"Idempotency-Key": "three-trials"}
    first = client.post("/api/runs", json={**BASE, "repeats": 3}, headers=headers)
    assert first.status_code == 201
    run = first.json()
    assert run["trial"] == 0 and run["group_id"].startswith("g-")
    again = client.post("/api/runs", json={**BASE, "repeats": 3}, headers=headers)
    assert again.status_code == 200 and again.json()["id"] == run["id"]
    group = client.get(f"/api/groups/{run['group_id']}").json()
    assert [r["spec"]["seed"] for r in group["runs"]] == [0, 1, 2]
    assert client.get("/api/runs").json()["total"] == 3
    done = wait_finished(client, group["runs"][2]["id"])
    # Every summary carries each latency statistic's interval next to vLLM's key.
    summary = done["summary"]
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
                "p99_itl_ms", "decode_median_itl_ms"):
        lo, hi = summary[f"{key}_ci"]
        assert lo <= summary[key] <= hi
    # The export keeps vLLM's keys as they are and carries the intervals in its own block.
    exported = client.get(f"/api/runs/{done['id']}/export").json()
    assert not [k for k in exported if k.endswith("_ci")]
    block = exported["decodebench"]
    assert block["intervals"]["median_tpot_ms_ci"] == summary["median_tpot_ms_ci"]
    assert (block["group_id"], block["trial"], block["seed"]) == (run["group_id"], 2, 2)


@pytest.mark.parametrize(("body", "needle"), [
    ({"base": {**BASE, "repeats": 2}, "grid": {"input_len": [8]}, "repeats": 3}, "disagree"),
    ({"base": BASE, "grid": {"input_len": list(range(1, 65))}, "repeats": 5}, "cap of 256"),
    ({"base": {**BASE, "repeats": 0}, "grid": {"input_len": [8]}}, "greater than or equal to 1"),
    ({"base": {**BASE, "repeats": 33}, "grid": {"input_len": [8]}}, "less than or equal to 32"),
])
def test_bad_repeats_are_422_with_the_reason(shared_client: TestClient, body: dict, needle: str) -> None:
    response = shared_client.post("/api/sweeps", json=body)
    assert response.status_code == 422 and needle in response.text, response.text
    assert shared_client.get("/api/runs").json()["total"] == 0


def test_compare_api_gives_intervals_and_verdicts(client: TestClient) -> None:
    ids = [client.post("/api/runs", json={**BASE, "output_len": n}).json()["id"] for n in (4, 12)]
    for run_id in ids:
        wait_finished(client, run_id)
    result = client.get(f"/api/compare?ids={ids[0]}&ids={ids[1]}").json()
    assert result["reference"] == ids[0] and [a["id"] for a in result["arms"]] == ids
    rows = {m["metric"]: m for m in result["metrics"]}
    tpot = rows["median_tpot_ms"]
    assert tpot["better"] == "lower" and len(tpot["values"]) == 2
    assert all(v["ci"][0] <= v["value"] <= v["ci"][1] for v in tpot["values"])
    change = tpot["changes"][0]
    assert change["method"] == "bootstrap over requests"
    assert change["ci"][0] <= change["ratio"] <= change["ci"][1]
    assert change["verdict"] in {"different", "not distinguishable"}
    # One run a side: the interval holds no drift between runs, and a difference says so.
    assert change["across_runs"] is False
    assert (change["verdict"] == "different") == ("within these two runs" in change["message"])
    # Throughput is one figure per run: no interval without repeats on both sides.
    assert rows["output_throughput"]["changes"][0]["verdict"] == "no interval"
    assert client.get(f"/api/compare?ids={ids[0]},{ids[1]}").json()["metrics"] == result["metrics"]
    one = client.get(f"/api/compare?ids={ids[0]}")
    assert one.status_code == 422 and "2 to 12" in one.text
    assert client.get(f"/api/compare?ids={ids[0]},r-nope").status_code == 404


def test_baseline_marks_a_point_and_later_runs_see_their_change(client: TestClient) -> None:
    queued = client.post("/api/runs", json=BASE).json()["id"]
    base = wait_finished(client, queued)["id"]
    assert client.get(f"/api/runs/{base}/baseline").json()["baseline"] is None
    marked = client.post(f"/api/runs/{base}/baseline")
    assert marked.status_code == 200 and marked.json()["arm"] == base
    assert client.get(f"/api/runs/{base}/baseline").json()["is_baseline"] is True
    later = wait_finished(client, client.post("/api/runs", json={**BASE, "seed": 3}).json()["id"])["id"]
    found = client.get(f"/api/runs/{later}/baseline").json()
    assert found["baseline"] == base and not found["is_baseline"]
    assert [c["metric"] for c in found["changes"]] == [
        "median_tpot_ms", "p99_tpot_ms", "decode_median_itl_ms", "median_ttft_ms"]
    assert "against the baseline" in client.get(f"/runs/{later}").text.lower()
    other = wait_finished(client, client.post("/api/runs", json={**BASE, "input_len": 9}).json()["id"])
    assert client.get(f"/api/runs/{other['id']}/baseline").json()["baseline"] is None
    assert [b["arm"] for b in client.get("/api/baselines").json()] == [base]
    wrong = client.delete(f"/api/runs/{later}/baseline")
    assert wrong.status_code == 409 and "not the baseline" in wrong.text
    assert client.delete(f"/api/runs/{base}/baseline").status_code == 204
    assert client.get(f"/api/runs/{later}/baseline").json()["baseline"] is None
    assert client.get("/api/runs/r-nope/baseline").status_code == 404


def test_only_a_measured_run_can_be_a_baseline(client: TestClient) -> None:
    run = client.post("/api/runs", json={**BASE, "num_prompts": 10_000}).json()["id"]
    assert client.post(f"/api/runs/{run}/cancel").status_code == 200
    assert wait_finished(client, run)["status"] == "cancelled"
    response = client.post(f"/api/runs/{run}/baseline")
    assert response.status_code == 409 and "no succeeded run" in response.text
    assert client.post("/api/runs/r-nope/baseline").status_code == 404


def _finished_run(engine: object, spec: RunSpec, gap_s: float, seed: int) -> str:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(24):
        level = gap_s * rng.normal(1, 0.03)
        gaps = rng.normal(level, 0.05 * level, size=31).tolist()
        samples.append(Sample(index=i, success=True, start_time=i * 0.5, ttft=0.02, itl=gaps,
                              latency=0.02 + sum(gaps), output_tokens=32, prompt_len=spec.input_len))
    run, _ = store.create_run(engine, spec)  # type: ignore[arg-type]
    for status in (RunStatus.starting, RunStatus.running):
        store.transition(engine, run.id, status)  # type: ignore[arg-type]
    measurements.save_samples(engine, run.id, samples)  # type: ignore[arg-type]
    summary = summarize(samples, 12.0) | summary_intervals(samples)
    store.transition(engine, run.id, RunStatus.succeeded, summary=summary)  # type: ignore[arg-type]
    return run.id


def test_regressions_list_points_that_got_significantly_worse(tmp_path: Path) -> None:
    from service.analysis import comparison

    engine = make_engine(tmp_path / "db.sqlite")
    slow_point, steady_point = RunSpec(input_len=64), RunSpec(input_len=128)
    slow_base = _finished_run(engine, slow_point, 0.010, 1)
    steady_base = _finished_run(engine, steady_point, 0.010, 2)
    comparison.mark_baseline(engine, slow_base)
    comparison.mark_baseline(engine, steady_base)
    assert comparison.regressions(engine) == []
    slower = _finished_run(engine, slow_point.model_copy(update={"seed": 1}), 0.011, 3)
    _finished_run(engine, steady_point.model_copy(update={"seed": 1}), 0.010, 4)
    found = comparison.regressions(engine)
    assert [r["latest"] for r in found] == [slower]
    worse = {c["metric"]: c for c in found[0]["worse"]}
    assert worse["median_tpot_ms"]["ratio"] == pytest.approx(1.1, rel=0.03)
    assert worse["median_tpot_ms"]["ci"][0] > 1 and worse["median_tpot_ms"]["direction"] == "worse"
    assert found[0]["point"]["input_len"] == 64 and found[0]["baseline"] == slow_base


def test_cancelling_a_group_cancels_its_unfinished_trials(client: TestClient) -> None:
    run = client.post("/api/runs", json={**BASE, "num_prompts": 10_000, "repeats": 3}).json()
    response = client.post(f"/api/groups/{run['group_id']}/cancel")
    assert response.status_code == 200
    trials = response.json()["runs"]
    assert [wait_finished(client, r["id"])["status"] for r in trials] == ["cancelled"] * 3
    again = client.post(f"/api/groups/{run['group_id']}/cancel")
    assert again.status_code == 409 and "already finished" in again.text
    assert client.post("/api/groups/r-nope/cancel").status_code == 404
