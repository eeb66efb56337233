"""The API a person can live with: listing sweeps, deleting runs, bodies not sent as JSON,
unknown field names with the closest valid one, and models that cannot exist refused at
submit."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func
from sqlmodel import Session, select

from service.__main__ import ready_banner
from service.analysis.metrics import summarize
from service.control import hub
from service.core.ids import new_id
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.core.status import RunStatus
from service.settings import Settings
from service.storage import measurements
from service.storage.tables import Baseline, Run, SampleRow, ServerMetricPoint
from tests.conftest import API_TOKEN, make_client, wait_finished, wait_for
from tests.ports import free_port

SMALL = {"input_len": 32, "output_len": 4, "num_prompts": 2, "max_concurrency": 2}


def _detail(response: Any) -> str:
    return str(response.json()["detail"])


def _messages(response: Any) -> list[str]:
    return [e["msg"] for e in response.json()["detail"]]


# ------------------------------------------------------------------ unknown fields


def test_an_unknown_field_is_answered_with_the_closest_valid_name(shared_client: TestClient) -> None:
    response = shared_client.post("/api/runs", json={**SMALL, "input_length": 64})
    assert response.status_code == 422
    assert "unknown field 'input_length'; did you mean 'input_len'?" in _messages(response)


def test_an_unknown_nested_field_is_matched_against_its_own_model(shared_client: TestClient) -> None:
    response = shared_client.post("/api/runs", json={"fill": {"meen": 0.1}, "engine": {"dtyp": "float32"}})
    assert response.status_code == 422
    messages = _messages(response)
    assert "unknown field 'meen'; did you mean 'mean'?" in messages
    assert "unknown field 'dtyp'; did you mean 'dtype'?" in messages


def test_an_unknown_sweep_field_gets_a_grid_name_or_a_base_name(shared_client: TestClient) -> None:
    response = shared_client.post("/api/sweeps", json={"base": {"num_promts": 2},
                                                "grid": {"input_lens": [64], "fill.men": [0.1]}})
    assert response.status_code == 422
    messages = _messages(response)
    assert "unknown field 'num_promts'; did you mean 'num_prompts'?" in messages
    assert "unknown field 'input_lens'; did you mean 'input_len'?" in messages
    assert "unknown field 'fill.men'; did you mean 'fill.mean'?" in messages


def test_an_unknown_field_close_to_nothing_lists_the_valid_ones(shared_client: TestClient) -> None:
    response = shared_client.post("/api/runs", json={"fill": {"colour": 1}})
    assert response.status_code == 422
    assert _messages(response) == ["unknown field 'colour'; valid fields: mean, std, startup"]


# ------------------------------------------------------------------ content type


@pytest.mark.parametrize(
    ("headers", "body", "said"),
    [
        ({"Content-Type": "text/plain"}, b'{"num_prompts": 2}', "Content-Type: text/plain"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, b"num_prompts=2",
         "Content-Type: application/x-www-form-urlencoded"),
        ({}, b'{"num_prompts": 2}', "no Content-Type"),
    ],
)
def test_a_body_not_sent_as_json_is_415_saying_how_to_send_it(
    shared_client: TestClient, headers: dict[str, str], body: bytes, said: str
) -> None:
    for path in ("/api/runs", "/api/sweeps"):
        response = shared_client.post(path, content=body, headers=headers)
        assert response.status_code == 415, response.text
        assert "send the body as JSON with Content-Type: application/json" in _detail(response)
        assert said in _detail(response)
    assert shared_client.get("/api/runs").json()["total"] == 0


def test_the_login_form_still_takes_a_form(tmp_path: Path) -> None:
    with make_client(tmp_path) as client:
        client.headers.pop("Authorization")
        response = client.post("/login", data={"token": API_TOKEN, "next": "/"}, follow_redirects=False)
        assert response.status_code == 303


# ------------------------------------------------------------------ DELETE /api/runs/{id}


def _stored_run(client: TestClient, status: RunStatus, **fields: Any) -> str:
    """A run written straight to the database with samples and server metric points."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    samples = [Sample(index=i, prompt_len=16, output_tokens=4, ttft=0.1, itl=[0.1] * 3,
                      latency=0.4, start_time=100.0 + i, success=True) for i in range(3)]
    spec = RunSpec().model_dump()
    run = Run(id=new_id("r"), spec=spec, model=spec["model"], status=status.value, total=3,
              completed=3, summary=summarize(samples, 2.0, {}), **fields)
    with Session(engine, expire_on_commit=False) as session:
        session.add(run)
        session.commit()
    measurements.save_samples(engine, run.id, samples)
    measurements.save_server_points(engine, run.id, [(0.0, {"num_requests_running": 1.0}),
                                                     (1.0, {"num_requests_running": 2.0})])
    return run.id


def _rows(client: TestClient, table: Any, run_id: str) -> int:
    engine = client.app.state.engine  # type: ignore[attr-defined]
    with Session(engine) as session:
        return int(session.exec(select(func.count()).select_from(table).where(table.run_id == run_id)).one())


def test_delete_of_a_finished_run_is_204_and_its_samples_are_gone(client: TestClient) -> None:
    run_id = _stored_run(client, RunStatus.succeeded)
    assert len(client.get(f"/api/runs/{run_id}/requests").json()) == 3
    assert client.post(f"/api/runs/{run_id}/baseline").status_code == 200
    response = client.delete(f"/api/runs/{run_id}")
    assert response.status_code == 204 and response.content == b""
    assert client.get(f"/api/runs/{run_id}").status_code == 404
    assert client.get(f"/api/runs/{run_id}/requests").status_code == 404
    assert _rows(client, SampleRow, run_id) == 0
    assert _rows(client, ServerMetricPoint, run_id) == 0
    assert client.get("/api/baselines").json() == []
    assert client.get("/api/runs").json()["total"] == 0


def test_delete_of_a_run_that_ran_removes_it_from_the_list(client: TestClient) -> None:
    keep = client.post("/api/runs", json=SMALL).json()["id"]
    gone = client.post("/api/runs", json=SMALL).json()["id"]
    assert wait_finished(client, gone)["status"] == "succeeded"
    assert wait_finished(client, keep)["status"] == "succeeded"
    assert client.delete(f"/api/runs/{gone}").status_code == 204
    assert [r["id"] for r in client.get("/api/runs").json()["runs"]] == [keep]
    assert len(client.get(f"/api/runs/{keep}/requests").json()) == 2


def test_delete_of_an_unknown_run_is_404(shared_client: TestClient) -> None:
    response = shared_client.delete("/api/runs/r-000000000000")
    assert response.status_code == 404 and "not found" in _detail(response)


@pytest.mark.parametrize("path", ["/api/runs/{}", "/api/sweeps/{}", "/api/groups/{}",
                                  "/api/workers/{}"])
def test_a_404_names_a_long_id_without_echoing_all_of_it(shared_client: TestClient, path: str) -> None:
    long_id = "r-" + "x" * 8000
    response = shared_client.get(path.format(long_id))
    assert response.status_code == 404
    detail = _detail(response)
    assert "not found" in detail and "'r-xxxx" in detail and "..." in detail
    assert len(detail) < 300


@pytest.mark.parametrize("status", [RunStatus.starting, RunStatus.running])
def test_delete_of_an_unfinished_run_is_409_saying_cancel_it_first(
    client: TestClient, status: RunStatus
) -> None:
    run_id = _stored_run(client, status)
    response = client.delete(f"/api/runs/{run_id}")
    assert response.status_code == 409
    assert "cancel it first" in _detail(response) and status.value in _detail(response)
    assert client.get(f"/api/runs/{run_id}").status_code == 200
    assert _rows(client, SampleRow, run_id) == 3


def test_a_queued_run_can_be_deleted_once_cancelled(client: TestClient) -> None:
    # A run for a registered server that does not answer stays queued.
    model = "acme/remote-8b"
    assert client.post("/api/workers", json={"url": f"http://127.0.0.1:{free_port()}",
                                             "model": model}).status_code == 201
    run_id = client.post("/api/runs", json={**SMALL, "model": model}).json()["id"]
    refused = client.delete(f"/api/runs/{run_id}")
    assert refused.status_code == 409 and "queued: cancel it first" in _detail(refused)
    assert client.post(f"/api/runs/{run_id}/cancel").status_code == 200
    assert client.delete(f"/api/runs/{run_id}").status_code == 204
    assert client.get(f"/api/runs/{run_id}").status_code == 404


def test_a_run_cancelled_mid_run_is_deleted_once_its_runner_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.02")
    with make_client(tmp_path) as client:
        run_id = client.post("/api/runs", json={**SMALL, "output_len": 100, "num_prompts": 8}).json()["id"]
        running = wait_for(client, run_id,
                           lambda r: r["status"] == "running" and r["progress"]["completed"] >= 1)
        assert client.post(f"/api/runs/{run_id}/cancel").status_code == 200
        answers = []
        for _ in range(100):
            response = client.delete(f"/api/runs/{run_id}")
            answers.append(response.status_code)
            if response.status_code == 204:
                break
            assert response.status_code == 409 and "still saving" in _detail(response)
            time.sleep(0.05)
        assert answers[-1] == 204, answers
        # Nothing that comes late brings it back: the next run on the same server goes
        # through the whole path (driver, streams, the connector's report, which also lists
        # the deleted run's counters) and ends.
        after = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
        assert after["status"] == "succeeded", after["error"]
        assert after["worker_id"] == running["worker_id"] and after["connector"]["requests_filled"] == 2
        assert client.get(f"/api/runs/{run_id}").status_code == 404
        assert _rows(client, SampleRow, run_id) == 0


def test_delete_needs_the_api_token(client: TestClient) -> None:
    run_id = _stored_run(client, RunStatus.failed)
    response = client.delete(f"/api/runs/{run_id}", headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401
    assert client.get(f"/api/runs/{run_id}").status_code == 200


def test_deleting_the_last_trial_of_a_group_drops_the_groups_baseline(client: TestClient) -> None:
    group = new_id("g")
    trials = [_stored_run(client, RunStatus.succeeded, group_id=group, trial=k) for k in range(2)]
    engine = client.app.state.engine  # type: ignore[attr-defined]
    with Session(engine) as session:
        session.add(Baseline(point="p-test", arm=group, model="decodebench-tiny"))
        session.commit()
    assert client.delete(f"/api/runs/{trials[0]}").status_code == 204
    assert [b["arm"] for b in client.get("/api/baselines").json()] == [group]
    assert client.delete(f"/api/runs/{trials[1]}").status_code == 204
    assert client.get("/api/baselines").json() == []


# ------------------------------------------------------------------ GET /api/sweeps


def test_sweeps_are_listed_newest_first_a_page_at_a_time(client: TestClient) -> None:
    grids = [{"input_len": [16, 32]}, {"max_concurrency": [1, 2, 4]}, {"mode": ["fill", "prefill"]}]
    made = []
    for grid in grids:
        response = client.post("/api/sweeps", json={"base": {**SMALL, "num_prompts": 1}, "grid": grid})
        assert response.status_code == 201, response.text
        made.append(response.json()["id"])
    first = client.get("/api/sweeps?limit=2").json()
    assert first["total"] == 3 and first["limit"] == 2 and first["offset"] == 0
    assert [s["id"] for s in first["sweeps"]] == [made[2], made[1]]
    rest = client.get("/api/sweeps?limit=2&offset=2").json()
    assert [s["id"] for s in rest["sweeps"]] == [made[0]]
    newest, middle = first["sweeps"]
    assert newest["grid_keys"] == ["mode"] and newest["points"] == 2
    assert middle["grid_keys"] == ["max_concurrency"] and middle["points"] == 3
    assert middle["runs"] == 3 and sum(middle["status"].values()) == 3
    assert set(middle["status"]) <= {s.value for s in RunStatus}
    assert middle["model"] == "decodebench-tiny"


def test_sweep_list_counts_runs_by_status(client: TestClient) -> None:
    sweep = client.post("/api/sweeps", json={"base": SMALL, "grid": {"input_len": [16, 32]}}).json()
    for run in sweep["runs"]:
        wait_finished(client, run["id"])
    listed = client.get("/api/sweeps").json()["sweeps"]
    assert listed[0]["status"] == {"succeeded": 2} and listed[0]["runs"] == 2


def test_sweep_list_is_empty_at_first_and_bounds_are_checked(client: TestClient) -> None:
    assert client.get("/api/sweeps").json() == {"sweeps": [], "total": 0, "limit": 50, "offset": 0}
    assert client.get("/api/sweeps?limit=0").status_code == 422


# ------------------------------------------------------------------ the model check at submit


def _hub_cache(root: Path, repo_id: str) -> Path:
    """A Hugging Face cache in ``root`` holding a snapshot of ``repo_id`` (config only)."""
    snapshot = root / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    return root


def test_a_hub_model_in_the_local_cache_is_accepted(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_cache(tmp_path / "hf", "acme/cached-1b")))
    response = client.post("/api/runs", json={**SMALL, "model": "acme/cached-1b"})
    assert response.status_code == 201, response.text


def test_the_cache_is_found_under_hf_home(tmp_path: Path) -> None:
    _hub_cache(tmp_path / "home" / "hub", "acme/cached-1b")
    env = {"HF_HOME": str(tmp_path / "home")}
    assert hub.model_problem("acme/cached-1b", "cache", env) is None


def test_a_hub_model_nowhere_to_be_found_is_422_naming_it_and_what_was_tried(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    response = client.post("/api/runs", json={**SMALL, "model": "acme/missing-7b"})
    assert response.status_code == 422
    detail = _detail(response)
    assert "'acme/missing-7b'" in detail
    assert f"{tmp_path / 'empty-cache'}/models--acme--missing-7b/snapshots/*/config.json" in detail
    assert "the hub was not asked (DECODEBENCH_HUB_CHECK=cache)" in detail
    assert client.get("/api/runs").json()["total"] == 0


def test_a_sweep_over_a_missing_model_queues_nothing(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    response = client.post("/api/sweeps", json={"base": {**SMALL, "model": "acme/missing-7b"},
                                                "grid": {"input_len": [16, 32]}})
    assert response.status_code == 422 and "acme/missing-7b" in _detail(response)
    assert client.get("/api/sweeps").json()["total"] == 0
    assert client.get("/api/runs").json()["total"] == 0


def test_a_model_gone_from_the_cache_fails_its_run_and_leaves_the_warm_worker_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.02")
    cache = _hub_cache(tmp_path / "hf", "acme/gone-1b")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with make_client(tmp_path) as client:
        busy = client.post("/api/runs", json={**SMALL, "output_len": 60}).json()["id"]
        wait_for(client, busy, lambda r: r["status"] == "running")
        # Accepted while the worker is busy; its snapshot goes before the run can start.
        gone = client.post("/api/runs", json={**SMALL, "model": "acme/gone-1b"})
        assert gone.status_code == 201, gone.text
        shutil.rmtree(cache / "models--acme--gone-1b")
        failed = wait_finished(client, gone.json()["id"])
        assert failed["status"] == "failed"
        assert "model 'acme/gone-1b' cannot be loaded" in failed["error"]
        warm = wait_finished(client, busy)
        assert warm["status"] == "succeeded"
        workers = client.get("/api/workers").json()
        assert [(w["id"], w["status"]) for w in workers] == [(warm["worker_id"], "ready")]


def test_offline_the_hub_is_not_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with make_client(tmp_path, hub_check="online") as client:
        response = client.post("/api/runs", json={**SMALL, "model": "acme/missing-7b"})
    assert response.status_code == 422
    assert "the hub was not asked (HF_HUB_OFFLINE is set)" in _detail(response)


def test_with_the_check_off_any_well_formed_hub_id_is_queued(tmp_path: Path) -> None:
    with make_client(tmp_path, hub_check="off") as client:
        response = client.post("/api/runs", json={**SMALL, "model": "acme/anything"})
        assert response.status_code == 201, response.text
        client.post(f"/api/runs/{response.json()['id']}/cancel")


def _answering(status: int) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/models/acme/online-3b"
        return httpx.Response(status, json={})
    return httpx.MockTransport(handler)


def test_online_a_model_the_hub_knows_is_accepted(tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "empty")}
    assert hub.model_problem("acme/online-3b", "online", env, _answering(200)) is None


@pytest.mark.parametrize("status", [401, 404])
def test_online_a_model_the_hub_does_not_know_is_a_problem(tmp_path: Path, status: int) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_ENDPOINT": "https://hub.example"}
    problem = hub.model_problem("acme/online-3b", "online", env, _answering(status))
    assert problem is not None
    assert f"the hub does not know it (https://hub.example/api/models/acme/online-3b answered {status})" \
        in problem


def test_online_an_unreachable_hub_is_said_so(tmp_path: Path) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("no route to host", request=request)
    env = {"HF_HUB_CACHE": str(tmp_path / "empty")}
    problem = hub.model_problem("acme/online-3b", "online", env, httpx.MockTransport(refuse))
    assert problem is not None and "the hub could not be reached" in problem
    assert "no route to host" in problem


def test_local_paths_and_the_tiny_model_are_not_hub_ids() -> None:
    assert hub.model_problem("decodebench-tiny", "cache", {}) is None
    assert hub.model_problem("/models/llama", "cache", {}) is None


# ------------------------------------------------------------------ the first start


def test_the_startup_banner_says_where_to_go_and_where_the_token_is_never_the_token(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path / "var", host="0.0.0.0", port=8123, allow_open_bind=True)
    token = settings.resolve_api_token()
    banner = ready_banner(settings)
    assert banner.startswith("decodebench is ready on http://127.0.0.1:8123/")
    assert f"API token: in {tmp_path / 'var' / 'api-token'}" in banner
    assert token not in banner
    for page in ("/ ", "/runs/<id>", "/sweeps/<id>", "/compare?ids=", "/capacity/<id>", "/fidelity", "/docs"):
        assert f"http://127.0.0.1:8123{page}" in banner
    chosen = ready_banner(Settings(data_dir=tmp_path / "var", api_token="s3cret-" + "x" * 30))
    assert "DECODEBENCH_API_TOKEN" in chosen and "s3cret" not in chosen


def test_driver_nodes_above_one_needs_a_ray_cluster(client: TestClient) -> None:
    for path, body in (("/api/runs", {"driver_nodes": 2}),
                       ("/api/sweeps", {"base": {"driver_nodes": 2}, "grid": {"input_len": [16, 32]}})):
        answer = client.post(path, json=body)
        assert answer.status_code == 422, answer.text
        assert "needs a Ray cluster" in answer.json()["detail"]
    assert client.post("/api/runs", json={"driver_nodes": 1, "num_prompts": 1}).status_code == 201


def test_a_one_value_query_parameter_given_twice_is_refused(client: TestClient) -> None:
    run = client.post("/api/runs", json={"num_prompts": 2, "input_len": 8, "output_len": 3}).json()
    answer = client.get(f"/api/runs/{run['id']}/export", params=[
        ("format", "csv"), ("metric_percentiles", "50"), ("metric_percentiles", "99")])
    assert answer.status_code == 422
    assert "metric_percentiles given 2 times: each takes one value" in answer.text
    # A list parameter takes repeats: metadata, and compare's ids.
    listed = client.get("/api/runs", params=[("limit", "5")])
    assert listed.status_code == 200
    compare = client.get("/api/compare", params=[("ids", run["id"]), ("ids", run["id"])])
    assert "given 2 times" not in compare.text
    assert client.get("/api/runs", params=[("limit", "5"), ("limit", "6")]).status_code == 422


def test_a_run_or_sweep_point_over_the_output_token_limit_is_a_422_that_names_it(tmp_path: Path) -> None:
    with make_client(tmp_path, max_run_output_tokens=10_000) as client:
        refused = client.post("/api/runs", json={"num_prompts": 100, "output_len": 101})
        assert refused.status_code == 422
        detail = _detail(refused)
        assert "num_prompts x output_len is 100 x 101 = 10,100 output tokens" in detail
        assert "at most 10,000 (DECODEBENCH_MAX_RUN_OUTPUT_TOKENS)" in detail and "in memory" in detail
        # With a stop rule, the most it may send counts.
        stopped = client.post("/api/runs", json={"num_prompts": 10, "output_len": 100,
                                                  "stop": {"max_prompts": 200, "itl_ci_pct": 5}})
        assert stopped.status_code == 422 and "stop.max_prompts x output_len" in _detail(stopped)
        sweep = client.post("/api/sweeps", json={"base": {"num_prompts": 100},
                                                 "grid": {"output_len": [50, 200]}})
        assert sweep.status_code == 422 and "100 x 200 = 20,000" in _detail(sweep)
        assert client.get("/api/runs").json()["total"] == 0
        assert client.post("/api/runs", json={"num_prompts": 100, "output_len": 100}).status_code == 201


def test_a_run_whose_end_could_not_be_written_is_cancelled_not_called_finished(
        client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    # The database refuses every end write of the run (the runner's tries, and the write that
    # fails it after its runner returned): the run is left "running" with no runner. A cancel
    # then ends it, where it once answered 409 "already finished (running)".
    from service.storage import store

    written = store.transition

    def refuse_ends(engine: Any, run_id: str, target: RunStatus, **fields: Any) -> bool:
        if target in (RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled):
            raise OSError("disk I/O error (the test's)")
        return bool(written(engine, run_id, target, **fields))

    monkeypatch.setattr(store, "transition", refuse_ends)
    run = client.post("/api/runs", json={"input_len": 16, "output_len": 4, "num_prompts": 2}).json()
    scheduler = client.app.state.scheduler  # type: ignore[attr-defined]
    seen = wait_for(client, run["id"], lambda r: r["status"] == "running" and not scheduler.handling(r["id"]),
                    timeout=60)
    assert seen["status"] == "running"
    answer = client.post(f"/api/runs/{run['id']}/cancel")
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "cancelled"
    assert "without recording its end" in answer.json()["error"]
