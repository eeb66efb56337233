"""Sweeps: one run per grid point, kept together, validated as a whole."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import wait_finished, wait_for

BASE = {"input_len": 16, "output_len": 4, "num_prompts": 2, "max_concurrency": 2}


def test_sweep_makes_one_run_per_point_and_they_share_a_worker(client: TestClient) -> None:
    body = {"base": BASE, "grid": {"input_len": [8, 32], "max_concurrency": [1, 2],
                                   "fill.mean": [0.1, 0.9]}}
    response = client.post("/api/sweeps", json=body)
    assert response.status_code == 201, response.text
    sweep = response.json()
    assert sweep["progress"]["total"] == 8
    points = {(r["spec"]["input_len"], r["spec"]["max_concurrency"], r["spec"]["fill"]["mean"])
              for r in sweep["runs"]}
    assert points == {(i, c, m) for i in (8, 32) for c in (1, 2) for m in (0.1, 0.9)}
    done = [wait_finished(client, r["id"]) for r in sweep["runs"]]
    assert all(r["status"] == "succeeded" for r in done)
    assert len({r["worker_id"] for r in done}) == 1
    again = client.get(f"/api/sweeps/{sweep['id']}").json()
    assert again["progress"]["finished"] == again["progress"]["succeeded"] == 8
    page = client.get(f"/sweeps/{sweep['id']}")
    assert page.status_code == 200
    runs_table = page.text.split('id="points"')[1].split("</table>")[0]
    assert runs_table.count('href="/runs/r-') == 8
    assert set(re.findall(r"/runs/(r-[0-9a-f]+)", page.text)) == {r["id"] for r in done}


@pytest.mark.parametrize(
    ("grid", "needle"),
    [
        ({"seed": [1, 2]}, "'seed'"),
        ({"input_len": []}, "at least 1 item"),
        ({"input_len": list(range(1, 20)), "output_len": list(range(1, 20))}, "cap of 256"),
        ({"input_len": [8, -1]}, "greater than or equal to 1"),
        ({"input_len": [130_000], "output_len": [60_000]}, "grid point"),
        ({"mode": ["fill", "magic"]}, "'fill', 'prefill' or 'seeded'"),
        ({}, "sweeps nothing"),
    ],
)
def test_bad_grid_is_422_and_creates_nothing(shared_client: TestClient, grid: dict[str, Any],
                                             needle: str) -> None:
    response = shared_client.post("/api/sweeps", json={"base": BASE, "grid": grid})
    assert response.status_code == 422, response.text
    assert needle in str(response.json()["detail"])
    assert shared_client.get("/api/runs").json()["total"] == 0


def test_unknown_sweep_is_404(client: TestClient) -> None:
    assert client.get("/api/sweeps/s-nope").status_code == 404
    assert client.get("/sweeps/s-nope").status_code == 404


def test_points_that_do_not_fit_the_kv_cache_are_marked_infeasible(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STUB_KV_BLOCKS", "100")  # 1,600 tokens
    # 1,004 tokens fit one request (vLLM fits its length to 1,584), not two at once.
    body = {"base": BASE, "grid": {"input_len": [64, 1000]}}
    sweep = client.post("/api/sweeps", json=body).json()
    small, big = (wait_finished(client, r["id"]) for r in sweep["runs"])
    assert small["status"] == "succeeded"
    assert big["status"] == "failed"
    assert big["error"].startswith("infeasible: 2 requests at once x 1,004 tokens each")
    assert "= 2,008 tokens" in big["error"] and "holds 1,600" in big["error"]
    assert client.get(f"/api/runs/{big['id']}/requests").json() == []
    again = client.get(f"/api/sweeps/{sweep['id']}").json()
    assert again["progress"]["infeasible"] == 1
    assert "infeasible" in client.get(f"/sweeps/{sweep['id']}").text
    assert client.get("/api/workers").json()[0]["kv_tokens"] == 1600


def test_cancel_sweep_ends_its_runs_and_delete_then_removes_it(client: TestClient) -> None:
    body = {"base": {**BASE, "num_prompts": 2000, "output_len": 64}, "grid": {"max_concurrency": [1, 2]}}
    sweep = client.post("/api/sweeps", json=body).json()
    first = sweep["runs"][0]["id"]
    wait_for(client, first, lambda r: r["status"] == "running" and r["progress"]["completed"] > 0)
    refused = client.delete(f"/api/sweeps/{sweep['id']}")
    assert refused.status_code == 409, refused.text
    assert "cancel it first" in refused.json()["detail"]

    response = client.post(f"/api/sweeps/{sweep['id']}/cancel")
    assert response.status_code == 200, response.text
    cancelled = response.json()
    assert cancelled["id"] == sweep["id"]
    assert cancelled["progress"]["cancelled"] == cancelled["progress"]["total"] == 2
    assert {r["status"] for r in cancelled["runs"]} == {"cancelled"}
    # The run being measured kept what it measured.
    assert client.get(f"/api/runs/{first}/requests").json()
    again = client.post(f"/api/sweeps/{sweep['id']}/cancel")
    assert again.status_code == 409 and "nothing to cancel" in again.json()["detail"]

    # The cancelled run may still be saving what it measured for a moment: the delete says
    # so (409, "in a moment") and succeeds once it is saved.
    deadline = time.monotonic() + 20
    while (deleted := client.delete(f"/api/sweeps/{sweep['id']}")).status_code == 409:
        assert "still saving" in deleted.json()["detail"], deleted.text
        assert time.monotonic() < deadline, "the cancelled run never finished saving"
        time.sleep(0.1)
    assert deleted.status_code == 204, deleted.text
    assert client.get(f"/api/sweeps/{sweep['id']}").status_code == 404
    assert all(client.get(f"/api/runs/{r['id']}").status_code == 404 for r in sweep["runs"])
    assert client.get("/api/sweeps").json()["total"] == 0
    assert client.get("/api/runs").json()["total"] == 0


def test_cancel_and_delete_of_an_unknown_sweep_are_404(client: TestClient) -> None:
    for response in (client.post("/api/sweeps/s-nope/cancel"), client.delete("/api/sweeps/s-nope")):
        assert response.status_code == 404
        assert "sweep 's-nope' not found" in response.json()["detail"]
