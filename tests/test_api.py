"""REST API behaviour: validation (4xx with a message, never a 500), idempotency, errors."""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine

from tests.conftest import wait_finished


def _detail_text(response: Any) -> str:
    return str(response.json()["detail"])


def test_submit_returns_201_with_the_run_queued_and_defaults_filled(client: TestClient) -> None:
    response = client.post("/api/runs", json={"input_len": 64, "output_len": 4, "num_prompts": 2})
    assert response.status_code == 201
    run = response.json()
    assert run["status"] in {"queued", "starting", "running", "succeeded"}
    assert run["spec"]["model"] == "decodebench-tiny"
    assert run["spec"]["fill"] == {"mean": 0.015, "std": 0.0, "startup": False}
    assert run["spec"]["max_concurrency"] == 8
    assert run["progress"]["total"] == 2


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_len": 0}, "input_len"),
        ({"input_len": "lots"}, "input_len"),
        ({"num_prompts": -3}, "num_prompts"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"mode": "magic"}, "mode"),
        ({"fill": {"std": -1}}, "std"),
        ({"model": "--trust-remote-code"}, "model"),
        ({"model": "../../etc"}, "model"),
        ({"model": "https://example.com/model"}, "model"),
        ({"engine": {"extra_args": ["--trust-remote-code"]}}, "not allowed"),
        ({"engine": {"extra_args": ["--max-num-seqs=abc"]}}, "positive integer"),
        ({"input_len": 131072, "output_len": 128}, "max length"),
        ({"request_rate": 0}, "request_rate"),
        ({"ramp_up": {"strategy": "exponential", "start_rps": 0, "end_rps": 16}}, "start_rps"),
        ({"ramp_up": {"strategy": "linear", "start_rps": 0, "end_rps": 16}}, "greater than 0"),
        ({"ramp_up": {"strategy": "linear", "start_rps": 10, "end_rps": 2}}, "must not be above"),
        ({"ramp_up": {"strategy": "linear", "start_rps": 1}}, "end_rps"),
        ({"ramp_up": {"strategy": "quadratic", "start_rps": 1, "end_rps": 2}}, "exponential"),
        ({"ramp_up": {"strategy": "linear", "start_rps": 1, "end_rps": 2, "shape": 3}}, "shape"),
        ({"request_rate": 5, "ramp_up": {"strategy": "linear", "start_rps": 1, "end_rps": 10}},
         "leave request_rate null"),
        ({"engine": {"kv_cache_gib": 2, "gpu_memory_utilization": 0.5}}, "not both"),
        ({"engine": {"kv_cache_gib": 0}}, "kv_cache_gib"),
    ],
)
def test_bad_spec_is_422_with_a_message(shared_client: TestClient, body: dict[str, Any], needle: str) -> None:
    response = shared_client.post("/api/runs", json=body)
    assert response.status_code == 422, response.text
    assert needle in _detail_text(response)


def test_sweep_of_request_rates_over_a_ramp_up_is_422(shared_client: TestClient) -> None:
    base = {"num_prompts": 2, "ramp_up": {"strategy": "linear", "start_rps": 1, "end_rps": 10}}
    response = shared_client.post("/api/sweeps", json={"base": base, "grid": {"request_rate": [None, 4.0]}})
    assert response.status_code == 422, response.text
    assert "leave request_rate null" in _detail_text(response)
    assert shared_client.get("/api/runs").json()["total"] == 0


def test_body_that_is_not_json_is_422(shared_client: TestClient) -> None:
    response = shared_client.post("/api/runs", content=b"{nope", headers={"Content-Type": "application/json"})
    assert response.status_code == 422


def test_body_over_the_limit_is_413(shared_client: TestClient) -> None:
    response = shared_client.post(
        "/api/runs", content=b" " * (2 << 20), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert "over" in _detail_text(response)


def test_unknown_run_is_404_in_every_route(shared_client: TestClient) -> None:
    for path in ("/api/runs/r-nope", "/api/runs/r-nope/requests", "/api/runs/r-nope/export",
                 "/runs/r-nope"):
        response = shared_client.get(path)
        assert response.status_code == 404, path
        assert "r-nope" in _detail_text(response)
    assert shared_client.post("/api/runs/r-nope/cancel").status_code == 404


def test_list_with_unknown_status_is_422(shared_client: TestClient) -> None:
    assert shared_client.get("/api/runs?status=sleeping").status_code == 422
    assert shared_client.get("/api/runs?limit=0").status_code == 422


def test_same_idempotency_key_and_body_gives_the_same_run(client: TestClient) -> None:
    body = {"input_len": 32, "output_len": 2, "num_prompts": 1}
    first = client.post("/api/runs", json=body, headers={"Idempotency-Key": "k1"})
    again = client.post("/api/runs", json=body, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 201
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert client.get("/api/runs").json()["total"] == 1


def test_same_idempotency_key_with_another_body_is_422(client: TestClient) -> None:
    client.post("/api/runs", json={"num_prompts": 1, "input_len": 8}, headers={"Idempotency-Key": "k2"})
    response = client.post(
        "/api/runs", json={"num_prompts": 2, "input_len": 8}, headers={"Idempotency-Key": "k2"}
    )
    assert response.status_code == 422
    assert "Idempotency-Key" in _detail_text(response)


def test_cancel_finished_run_is_409(client: TestClient) -> None:
    run = client.post("/api/runs", json={"input_len": 16, "output_len": 2, "num_prompts": 1}).json()
    finished = wait_finished(client, run["id"])
    assert finished["status"] == "succeeded"
    response = client.post(f"/api/runs/{run['id']}/cancel")
    assert response.status_code == 409
    assert "already finished" in _detail_text(response)


def test_connector_fill_without_token_is_401(client: TestClient) -> None:
    run = client.post("/api/runs", json={"num_prompts": 1, "input_len": 8, "output_len": 2}).json()
    assert client.get(f"/api/connector/fill?run_id={run['id']}").status_code == 401
    response = client.get(
        f"/api/connector/fill?run_id={run['id']}", headers={"Authorization": "Bearer wrong"}
    )
    assert response.status_code == 401


def test_healthz_reports_db_and_scheduler(shared_client: TestClient) -> None:
    body = shared_client.get("/healthz").json()
    assert body == {"status": "ok", "db": "ok", "scheduler": "ok"}


SECRET = "/srv/secret-volume/decodebench.sqlite3"


def _unreachable() -> sqlite3.Connection:
    raise sqlite3.OperationalError(f"unable to open database file {SECRET}")


def test_healthz_of_a_broken_database_says_so_without_its_error_text(
        client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    app = client.app
    working = app.state.engine  # type: ignore[attr-defined]
    broken = create_engine("sqlite://", creator=_unreachable)
    app.state.engine = broken  # type: ignore[attr-defined]
    try:
        with caplog.at_level(logging.ERROR):
            response = client.get("/healthz")
    finally:
        app.state.engine = working  # type: ignore[attr-defined]
        broken.dispose()
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "db": "database unavailable", "scheduler": "ok"}
    assert "secret" not in response.text and "sqlite" not in response.text.lower()
    # The operator still finds the cause in the service's log.
    assert SECRET in caplog.text


def test_openapi_documents_every_route(shared_client: TestClient) -> None:
    paths = shared_client.get("/openapi.json").json()["paths"]
    for path in ("/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/cancel",
                 "/api/runs/{run_id}/requests", "/api/runs/{run_id}/export",
                 "/api/workers", "/api/connector/fill"):
        assert path in paths
        for op in paths[path].values():
            assert op.get("description") or op.get("summary")
