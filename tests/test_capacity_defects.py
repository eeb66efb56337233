"""The capacity search's defects (issue 46, item 8), each held by a test through a real
service on stub servers: a search too large for one run is refused at submit; a look that
raises ends its search ``failed`` and its GET still answers; a probe failed at placement
does not hold up the queue, and moves from ``queued`` to ``failed`` in one write; a probe
run of an active search cannot be deleted; the CLI's follow of a search nobody advances
gives up."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from rich.console import Console
from sqlalchemy import Engine, text, update
from sqlmodel import Session, col

from service.analysis.capacity import plan_for
from service.cli.client import ApiError, Client
from service.cli.follow import follow_capacity
from service.control import capacity as capacity_control
from service.core.capacity import CapacityCreate
from service.core.errors import Conflict
from service.core.status import RunStatus
from service.settings import Settings
from service.storage import capacity as capacity_store
from service.storage import store
from service.storage.db import make_engine
from service.storage.tables import CapacitySearch, Run
from tests.conftest import API_TOKEN, AUTH, ServedTestClient, make_client, make_settings, wait_finished
from tests.test_capacity import SLA, wait_search

FAST = {"STUB_TOKEN_INTERVAL_S": "0.002"}
SEARCH = {"base": {"output_len": 8}, "input_lens": [64], "sla": SLA, "max_concurrency": 4}


def _stored_search(tmp_path: Path) -> tuple[Settings, Engine, str]:
    """Settings for a service not yet started, its store, and a search stored there (its
    first probe's two trials queued)."""
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    body = CapacityCreate.model_validate(SEARCH)
    return settings, engine, capacity_store.create_search(engine, body, plan_for(4).as_dict()).id


def _run_ids(search: dict[str, Any]) -> list[str]:
    return [r for c in search["contexts"] for p in c["probes"] for r in p["run_ids"]]


# --- 1. the size of a search's largest probe ---------------------------------------------------


@pytest.fixture
def small_runs(tmp_path: Path) -> Iterator[TestClient]:
    """A service whose runs may ask for at most 10,000 output tokens."""
    with make_client(tmp_path, max_run_output_tokens=10_000) as client:
        yield client


def test_a_search_whose_ceiling_probe_is_over_the_run_size_limit_is_a_422_naming_it(
        small_runs: TestClient) -> None:
    # The probe at 64 sends 4 x 64 = 256 requests: 256 x 100 = 25,600 output tokens.
    body = {"base": {"output_len": 100}, "input_lens": [64], "sla": SLA, "max_concurrency": 64}
    response = small_runs.post("/api/capacity", json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert "the probe at max_concurrency 64 sends 256 requests" in detail
    assert "256 x 100 = 25,600 output tokens" in detail
    assert "at most 10,000 (DECODEBENCH_MAX_RUN_OUTPUT_TOKENS)" in detail
    # What would fit: 100 requests of 100 tokens, a probe at 25.
    assert "max_concurrency at most 25" in detail
    assert small_runs.get("/api/capacity").json()["total"] == 0
    assert small_runs.get("/api/runs").json()["total"] == 0


def test_the_default_ceiling_is_held_to_the_run_size_limit_too(small_runs: TestClient) -> None:
    # No max_concurrency: the default ceiling of 1024, 4,096 requests of 8 tokens.
    body = {"base": {"output_len": 8}, "input_lens": [64], "sla": SLA}
    response = small_runs.post("/api/capacity", json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert "the default ceiling" in detail and "4,096 x 8 = 32,768 output tokens" in detail
    assert "max_concurrency at most 312" in detail
    # Where even the first probe is too large, no ceiling helps: output_len is named.
    body = {"base": {"output_len": 1000}, "input_lens": [64], "sla": SLA, "max_concurrency": 1}
    detail = small_runs.post("/api/capacity", json=body).json()["detail"]
    assert "16 x 1,000 = 16,000 output tokens" in detail and "lower output_len" in detail


def test_a_measured_prefill_side_is_held_to_the_run_size_limit_at_its_highest_rate(
        small_runs: TestClient) -> None:
    # Its run at max_rate 512/s lasts 60 s: 30,720 requests of one output token.
    body = {**SEARCH, "prefill": {"ttft_p99_max_ms": 500, "max_rate": 512}}
    response = small_runs.post("/api/capacity", json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert "the prefill run at max_rate 512/s sends 30,720 requests" in detail
    assert "at most 10,000" in detail
    assert small_runs.get("/api/runs").json()["total"] == 0


def test_a_search_within_the_run_size_limit_is_taken(small_runs: TestClient) -> None:
    body = {"base": {"output_len": 100}, "input_lens": [64], "sla": SLA, "max_concurrency": 25}
    response = small_runs.post("/api/capacity", json=body)
    assert response.status_code == 201, response.text
    assert small_runs.post(f"/api/capacity/{response.json()['id']}/cancel").status_code == 200


# --- 2. a look that raises ---------------------------------------------------------------------


def test_a_look_that_raises_ends_the_search_failed_with_the_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The search's stored base no longer validates (as an older version wrote it): the look
    # after its first probe cannot make the next probe's run.
    for key, value in FAST.items():
        monkeypatch.setenv(key, value)
    settings, engine, search_id = _stored_search(tmp_path)
    with Session(engine) as session:
        base = {**capacity_store.get_search(engine, search_id)[0].base, "output_len": 0}
        session.execute(update(CapacitySearch).where(col(CapacitySearch.id) == search_id).values(base=base))
        session.commit()
    engine.dispose()
    with ServedTestClient(settings, headers=AUTH) as client:
        done = wait_search(client, search_id, timeout=60)
        assert done["status"] == "failed", done
        assert "its look failed" in done["error"] and "output_len" in done["error"]
        assert done["finished_at"] is not None
        listed = client.get("/api/capacity").json()["searches"][0]
        assert listed["status"] == "failed"


def test_a_search_whose_runs_cannot_be_read_answers_200_and_ends_failed(tmp_path: Path) -> None:
    # A probe run's stored spec lacks a field this version reads: the look (at the start,
    # catching up) and the GET both read it.
    settings, engine, search_id = _stored_search(tmp_path)
    runs = capacity_store.get_search(engine, search_id)[1]
    run = runs[1]
    with Session(engine) as session:
        spec = {k: v for k, v in run.spec.items() if k != "max_concurrency"}
        session.execute(update(Run).where(col(Run.id) == run.id).values(spec=spec))
        session.commit()
    engine.dispose()
    with ServedTestClient(settings, headers=AUTH) as client:
        response = client.get(f"/api/capacity/{search_id}")
        assert response.status_code == 200, response.text
        found = response.json()
        assert found["status"] == "failed" and "max_concurrency" in found["error"]
        assert found["contexts"] == [] and found["runs"] == 2
        # Its queued runs were cancelled with it: nothing is left to run for a search that ended.
        assert [client.get(f"/api/runs/{r.id}").json()["status"] for r in runs] == ["cancelled"] * 2
        assert client.get(f"/capacity/{search_id}").status_code == 200
        assert client.get(f"/api/capacity/{search_id}/export").status_code == 200


def test_a_stored_look_this_version_cannot_read_answers_200_and_ends_the_search_failed(
        tmp_path: Path) -> None:
    # A look whose figure is no interval (as a damaged row or another version might leave
    # it): its search's records are validated on read, so the look at the start (catching
    # up) ends it failed naming the field, and its GET and page still answer.
    settings, engine, search_id = _stored_search(tmp_path)
    looks = {"64:1": {"runs": ["r-x"], "confidence": 0.99, "figure": ["fast", None, None]}}
    with Session(engine) as session:
        session.execute(update(CapacitySearch).where(col(CapacitySearch.id) == search_id).values(looks=looks))
        session.commit()
    engine.dispose()
    with ServedTestClient(settings, headers=AUTH) as client:
        done = wait_search(client, search_id, timeout=60)
        assert done["status"] == "failed", done
        assert "its look failed" in done["error"] and "figure" in done["error"], done["error"]
        assert client.get(f"/capacity/{search_id}").status_code == 200


def test_the_cli_follow_of_a_search_nobody_advances_gives_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in FAST.items():
        monkeypatch.setenv(key, value)
    with make_client(tmp_path) as served, contextlib.closing(Client(served.control_url, API_TOKEN)) as client:
        # Its look waits on this lock: the search stays active once its first probe's runs end.
        with capacity_control._LOOKING:
            search = served.post("/api/capacity", json=SEARCH).json()
            for run_id in _run_ids(search):
                wait_finished(served, run_id, timeout=60)
            started = time.monotonic()
            with pytest.raises(ApiError) as raised:
                follow_capacity(client, search["id"], Console(quiet=True), look_wait_s=1.0)
            assert time.monotonic() - started < 15
            assert served.get(f"/api/capacity/{search['id']}").json()["status"] == "running"
        message = str(raised.value)
        assert f"capacity search {search['id']} is still active" in message
        assert "every one of its 2 runs has ended" in message
        assert f"POST /api/capacity/{search['id']}/cancel ends it" in message


# --- 3 and 4. a probe failed at placement -------------------------------------------------------


@pytest.fixture
def one_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """A service that may use one (stub) GPU: a run of tensor_parallel_size 2 fails at placement."""
    for key, value in FAST.items():
        monkeypatch.setenv(key, value)
    with make_client(tmp_path, gpus="0") as client:
        yield client


def test_a_probe_failed_at_placement_does_not_hold_up_the_queue_while_its_look_waits(
        one_gpu: TestClient) -> None:
    client = one_gpu
    base = {"output_len": 8, "engine": {"tensor_parallel_size": 2}}
    # Every look waits while this lock is held: the search's look after its failed probes
    # cannot finish, and the scheduler must place other runs meanwhile.
    with capacity_control._LOOKING:
        search = client.post("/api/capacity", json={**SEARCH, "base": base}).json()
        probes = _run_ids(search)
        for run_id in probes:
            failed = wait_finished(client, run_id, timeout=30)
            assert failed["status"] == "failed" and "tensor_parallel_size 2" in failed["error"]
        other = client.post("/api/runs", json={"input_len": 8, "output_len": 4, "num_prompts": 2}).json()
        done = wait_finished(client, other["id"], timeout=60)
        assert done["status"] == "succeeded", done
        assert client.get(f"/api/capacity/{search['id']}").json()["status"] == "running"
    # Its look, once it may run, ends the search with why.
    ended = wait_search(client, search["id"], timeout=30)
    assert ended["status"] == "failed" and "tensor_parallel_size 2" in ended["error"]


def test_a_run_failed_at_placement_moves_from_queued_to_failed_in_one_write(one_gpu: TestClient) -> None:
    client = one_gpu
    engine: Engine = client.app.state.engine  # type: ignore[attr-defined]
    # Every status write of a run, as SQLite made it.
    with engine.begin() as db:
        db.execute(text("CREATE TABLE status_moves (run_id TEXT, old TEXT, new TEXT)"))
        db.execute(text("CREATE TRIGGER status_move AFTER UPDATE OF status ON run "
                        "WHEN old.status IS NOT new.status BEGIN "
                        "INSERT INTO status_moves VALUES (new.id, old.status, new.status); END"))
    run = client.post("/api/runs", json={"input_len": 8, "output_len": 4, "num_prompts": 2,
                                         "engine": {"tensor_parallel_size": 2}}).json()
    done = wait_finished(client, run["id"], timeout=30)
    assert done["status"] == "failed" and "tensor_parallel_size 2" in done["error"]
    assert done["finished_at"] is not None and done["started_at"] is None
    with engine.connect() as db:
        moves = db.execute(text("SELECT old, new FROM status_moves WHERE run_id = :id"),
                           {"id": run["id"]}).all()
    assert [tuple(m) for m in moves] == [("queued", "failed")]


def test_failing_a_queued_run_is_guarded(tmp_path: Path) -> None:
    _, engine, search_id = _stored_search(tmp_path)
    first, second = capacity_store.get_search(engine, search_id)[1]
    assert store.cancel_queued(engine, second.id, "cancelled by the user")
    assert store.fail_queued(engine, first.id, "it cannot be placed")
    assert not store.fail_queued(engine, first.id, "again")
    assert not store.fail_queued(engine, second.id, "it cannot be placed")
    failed, cancelled = store.get_run(engine, first.id), store.get_run(engine, second.id)
    assert (failed.status, failed.error) == (RunStatus.failed.value, "it cannot be placed")
    assert failed.finished_at is not None
    assert (cancelled.status, cancelled.error) == (RunStatus.cancelled.value, "cancelled by the user")
    engine.dispose()


# --- 5. deleting a probe run of an active search ------------------------------------------------


def test_a_probe_run_of_an_active_search_cannot_be_deleted(tmp_path: Path) -> None:
    _, engine, search_id = _stored_search(tmp_path)
    # One trial ended; the search waits for the other (never placed: the service is not up).
    first, _ = capacity_store.get_search(engine, search_id)[1]
    assert store.cancel_queued(engine, first.id, "cancelled")
    with pytest.raises(Conflict, match=f"capacity search {search_id}, which is still searching"):
        store.delete_run(engine, first.id)
    assert store.get_run(engine, first.id).status == RunStatus.cancelled.value
    engine.dispose()


def test_deleting_a_probe_run_of_an_active_search_is_409_and_allowed_once_it_ended(
        stub_service: Any) -> None:
    client = stub_service({"STUB_TOKEN_INTERVAL_S": "0.05"})
    search = client.post("/api/capacity", json={**SEARCH, "base": {"output_len": 64}}).json()
    first, second = _run_ids(search)
    assert client.post(f"/api/runs/{first}/cancel").status_code == 200
    refused = client.delete(f"/api/runs/{first}")
    assert refused.status_code == 409, refused.text
    detail = refused.json()["detail"]
    assert f"capacity search {search['id']}" in detail and "still searching" in detail
    assert f"POST /api/capacity/{search['id']}/cancel" in detail
    assert client.get(f"/api/runs/{first}").status_code == 200
    assert client.post(f"/api/capacity/{search['id']}/cancel").status_code == 200
    wait_finished(client, second)
    deadline = time.monotonic() + 120  # a runner ends its save after the cancel; a busy machine slows it
    while (response := client.delete(f"/api/runs/{first}")).status_code == 409 \
            and "still saving" in response.text and time.monotonic() < deadline:
        time.sleep(0.2)
    assert response.status_code == 204, response.text
