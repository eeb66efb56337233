"""The service's side of the connector protocol: fill parameters and fill reports, per worker."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.conftest import wait_finished

SMALL = {"input_len": 32, "output_len": 4, "num_prompts": 2, "max_concurrency": 2}


def _finished_run(client: TestClient, **spec: Any) -> tuple[dict[str, Any], str]:
    run = client.post("/api/runs", json={**SMALL, **spec}).json()
    done = wait_finished(client, run["id"])
    launcher = client.app.state.scheduler.fleet  # type: ignore[attr-defined]
    token = launcher.tokens[done["worker_id"]]
    return done, token


def test_fill_answers_the_runs_values_and_counts_the_pull(client: TestClient) -> None:
    run, token = _finished_run(client, mode="prefill", fill={"mean": 0.3, "std": 0.1})
    auth = {"Authorization": f"Bearer {token}"}
    response = client.get(f"/api/connector/fill?run_id={run['id']}", headers=auth)
    assert response.status_code == 200
    assert response.json() == {"run_id": run["id"], "mode": "prefill", "mean": 0.3, "std": 0.1}
    # Once by the server's connector (the stub's stand-in) during the run, once here.
    assert client.get(f"/api/runs/{run['id']}").json()["connector"]["pulls"] == 2


def test_fill_for_an_unknown_run_is_404(client: TestClient) -> None:
    _, token = _finished_run(client)
    response = client.get("/api/connector/fill?run_id=r-other",
                          headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 404


def test_report_totals_add_bytes_across_ranks_and_keep_per_rank_counts(client: TestClient) -> None:
    run, token = _finished_run(client)
    auth = {"Authorization": f"Bearer {token}"}
    per_rank = {"requests_filled": 2, "blocks_filled": 10, "bytes_filled": 5000,
                "fill_seconds": 0.01}
    for rank, seconds in ((0, 0.01), (1, 0.03)):
        body = {"role": "worker", "rank": rank,
                "runs": {run["id"]: {**per_rank, "fill_seconds": seconds}}}
        assert client.post("/api/connector/report", json=body, headers=auth).status_code == 204
    body = {"role": "scheduler", "rank": 0,
            "runs": {run["id"]: {"requests_seen": 2, "filled_requests": 1, "unresolved_requests": 1,
                                 "error": "HTTP 404 not this worker's run"}}}
    assert client.post("/api/connector/report", json=body, headers=auth).status_code == 204
    connector = client.get(f"/api/runs/{run['id']}").json()["connector"]
    assert connector["requests_filled"] == 2 and connector["blocks_filled"] == 10
    assert connector["bytes_filled"] == 10_000
    assert connector["fill_seconds"] == 0.03
    assert connector["requests_seen"] == 2 and connector["filled_requests"] == 1
    assert connector["other_requests"] == 1
    assert connector["error"] == "HTTP 404 not this worker's run"
    page = client.get(f"/runs/{run['id']}").text
    assert "10,000" in page
    assert "treated otherwise" in page and "HTTP 404 not this worker&#39;s run" in page


def test_reports_are_cumulative_so_a_repeat_changes_nothing(client: TestClient) -> None:
    run, token = _finished_run(client)
    body = {"role": "worker", "rank": 0, "runs": {run["id"]: {"requests_filled": 2}}}
    for _ in range(3):
        client.post("/api/connector/report", json=body,
                    headers={"Authorization": f"Bearer {token}"})
    assert client.get(f"/api/runs/{run['id']}").json()["connector"]["requests_filled"] == 2


def test_report_needs_a_worker_token_and_rejects_unknown_counters(client: TestClient) -> None:
    run, token = _finished_run(client)
    body = {"role": "worker", "rank": 0, "runs": {run["id"]: {"requests_filled": 1}}}
    assert client.post("/api/connector/report", json=body).status_code == 401
    assert client.post("/api/connector/report", json=body,
                       headers={"Authorization": "Bearer nope"}).status_code == 401
    bad = {"role": "worker", "rank": 0, "runs": {run["id"]: {"rm -rf": 1}}}
    response = client.post("/api/connector/report", json=bad,
                           headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 422


def test_report_for_another_workers_run_is_ignored(client: TestClient) -> None:
    first, _ = _finished_run(client)
    second, token = _finished_run(client, engine={"extra_args": ["--max-num-seqs=2"]})
    assert first["worker_id"] != second["worker_id"]
    body = {"role": "worker", "rank": 0, "runs": {first["id"]: {"requests_filled": 99}}}
    client.post("/api/connector/report", json=body, headers={"Authorization": f"Bearer {token}"})
    # What the first run's own server reported stays; the other worker's claim is dropped.
    assert client.get(f"/api/runs/{first['id']}").json()["connector"]["requests_filled"] == 2
