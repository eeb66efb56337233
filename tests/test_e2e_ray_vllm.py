"""One real vLLM CPU server through the Ray backend: it generates what the same run
generates on the local backend, and its connector's pull and reports reach the service.

The cluster (``ray.cluster_utils.Cluster``, one node of CPUs only) is this module's own:
a cluster without GPUs places servers by CPUs (``ray_server_cpus``). The server listens
on 127.0.0.1 (every node is this machine).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster

from service.control.procs import rpc_dir
from tests.conftest import make_client, wait_finished, wait_for
from tests.ports import service_server_ports

pytestmark = pytest.mark.e2e

NAMESPACE = "decodebench-test-vllm"
# A KV cache of a tenth of the machine's memory (2.4 GB here; the CPU default is 0.3): the
# suite runs this beside the real-vLLM modules' servers, and vLLM on a CPU refuses to start
# when the share it asks is not free.
SPEC: dict[str, Any] = {"input_len": 1024, "output_len": 16, "num_prompts": 3, "max_concurrency": 1,
                        "seed": 11, "fill": {"mean": 0.7}, "engine": {"gpu_memory_utilization": 0.1}}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    made.wait_for_nodes()
    ray.init(address=made.address, namespace=NAMESPACE, log_to_driver=False)
    yield made
    ray.shutdown()
    made.shutdown()


def _texts(client: Any, run_id: str) -> list[str]:
    """A run's generated texts, in request order."""
    samples = client.get(f"/api/runs/{run_id}/requests").json()
    return [s["generated_text"] for s in sorted(samples, key=lambda s: s["index"])]


def _run_texts(tmp_path: Path, **settings: Any) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """A fill run on a real vLLM server: its generated texts, the run, and its server."""
    with make_client(tmp_path, vllm_command=None, worker_start_timeout_s=300, **settings) as client:
        run_id = client.post("/api/runs", json=SPEC).json()["id"]
        done = wait_finished(client, run_id, timeout=600)
        assert done["status"] == "succeeded", done["error"]
        # The connector's report arrives about once a second after its last request.
        done = wait_for(client, run_id, lambda r: r["connector"].get("requests_filled") == 3, timeout=30)
        worker = client.get(f"/api/workers/{done['worker_id']}").json()
        texts = _texts(client, run_id)
        # vLLM made its sockets in the server's own directory on its node (this machine)...
        sockets = list(rpc_dir(worker["id"]).iterdir())
        assert sockets and all(path.is_socket() for path in sockets), sockets
    # ... which went with the server when the service stopped it.
    assert not rpc_dir(worker["id"]).exists()
    return texts, done, worker


def test_a_vllm_server_on_ray_generates_what_a_local_one_does(
        cluster: Cluster, real_tiny_service: httpx.Client, tmp_path: Path) -> None:
    ports = service_server_ports()
    on_ray, run, worker = _run_texts(tmp_path / "ray", ray_address=cluster.address, ray_namespace=NAMESPACE,
                                     ray_server_host="127.0.0.1", ray_server_cpus=1.0, server_ports=ports)
    assert worker["backend"] == "ray" and worker["node"]["id"]
    # Its node's host gave it a port of the range the service was told (DECODEBENCH_SERVER_PORTS).
    low, high = (int(p) for p in ports.split("-"))
    assert low <= int(worker["url"].rsplit(":", 1)[1]) <= high, worker["url"]
    # The connector pulled this run's values from the service and reported what it filled.
    assert run["connector"]["pulls"] >= 1
    assert run["connector"]["filled_requests"] == 3 and run["connector"]["other_requests"] == 0
    # The same run on a local server: the tiny server the other e2e modules share (its KV
    # cache the CPU default's size; the cache's size changes no token), not one more start.
    local_spec = {key: value for key, value in SPEC.items() if key != "engine"}
    local_id = real_tiny_service.post("/api/runs", json=local_spec).json()["id"]
    local_run = wait_finished(real_tiny_service, local_id, timeout=600)
    assert local_run["status"] == "succeeded", local_run["error"]
    local_worker = real_tiny_service.get(f"/api/workers/{local_run['worker_id']}").json()
    assert local_worker["backend"] == "local"
    local = _texts(real_tiny_service, local_id)
    assert on_ray == local and all(on_ray)
