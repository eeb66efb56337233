"""The service's /metrics, read as Prometheus reads it."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.core.status import RunStatus
from tests.conftest import make_client, wait_finished

SMALL = {"input_len": 8, "output_len": 4, "num_prompts": 1}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(client: TestClient) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and every family's type by name."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(response.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def _runs(samples: Samples) -> dict[str, float]:
    return {dict(labels)["status"]: v for (name, labels), v in samples.items()
            if name == "decodebench_runs"}


def _workers(samples: Samples) -> dict[str, float]:
    return {dict(labels)["status"]: v for (name, labels), v in samples.items()
            if name == "decodebench_workers"}


def test_a_fresh_service_shows_every_run_status_at_zero(client: TestClient) -> None:
    samples, types = _scrape(client)
    assert _runs(samples) == {s.value: 0 for s in RunStatus}
    assert _workers(samples) == {}
    assert samples[("decodebench_connector_pulls_total", ())] == 0
    assert samples[("decodebench_scheduler_up", ())] == 1
    assert types == {"decodebench_runs": "gauge", "decodebench_workers": "gauge",
                     "decodebench_connector_pulls": "counter", "decodebench_scheduler_up": "gauge"}


def test_runs_workers_and_pulls_are_counted_as_they_stand_at_the_scrape(
    client: TestClient,
) -> None:
    done = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert done["status"] == "succeeded", done["error"]
    before, _ = _scrape(client)
    # A long run (seconds on the stub), cancelled: it cannot have finished by itself first.
    long = client.post("/api/runs", json={**SMALL, "output_len": 2000}).json()
    assert client.post(f"/api/runs/{long['id']}/cancel").status_code == 200
    cancelled = wait_finished(client, long["id"])
    assert cancelled["status"] == "cancelled"

    samples, _ = _scrape(client)
    assert _runs(before) == {**{s.value: 0 for s in RunStatus}, "succeeded": 1}
    assert _runs(samples) == {**{s.value: 0 for s in RunStatus}, "succeeded": 1, "cancelled": 1}
    assert _workers(samples) == {"ready": 1}
    pulls = sum(client.get(f"/api/runs/{r['id']}").json()["connector"]["pulls"]
                for r in (done, cancelled))
    assert pulls >= 1  # the stub's stand-in for the connector pulled the first run's values
    assert samples[("decodebench_connector_pulls_total", ())] == pulls


def test_each_app_reports_its_own_database(tmp_path: Path) -> None:
    with make_client(tmp_path / "a") as a, make_client(tmp_path / "b") as b:
        assert wait_finished(a, a.post("/api/runs", json=SMALL).json()["id"])["status"] == "succeeded"
        seen_a, _ = _scrape(a)
        seen_b, _ = _scrape(b)
    assert _runs(seen_a)["succeeded"] == 1
    assert _runs(seen_b) == {s.value: 0 for s in RunStatus}
