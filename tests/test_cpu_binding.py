"""Every CPU worker runs with the thread layout the service chose, whatever it loads."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.control.cpu_binding import BIND_VAR, RESERVED_VAR, binding_env, parse_binding_log
from tests.conftest import make_client, wait_finished

SMALL = {"input_len": 64, "output_len": 8, "num_prompts": 4, "max_concurrency": 2}

# What vLLM CPU 0.32's EngineCore logs as it binds a one-rank server on a 2-core machine.
_PREFIX = "(EngineCore pid=2344) INFO 11-23 09:55:17 [ompmultiprocessing.py:185] "
VLLM_LOG = "".join(_PREFIX + line + "\n" for line in (
    "OpenMP thread binding info: ",
    "\tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False",
    "\tlocal_world_size=1, reserve_cpu_num=1",
    "\tlocal_rank=0, core ids=[0]",
    "\treserved_cpus=[1]",
))


@pytest.mark.parametrize(
    ("tp", "machine", "reserved"),
    [(1, "x86_64", "1"), (4, "x86_64", "4"), (2, "aarch64", "2"), (2, "ppc64le", "1")],
)
def test_reservation_is_what_vllm_gives_a_server_without_a_connector(
    tp: int, machine: str, reserved: str
) -> None:
    assert binding_env(tp, {}, machine) == {RESERVED_VAR: reserved, BIND_VAR: "auto"}


def test_an_operators_binding_is_kept() -> None:
    env = binding_env(1, {BIND_VAR: "2-7", RESERVED_VAR: "0"}, "x86_64")
    assert env == {RESERVED_VAR: "0", BIND_VAR: "2-7"}


def test_binding_log_gives_the_cores_vllm_chose() -> None:
    assert parse_binding_log(VLLM_LOG) == {"omp_cores": {"0": [0]}, "reserved_cores": [1]}
    assert parse_binding_log("no binding lines here") is None


def _worker_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_cpu_worker_environment_carries_the_binding_for_fill_and_prefill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (RESERVED_VAR, BIND_VAR):
        monkeypatch.delenv(name, raising=False)
    expected = binding_env(1, {})
    with make_client(tmp_path) as client:
        fill = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
        prefill = wait_finished(
            client, client.post("/api/runs", json={**SMALL, "mode": "prefill"}).json()["id"]
        )
        assert fill["status"] == prefill["status"] == "succeeded"
        assert fill["worker_id"] == prefill["worker_id"]
        (worker,) = client.get("/api/workers").json()
        environ = _worker_environ(worker["pid"])
        assert {k: environ.get(k) for k in expected} == expected
        # Recorded on the worker and on each run it served, and shown on the run page.
        assert worker["cpu_binding"]["env"] == expected
        assert fill["cpu_binding"]["env"] == prefill["cpu_binding"]["env"] == expected
        page = client.get(f"/runs/{fill['id']}").text
        assert f"{RESERVED_VAR}={expected[RESERVED_VAR]}" in page


def test_gpu_workers_get_no_cpu_binding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (RESERVED_VAR, BIND_VAR):
        monkeypatch.delenv(name, raising=False)
    with make_client(tmp_path, gpus="0") as client:
        run = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
        assert run["status"] == "succeeded"
        (worker,) = client.get("/api/workers").json()
        environ = _worker_environ(worker["pid"])
        assert RESERVED_VAR not in environ and BIND_VAR not in environ
        assert run["cpu_binding"] is None


def test_a_stream_sent_all_at_once_warns_that_its_itl_means_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STUB_BUNCHED", "1")
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.005")
    with make_client(tmp_path) as client:
        run = wait_finished(client, client.post("/api/runs", json={**SMALL, "output_len": 16}).json()["id"])
        assert run["status"] == "succeeded", run["error"]
        (warning,) = run["warnings"]
        assert warning["code"] == "bunched_streams"
        assert warning["figure"] == 1.0
        assert "not meaningful" in warning["message"]
        # The symptom the warning is about: TTFT is nearly the whole latency, gaps are ~0.
        assert run["summary"]["median_itl_ms"] < 0.1
        assert "bunched_streams" in client.get(f"/runs/{run['id']}").text
        assert "bunched_streams" in client.get("/").text
        export = client.get(f"/api/runs/{run['id']}/export?format=vllm").json()
        assert export["decodebench"]["warnings"][0]["code"] == "bunched_streams"
        rows = list(csv.DictReader(io.StringIO(client.get(f"/api/runs/{run['id']}/export?format=csv").text)))
        assert rows and all(row["bunched"] == "True" for row in rows)
        # A sweep point that did not stream says so on the sweep page.
        sweep = client.post("/api/sweeps", json={"base": {**SMALL, "output_len": 16},
                                                  "grid": {"input_len": [32]}}).json()
        (point,) = sweep["runs"]
        assert wait_finished(client, point["id"])["warnings"][0]["code"] == "bunched_streams"
        assert "bunched_streams" in client.get(f"/sweeps/{sweep['id']}").text


def test_a_run_that_streamed_has_no_warning(stub_service: Callable[..., TestClient]) -> None:
    # Tokens 20 ms apart: a client on a busy 2-core machine can be late by a few ms and read
    # 2 ms tokens in bursts (which the warning would then rightly say); not 20 ms ones.
    client = stub_service(env={"STUB_TOKEN_INTERVAL_S": "0.02"})
    run = wait_finished(client, client.post("/api/runs", json={**SMALL, "output_len": 16}).json()["id"])
    assert run["status"] == "succeeded"
    assert run["warnings"] == []
