"""Access control and hostile input: every mutating route locked, nothing bad accepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from service.__main__ import refuse_open_bind
from service.control.vllm_cli import worker_argv
from service.core.spec import RunSpec
from service.settings import Settings
from tests.conftest import AUTH, make_client, wait_finished

SMALL = {"input_len": 8, "output_len": 2, "num_prompts": 1}
OPEN = {"/healthz", "/login", "/logout", "/api/connector/fill", "/api/connector/report",
        "/api/connector/provenance", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def _routes(client: TestClient, method: str) -> list[str]:
    return sorted(
        r.path for r in client.app.routes  # type: ignore[attr-defined]
        if isinstance(r, APIRoute) and method in r.methods and r.path not in OPEN
    )


def _fill(path: str, run_id: str, sweep_id: str) -> str:
    return path.replace("{run_id}", run_id).replace("{sweep_id}", sweep_id)


@pytest.fixture
def ids_and_worker_token(client: TestClient) -> tuple[str, str, str]:
    run = client.post("/api/runs", json=SMALL).json()
    done = wait_finished(client, run["id"])
    sweep = client.post("/api/sweeps", json={"base": SMALL, "grid": {"output_len": [2]}}).json()
    token = client.app.state.scheduler.fleet.tokens[done["worker_id"]]  # type: ignore[attr-defined]
    return run["id"], sweep["id"], token


def test_auth_matrix_every_mutating_route(client: TestClient,
                                          ids_and_worker_token: tuple[str, str, str]) -> None:
    run_id, sweep_id, worker_token = ids_and_worker_token
    posts = _routes(client, "POST")
    assert {"/api/runs", "/api/runs/{run_id}/cancel", "/api/sweeps"} <= set(posts)
    matrix = {}
    for path in posts:
        url = _fill(path, run_id, sweep_id)
        for who, headers in (("none", {"Authorization": ""}), ("wrong", {"Authorization": "Bearer x"}),
                             ("worker", {"Authorization": f"Bearer {worker_token}"})):
            code = client.post(url, json=SMALL, headers=headers).status_code
            matrix[(path, who)] = code
    assert all(code in (401, 403) for code in matrix.values()), matrix
    assert all(matrix[(p, "worker")] == 403 for p in posts)
    # Nothing was created or cancelled by any of them.
    assert client.get("/api/runs").json()["total"] == 2


def test_reads_need_the_token_unless_public_read(tmp_path: Path) -> None:
    for public, expected in ((False, {401}), (True, {200, 404})):
        with make_client(tmp_path / str(public), public_read=public) as client:
            for path in _routes(client, "GET"):
                if path.startswith("/api/") or path == "/metrics":
                    url = _fill(path, "r-x", "s-x")
                    if path == "/api/compare":  # its ids are a required query
                        url += "?ids=r-x&ids=r-y"
                    code = client.get(url, headers={"Authorization": ""}).status_code
                    assert code in expected, (path, code)


def test_pages_send_a_browser_to_login_and_the_cookie_lets_it_in(shared_client: TestClient) -> None:
    shared_client.headers.pop("Authorization")
    page = shared_client.get("/runs/r-x?a=1", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"].startswith("/login?next=")
    assert shared_client.post("/login", data={"token": "nope", "next": "/"}).status_code == 401
    ok = shared_client.post("/login", data={"token": AUTH["Authorization"].split()[1],
                                            "next": "//evil.example"}, follow_redirects=False)
    assert ok.status_code == 303 and ok.headers["location"] == "/"  # never an open redirect
    cookie = ok.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert shared_client.get("/").status_code == 200  # the cookie works


def test_worker_token_only_reads_its_own_runs_fill(client: TestClient,
                                                   ids_and_worker_token: tuple[str, str, str]) -> None:
    run_id, _, worker_token = ids_and_worker_token
    # The API token is not a worker token.
    assert client.get(f"/api/connector/fill?run_id={run_id}").status_code == 401
    ok = client.get(f"/api/connector/fill?run_id={run_id}",
                    headers={"Authorization": f"Bearer {worker_token}"})
    assert ok.status_code == 200


def test_binding_beyond_loopback_without_a_chosen_token_is_refused(tmp_path: Path) -> None:
    assert refuse_open_bind(Settings(host="0.0.0.0", data_dir=tmp_path)) is not None
    assert "DECODEBENCH_API_TOKEN" in str(refuse_open_bind(Settings(host="0.0.0.0", data_dir=tmp_path)))
    assert refuse_open_bind(Settings(host="0.0.0.0", api_token="t" * 32, data_dir=tmp_path)) is None
    assert refuse_open_bind(Settings(host="127.0.0.1", data_dir=tmp_path)) is None
    assert refuse_open_bind(Settings(host="0.0.0.0", allow_open_bind=True, data_dir=tmp_path)) is None


HOSTILE_STRINGS = [
    "--trust-remote-code", "-rf", "../../etc/passwd", "/etc/../root", "a/../b", "$(touch /tmp/x)",
    "`id`", "x; rm -rf /", "a|b", "a&&b", "https://evil.example/m", "file:///etc/passwd",
    "<script>alert(1)</script>", "\u202eevil", "\x00", "a" * 5000, "org/name/extra", " ", "",
    "--kv-transfer-config={}", "--model=/x",
]
HOSTILE_NUMBERS: list[Any] = [-1, 0, 10**30, 1e308, "1e999", float("nan"), "NaN", True, [], {}]


def _hostile_bodies() -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []
    for s in HOSTILE_STRINGS:
        bodies += [{"model": s}, {"mode": s}, {"engine": {"extra_args": [s]}},
                   {"engine": {"dtype": s}}, {"engine": {"extra_args": [f"--max-num-seqs={s}"]}},
                   {"engine": {"extra_args": [f"--kv-cache-dtype={s}"]}}]
    for n in HOSTILE_NUMBERS:
        bodies += [{"input_len": n}, {"output_len": n}, {"num_prompts": n}, {"max_concurrency": n},
                   {"request_rate": n}, {"engine": {"tensor_parallel_size": n}}]
        if n != 0:  # 0 is a fine seed, range ratio or fill value
            bodies += [{"range_ratio": n}, {"seed": n}]
        if n not in (0, -1):
            bodies += [{"fill": {"mean": n}}]
    return bodies


def test_hostile_values_are_refused_everywhere(shared_client: TestClient) -> None:
    refused = 0
    bodies = _hostile_bodies()
    for body in bodies:
        text = json.dumps(body, allow_nan=True)
        response = shared_client.post("/api/runs", content=text, headers={"Content-Type": "application/json"})
        assert response.status_code == 422, (body, response.status_code, response.text[:200])
        refused += 1
        sweep = json.dumps({"base": body, "grid": {"output_len": [2]}}, allow_nan=True)
        response = shared_client.post("/api/sweeps", content=sweep,
                                      headers={"Content-Type": "application/json"})
        assert response.status_code == 422, (body, response.status_code)
    for s in HOSTILE_STRINGS[:12]:
        assert shared_client.get("/api/runs/" + s.replace("/", "%2F")).status_code in (404, 422)
        assert shared_client.get("/api/runs", params={"model": s, "status": s}).status_code == 422
    assert refused == len(bodies)
    assert shared_client.get("/api/runs").json()["total"] == 0  # nothing reached the queue, so no argv


def test_argv_is_a_list_and_carries_only_validated_values(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    spec = RunSpec(engine={"extra_args": ["--max-num-seqs=4", "--enable-prefix-caching"]})
    argv, _ = worker_argv(settings, spec, 1234, "tok", [])
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    assert argv[-2:] == ["--max-num-seqs=4", "--enable-prefix-caching"]
    assert argv.count("--kv-transfer-config") == 1
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_module_path"] == "connector"


def test_hostile_strings_on_pages_are_escaped(shared_client: TestClient) -> None:
    for s in HOSTILE_STRINGS:
        if s in ("", " ", "\x00") or len(s) > 500:
            continue
        html = shared_client.get("/", params={"model": s}).text
        if "<" in s:
            assert s not in html
        login = shared_client.get("/login", params={"next": s}).text
        assert "<script>alert(1)</script>" not in login
