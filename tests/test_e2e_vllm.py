"""End to end with a real vLLM (CPU) server and the FillConnector, through the service's own API.

One service process (``python -m service``, real HTTP, real SQLite) for the module;
its first run starts a real vLLM server on the bundled tiny model, later runs
reuse it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import wait_finished

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    data_dir = tmp_path_factory.mktemp("e2e") / "var"
    port = _free_port()
    env = {**os.environ, "DECODEBENCH_DATA_DIR": str(data_dir), "DECODEBENCH_PORT": str(port),
           "DECODEBENCH_GPUS": ""}
    env.pop("DECODEBENCH_VLLM_COMMAND", None)
    log_path = data_dir.parent / "service.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "service did not come up"
            time.sleep(0.2)
        yield client
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(client: httpx.Client, **spec: Any) -> dict[str, Any]:
    response = client.post("/api/runs", json=spec)
    assert response.status_code == 201, response.text
    done = wait_finished(client, response.json()["id"], timeout=600)
    assert done["status"] == "succeeded", done["error"]
    return done


def _texts(client: httpx.Client, run_id: str) -> list[str]:
    samples = client.get(f"/api/runs/{run_id}/requests").json()
    return [s["generated_text"] for s in sorted(samples, key=lambda s: s["index"])]


def test_fill_run_succeeds_and_a_second_run_reuses_the_server(service: httpx.Client) -> None:
    first = _run(service, input_len=4096, output_len=32, num_prompts=16, max_concurrency=4)
    samples = service.get(f"/api/runs/{first['id']}/requests").json()
    assert len(samples) == 16
    assert all(s["success"] and s["output_tokens"] == 32 for s in samples)
    assert all(s["prompt_len"] == 4096 for s in samples)
    summary = first["summary"]
    assert summary["completed"] == 16 and summary["failed"] == 0
    assert summary["total_input_tokens"] == 16 * 4096
    assert summary["total_output_tokens"] == 16 * 32
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert summary[key] > 0, key
    assert summary["output_throughput"] > 0
    # The connector asked the service for this run's parameters (once: they are cached).
    assert first["connector"]["pulls"] == 1

    second = _run(service, input_len=4096, output_len=32, num_prompts=8, max_concurrency=4,
                  fill={"mean": 0.5, "std": 0.0})
    assert second["worker_id"] == first["worker_id"]
    assert second["connector"]["pulls"] == 1
    workers = service.get("/api/workers").json()
    assert [w["status"] for w in workers] == ["ready"]
    assert workers[0]["runs_served"] == 2

    page = service.get(f"/runs/{first['id']}")
    assert page.status_code == 200 and "median" in page.text
    assert first["id"] in service.get("/").text


def test_fill_values_change_the_generated_tokens(service: httpx.Client) -> None:
    common: dict[str, Any] = {"input_len": 2048, "output_len": 16, "num_prompts": 3,
                              "max_concurrency": 1, "seed": 7}
    low = _run(service, **common, fill={"mean": 0.015})
    high = _run(service, **common, fill={"mean": 1.5})
    low_again = _run(service, **common, fill={"mean": 0.015})
    assert _texts(service, low["id"]) == _texts(service, low_again["id"])
    assert _texts(service, low["id"]) != _texts(service, high["id"])
