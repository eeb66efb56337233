"""The service's own log: the connector's routine calls stay out of it, the rest stays in."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx

from tests.service_process import ServiceProcess

SMALL = {"input_len": 32, "output_len": 4, "num_prompts": 4, "max_concurrency": 2}
ACCESS = re.compile(r'"(GET|POST|PUT|DELETE) (\S+) HTTP/[\d.]+" (\d{3})')


def _access_lines(log: str) -> list[tuple[str, str, int]]:
    return [(m[1], m[2], int(m[3])) for m in ACCESS.finditer(log)]


def _run_and_log(tmp_path: Path, env: dict[str, str] | None = None) -> list[tuple[str, str, int]]:
    """A run on a real service process (its stub server pulls and reports as the connector
    does), one refused connector call, then the service's access lines."""
    service = ServiceProcess(tmp_path / "var", env)
    service.start()
    try:
        with service.client() as c:
            run_id = c.post("/api/runs", json=SMALL).json()["id"]
            for _ in range(600):
                if c.get(f"/api/runs/{run_id}").json()["status"] in ("succeeded", "failed"):
                    break
                subprocess.run(["sleep", "0.1"], check=True)
            run = c.get(f"/api/runs/{run_id}").json()
            assert run["status"] == "succeeded", (run["error"], service.log()[-4000:])
        # A connector call with a token no server has: refused, and that is logged.
        refused = httpx.post(f"{service.url}/api/connector/report", json={},
                             headers={"Authorization": "Bearer not-a-worker-token"}, timeout=10)
        assert refused.status_code == 401
    finally:
        service.stop()
    return _access_lines(service.log())


def test_routine_connector_calls_stay_out_of_the_log_and_errors_stay_in(tmp_path: Path) -> None:
    lines = _run_and_log(tmp_path)
    connector = [line for line in lines if line[1].startswith("/api/connector/")]
    assert connector == [("POST", "/api/connector/report", 401)], connector
    # The user's own calls are still there.
    assert ("POST", "/api/runs", 201) in lines


def test_connector_calls_are_logged_when_asked(tmp_path: Path) -> None:
    lines = _run_and_log(tmp_path, {"DECODEBENCH_LOG_CONNECTOR_TRAFFIC": "1"})
    answered = {path.partition("?")[0] for _, path, status in lines
                if path.startswith("/api/connector/") and 200 <= status < 300}
    assert {"/api/connector/fill", "/api/connector/report"} <= answered, answered
