"""The Ray backend on a real Ray cluster: ``ray.cluster_utils.Cluster`` makes one on this
machine (a head and GPU nodes that declare fake GPUs as resources), one per module.
Servers are the stub vLLM server, started by their actors; they listen on 127.0.0.1
(``ray_server_host``: every node is this machine), so the load stays on loopback. Ray's own
processes talk over the address Ray picks for this machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from service.control.procs import remove_rpc_dir, rpc_dir
from service.core.tinymodel import MAX_MODEL_LEN
from tests.conftest import make_client, wait_finished, wait_for
from tests.ports import free_port
from tests.service_process import ServiceProcess, pid_alive
from tests.test_reliability import FAILED_STARTS

# A local Ray cluster: left out of ``make test-quick``.
pytestmark = pytest.mark.slow

NAMESPACE = "decodebench-test"
GPU_NODES = 2
GPUS_PER_NODE = 2
# Each request streams 30 tokens 50 ms apart: a run lasts long enough to overlap others.
SLOW = {"STUB_TOKEN_INTERVAL_S": "0.05"}
RUN = {"input_len": 16, "output_len": 30, "num_prompts": 2, "max_concurrency": 1}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head without GPUs and two nodes of two fake GPUs each."""
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(GPU_NODES):
        made.add_node(num_cpus=2, num_gpus=GPUS_PER_NODE)
    made.wait_for_nodes()
    # The tests look at the cluster too; the services in this process share the connection.
    ray.init(address=made.address, namespace=NAMESPACE, log_to_driver=False)
    yield made
    ray.shutdown()
    made.shutdown()


def ray_settings(cluster: Cluster, namespace: str = NAMESPACE) -> dict[str, Any]:
    # A driver silent for 60 s is hung here, not 15: these tests are not about the hang check
    # (test_ray_drivers.py is), and on a machine the rest of the suite keeps busy a driver host
    # starting on a node can be silent for longer than 15 s. Servers get 300 s to be healthy,
    # not the suite's 60: a CI run saw two stub servers of one node miss 60 s while the e2e
    # group's real vLLM servers kept the machine busy (alone they are ready in seconds).
    return {"ray_address": cluster.address, "ray_namespace": namespace, "ray_server_host": "127.0.0.1",
            "ray_forward_env": "VLLM_,STUB_", "driver_hang_s": 60.0, "worker_start_timeout_s": 300}


def our_actors(namespace: str = NAMESPACE) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def test_a_sweep_runs_one_server_per_gpu_across_nodes(cluster: Cluster, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SLOW.items():
        monkeypatch.setenv(key, value)
    with make_client(tmp_path, **ray_settings(cluster)) as client:
        sweep = client.post("/api/sweeps", json={"base": RUN, "grid": {"fill.mean": [0.1, 0.2, 0.3, 0.4]}})
        assert sweep.status_code == 201, sweep.text
        sweep = sweep.json()
        ids = [r["id"] for r in sweep["runs"]]
        # Four servers at once, two on each node, each with its own GPU. Alone they are ready
        # in seconds; a fresh-clone suite on 4 workers beside the real vLLM servers of the e2e
        # group once took over 300 s to have all four ready, so the runs get 600 s to end and
        # the servers are judged afterwards: idle servers stay up.
        runs = [wait_finished(client, run_id, timeout=600) for run_id in ids]
        assert [r["status"] for r in runs] == ["succeeded"] * 4, [r["error"] for r in runs]
        view = client.get("/api/cluster").json()
        servers = [(n["id"], s) for n in view["nodes"] for s in n["servers"]]
        assert view["backend"] == "ray"
        assert len(servers) == GPU_NODES * GPUS_PER_NODE and all(s["ready"] for _, s in servers), servers
        assert len({node for node, _ in servers}) == GPU_NODES
        assert len({(node, tuple(s["gpu_ids"])) for node, s in servers}) == 4
        assert all(len(s["gpu_ids"]) == 1 for _, s in servers)
        # The index page shows the cluster: every node with its servers.
        page = client.get("/").text
        assert "Ray cluster" in page and all(s["id"] in page for _, s in servers)
        workers = {w["id"]: w for w in client.get("/api/workers").json()}
        assert len({r["worker_id"] for r in runs}) == 4
        for run in runs:
            worker = workers[run["worker_id"]]
            assert worker["backend"] == "ray" and worker["node"]["id"]
            # Started with --max-model-len -1: the tiny model's own length fits the stub's
            # KV cache, and the service read it from the server on its node.
            assert worker["max_model_len"] == MAX_MODEL_LEN
            # The run records its server's node and its drivers' (on that node by default).
            recorded = run["provenance"]
            assert recorded["worker"]["node"]["id"] == worker["node"]["id"]
            assert [d["node_id"] for d in recorded["drivers"]] == [worker["node"]["id"]]
            assert recorded["drivers"][0]["uncertainty_s"] >= 0
            # Energy is read beside the server, on its node: these GPUs are fake, so NVML
            # there says why it has nothing (and the block names the node).
            energy = run["summary"]["energy"]
            assert energy["node"] == worker["node"]["address"]
            assert energy["available"] is False and worker["node"]["id"] in energy["why"]
            # Its actor kept the server's log and the bundled model under the data dir.
            assert worker["log_path"].split(":", 1)[1].startswith(str(tmp_path / "var" / "ray"))
        assert (tmp_path / "var" / "ray" / "models").is_dir()
        # They ran side by side: all four servers were asked for before any run ended (one
        # server would have served them one after another).
        assert max(workers[r["worker_id"]]["created_at"] for r in runs) < min(r["finished_at"] for r in runs)
    # A clean shutdown leaves nothing of ours on the cluster.
    assert our_actors() == []


def test_a_server_node_that_dies_fails_its_run_naming_the_node(cluster: Cluster, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    spare = cluster.add_node(num_cpus=2, num_gpus=GPUS_PER_NODE)
    cluster.wait_for_nodes()
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.05")
    with make_client(tmp_path, **ray_settings(cluster)) as client:
        run = client.post("/api/runs", json={**RUN, "num_prompts": 40, "max_concurrency": 2}).json()
        wait_for(client, run["id"], lambda r: r["status"] == "running" and r["progress"]["completed"] >= 2)
        worker_id = client.get(f"/api/runs/{run['id']}").json()["worker_id"]
        node_id = client.get(f"/api/workers/{worker_id}").json()["node"]["id"]
        doomed = next(n for n in [*cluster.worker_nodes] if n.node_id == node_id)
        cluster.remove_node(doomed, allow_graceful=False)
        failed = wait_finished(client, run["id"])
        assert failed["status"] == "failed"
        assert node_id in failed["error"], failed["error"]
        kept = client.get(f"/api/runs/{run['id']}/requests").json()
        assert len(kept) >= 2 and len(kept) == failed["progress"]["completed"] + failed["progress"]["failed"]
        # The next run goes to a node that is left.
        again = wait_finished(client, client.post("/api/runs", json=RUN).json()["id"])
        assert again["status"] == "succeeded", again["error"]
        assert client.get(f"/api/workers/{again['worker_id']}").json()["node"]["id"] != node_id
    if spare is not doomed:
        cluster.remove_node(spare)
    # A dead node's disk goes with it; this "node" was this machine, whose temp dir keeps
    # the server's sockets' directory (its actor died before it could remove it).
    remove_rpc_dir(worker_id)


def test_a_server_that_exits_while_starting_on_a_node_says_why(cluster: Cluster, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Its process ends before the service has read a line of its log: the reason is still read
    # from the actor on its node, not left out.
    monkeypatch.setenv("STUB_EXIT_AT_START", "3")
    with make_client(tmp_path, **ray_settings(cluster)) as client:
        done = wait_finished(client, client.post("/api/runs", json=RUN).json()["id"])
        (worker,) = client.get("/api/workers").json()
    assert done["status"] == "failed"
    assert "exit code 3" in done["error"] and "Ray node" in done["error"], done["error"]
    assert "stub: exiting at start as told" in done["error"], done["error"]
    # The actor was still asked to stop it: nothing of it is left on its node (this machine).
    assert worker["status"] == "failed" and worker["backend"] == "ray"
    assert not rpc_dir(worker["id"]).exists()


def test_a_server_whose_engine_failed_on_a_node_fails_at_once_with_the_root_cause(
        cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real vLLM log up to its engine's failure, then the API server hangs (port bound, no
    # answer) with its engine alive: only the log on the node says it will never serve.
    for key, value in {"STUB_PRINT_LOG": str(FAILED_STARTS / "engine_failed_server_hangs.log"),
                       "STUB_SILENT_PORT": "1", "STUB_ENGINE": "alive"}.items():
        monkeypatch.setenv(key, value)
    with make_client(tmp_path, **ray_settings(cluster)) as client:
        started = time.monotonic()
        done = wait_finished(client, client.post("/api/runs", json=RUN).json()["id"])
        elapsed = time.monotonic() - started
        (worker,) = client.get("/api/workers").json()
    assert done["status"] == "failed"
    lines = done["error"].splitlines()
    assert lines[0].startswith("ValueError: Available memory on node 0 (9.46/12.71 GiB) on kv cache "
                               "allocation"), done["error"]
    assert lines[1].startswith("Fix: lower VLLM_CPU_KVCACHE_SPACE"), done["error"]
    node = worker["node"]["address"]
    assert lines[2].startswith(f"vLLM server's engine failed to start on node {node} "), done["error"]
    # Within moments of the log's line, not at the start timeout (300 s here).
    assert elapsed < 60, elapsed
    assert worker["status"] == "failed" and worker["backend"] == "ray"
    assert not rpc_dir(worker["id"]).exists()


def test_a_service_killed_and_restarted_leaves_nothing_on_the_cluster(cluster: Cluster,
                                                                      tmp_path: Path) -> None:
    namespace = "decodebench-test-restart"
    env = {f"DECODEBENCH_{k.upper()}": str(v) for k, v in ray_settings(cluster, namespace).items()}
    service = ServiceProcess(tmp_path / "var", {**env, **SLOW})
    service.start(timeout=120)
    try:
        with service.client() as c:
            run_id = c.post("/api/runs", json={**RUN, "num_prompts": 40}).json()["id"]
            wait_for(c, run_id, lambda r: r["status"] == "running", timeout=120)
            worker = c.get(f"/api/workers/{c.get(f'/api/runs/{run_id}').json()['worker_id']}").json()
        assert our_actors(namespace), "the server's actor is on the cluster"
        assert pid_alive(worker["pid"])
        service.kill()
        # Its server outlives it (a detached actor) until the service comes back.
        assert our_actors(namespace) and pid_alive(worker["pid"])
        service.start(timeout=120)
        with service.client() as c:
            run = c.get(f"/api/runs/{run_id}").json()
            assert run["status"] == "failed"
            stopped = c.get(f"/api/workers/{worker['id']}").json()
            assert stopped["status"] == "stopped"
        deadline = time.monotonic() + 30
        while our_actors(namespace) or pid_alive(worker["pid"]):
            assert time.monotonic() < deadline, (our_actors(namespace), worker["pid"])
            time.sleep(0.1)
    finally:
        service.stop()


def test_a_cluster_that_cannot_be_reached_is_said_in_one_line(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = subprocess.run(
        [sys.executable, "-m", "service"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "DECODEBENCH_DATA_DIR": str(tmp_path / "var"), "DECODEBENCH_RAY_ADDRESS": address},
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"decodebench: cannot reach the Ray cluster at {address}"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_auto_is_refused_for_it_would_join_any_cluster_on_the_machine(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "DECODEBENCH_DATA_DIR": str(tmp_path / "var"), "DECODEBENCH_RAY_ADDRESS": "auto"},
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("decodebench: DECODEBENCH_RAY_ADDRESS: auto would join whichever Ray cluster "
                           "runs on this machine"), done.stderr[-2000:]
    assert "HOST:6379" in last and "Traceback" not in done.stderr
