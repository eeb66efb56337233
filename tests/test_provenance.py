"""Provenance: every run records, shows and exports the setup its numbers came from.

The stub vLLM server plays the connector's part (it reports its provenance at start, as
``connector.provenance`` does); the connector's own builder is checked against a real
``VllmConfig`` and through vLLM's real scheduler, which builds the connector itself.
"""

from __future__ import annotations

import csv
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.control import provenance
from service.core.protocol import WorkerProvenance
from service.core.spec import RunSpec
from service.core.status import RunStatus
from service.core.tinymodel import MAX_MODEL_LEN
from service.storage import store, workers
from service.storage.db import make_engine
from service.storage.tables import Worker
from tests.conftest import make_client, wait_finished

SMALL = {"input_len": 64, "output_len": 8, "num_prompts": 6, "max_concurrency": 2}
TOKEN = "worker-token-that-must-never-show-0123456789"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, dict[str, Any],
                                                                       dict[str, Any]]]:
    """One service with a stub worker, a finished fill run and a finished prefill run on it."""
    with make_client(tmp_path_factory.mktemp("provenance")) as client:
        fill = wait_finished(client, client.post("/api/runs", json={
            **SMALL, "fill": {"mean": 0.25, "std": 0.5}}).json()["id"])
        prefill = wait_finished(client, client.post("/api/runs", json={
            **SMALL, "mode": "prefill"}).json()["id"])
        assert fill["status"] == prefill["status"] == "succeeded", (fill["error"], prefill["error"])
        yield client, fill, prefill


def test_a_run_records_its_workers_provenance_as_the_connector_reported_it(
    served: tuple[TestClient, dict[str, Any], dict[str, Any]],
) -> None:
    _, run, _ = served
    prov = run["provenance"]
    assert prov["reported"] is True
    # As the worker resolved them (the stub resolves the flags the service gave it), not
    # the spec's nulls.
    assert run["spec"]["engine"]["dtype"] is None
    assert prov["engine"]["dtype"] == "float32"
    assert prov["engine"]["gpu_memory_utilization"] == 0.3
    # --max-model-len -1: the tiny model's own length, which the stub's KV cache holds.
    assert prov["engine"]["max_model_len"] == MAX_MODEL_LEN
    assert prov["engine"]["enforce_eager"] is True
    assert prov["versions"]["vllm"] == "0.0.0-stub"
    assert prov["hardware"]["cpu_model"] == "Stub CPU"
    assert prov["decodebench"]["version"] == "0.1.0"
    assert prov["mode"] == "fill" and prov["fill"] == {"mean": 0.25, "std": 0.5, "startup": False}
    assert prov["prefill"].startswith("filled")
    assert prov["load_format"] == "dummy" and prov["weights"].startswith("dummy")
    assert prov["kv_cache_groups"] == [{"index": 0, "kind": "FullAttention", "block_size": 16,
                                        "sliding_window": None, "layers": 2, "fill": "per request"}]
    assert prov["kv_cache_tokens"] == 100_000 * 16  # the server's cache_config_info
    worker = prov["worker"]
    assert worker["id"] == run["worker_id"] and worker["external"] is False
    # The command line as the service started the worker: its connector config is in it,
    # with the worker token hidden.
    config = json.loads(worker["argv"][worker["argv"].index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["worker_token"] == provenance.REDACTED
    assert worker["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == run["cpu_binding"]["env"][
        "VLLM_CPU_NUM_OF_RESERVED_CPU"]


def test_the_worker_keeps_what_its_connector_reported(
    served: tuple[TestClient, dict[str, Any], dict[str, Any]],
) -> None:
    client, run, _ = served
    worker = client.get(f"/api/workers/{run['worker_id']}").json()
    reported = worker["provenance"]["reported"]
    assert reported["engine"]["dtype"] == "float32"
    # The stub's own command line, as a connector sees its server's; the token hidden.
    assert provenance.REDACTED in " ".join(reported["argv"])
    assert "--kv-transfer-config" in worker["provenance"]["launch"]["argv"]


def test_the_vllm_export_keeps_vllms_keys_and_adds_the_provenance(
    served: tuple[TestClient, dict[str, Any], dict[str, Any]],
) -> None:
    client, run, _ = served
    export = client.get(f"/api/runs/{run['id']}/export", params={"format": "vllm"}).json()
    for key in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                "max_concurrency", "completed", "median_tpot_ms", "itls"):
        assert key in export, key
    # Top-level keys as vLLM's --metadata KEY=VALUE writes them: strings.
    assert export["kv_prefill"].startswith("filled:")
    assert "not comparable" in export["kv_prefill"]
    assert export["decodebench_mode"] == "fill"
    assert export["vllm_version"] == "0.0.0-stub"
    assert export["dtype"] == "float32" and export["max_model_len"] == str(MAX_MODEL_LEN)
    assert export["gpu_memory_utilization"] == "0.3"
    assert export["kv_cache_tokens"] == str(100_000 * 16)
    assert export["decodebench_version"] == "0.1.0"
    assert export["hardware"].startswith("CPU Stub CPU")
    assert export["weights"].startswith("dummy")
    block = export["decodebench"]
    assert block["provenance"] == run["provenance"]


def test_a_prefill_runs_export_says_the_prefill_was_real(
    served: tuple[TestClient, dict[str, Any], dict[str, Any]],
) -> None:
    client, _, run = served
    export = client.get(f"/api/runs/{run['id']}/export").json()
    assert export["kv_prefill"].startswith("real")
    assert export["decodebench_mode"] == "prefill"
    assert run["provenance"]["fill"] is None


def test_the_csv_carries_the_mode_per_row(
    served: tuple[TestClient, dict[str, Any], dict[str, Any]],
) -> None:
    client, fill, prefill = served
    for run, mode in ((fill, "fill"), (prefill, "prefill")):
        text = client.get(f"/api/runs/{run['id']}/export", params={"format": "csv"}).text
        rows = list(csv.DictReader(io.StringIO(text)))
        assert len(rows) == 6 and {r["mode"] for r in rows} == {mode}


def test_the_run_page_shows_the_provenance(
    served: tuple[TestClient, dict[str, Any], dict[str, Any]],
) -> None:
    client, run, _ = served
    page = client.get(f"/runs/{run['id']}").text
    assert '<dl id="provenance"' in page
    assert "filled, not prefilled" in page
    assert "vllm 0.0.0-stub" in page
    assert "dtype=float32" in page and "gpu_memory_utilization=0.3" in page
    assert "Stub CPU" in page
    assert "1,600,000 tokens" in page
    assert "FullAttention, 2 layers, blocks of 16 tokens: filled per request" in page
    assert "&lt;redacted&gt;" in page
    # The worker's real token shows nowhere a reader can look.
    token = client.app.state.scheduler.fleet.tokens[run["worker_id"]]  # type: ignore[attr-defined]
    assert token not in page
    assert token not in client.get(f"/api/runs/{run['id']}").text
    assert token not in client.get(f"/api/runs/{run['id']}/export").text
    assert token not in client.get(f"/api/workers/{run['worker_id']}").text


def test_the_provenance_route_takes_only_a_worker_token(
    served: tuple[TestClient, dict[str, Any], dict[str, Any]],
) -> None:
    client, _, _ = served
    anonymous = client.post("/api/connector/provenance", json={}, headers={"Authorization": ""})
    assert anonymous.status_code == 401
    # The API token is not a worker's.
    assert client.post("/api/connector/provenance", json={}).status_code == 401


def test_a_report_after_the_run_took_its_worker_fills_the_runs_provenance(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "db.sqlite3")
    try:
        run, _ = store.create_run(engine, RunSpec(**SMALL))
        workers.add_worker(engine, Worker(
            id="w-1", key="k", model=run.model, engine={}, url="http://127.0.0.1:1", port=1,
            token_hash=workers.hash_token(TOKEN), log_path="/dev/null",
            provenance={"launch": provenance.launch(["vllm", "--x", TOKEN], {"VLLM_API_KEY": "s"},
                                                    TOKEN)}))
        assert store.transition(engine, run.id, RunStatus.starting)
        store.update_fields(engine, run.id, worker_id="w-1")
        facts = provenance.service_facts()
        early = store.snapshot_provenance(engine, run.id, "w-1", "auto", None, facts)
        assert early is not None and early["reported"] is False and early["engine"] is None
        assert early["worker"]["argv"] == ["vllm", "--x", provenance.REDACTED]
        assert early["worker"]["env"] == {"VLLM_API_KEY": provenance.REDACTED}
        reported = WorkerProvenance(engine={"dtype": "bfloat16"},
                                    kv_cache={"num_blocks": 10, "block_size": 16, "tokens": 160})
        workers.record_worker_provenance(engine, "w-1", reported.model_dump())
        late = store.get_run(engine, run.id).provenance
        assert late is not None and late["reported"] is True
        assert late["engine"] == {"dtype": "bfloat16"}
        assert late["kv_cache_tokens"] == 160  # the connector's count where /metrics gave none
        assert late["decodebench"] == facts
    finally:
        engine.dispose()


def test_service_facts_name_the_version_and_the_commit_of_a_checkout() -> None:
    facts = provenance.service_facts()
    assert facts["version"] == "0.1.0"
    if (provenance.REPO_ROOT / ".git").exists():
        assert facts["commit"] is not None and len(facts["commit"]) == 40


# --- the connector's side, against vLLM's own config and scheduler ----------------------


def test_the_connector_describes_a_real_vllm_config(tmp_path: Path) -> None:
    import vllm

    from connector.provenance import REDACTED, build
    from tests import vllm_harness

    config = vllm_harness.vllm_config(tmp_path, vllm_harness.OURS)
    kv = vllm_harness.kv_config([(["layer.0"], vllm_harness.attention())], num_blocks=2000)
    argv = ["/x/api_server.py", "--kv-transfer-config", json.dumps({"worker_token": TOKEN}),
            "--api-key", "sk-secret"]
    environ = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_API_KEY": "sk-secret",
               "CUDA_VISIBLE_DEVICES": "", "HOME": "/root"}
    report = build(config, kv, TOKEN, argv=argv, environ=environ)
    engine = report["engine"]
    assert engine["dtype"] == "float32" and engine["max_model_len"] == 8192
    assert engine["gpu_memory_utilization"] == 0.5 and engine["block_size"] == 16
    assert engine["kv_cache_dtype"] == "auto" and engine["enable_prefix_caching"] is True
    assert engine["enable_chunked_prefill"] is True and engine["max_num_seqs"] == 256
    assert engine["max_num_batched_tokens"] == 4096 and engine["tensor_parallel_size"] == 1
    assert engine["load_format"] == "auto" and engine["device"] == "cpu"
    assert isinstance(engine["enforce_eager"], bool)
    assert report["kv_cache"] == {"num_blocks": 2000, "block_size": 16, "tokens": 32_000, "groups": 1,
                                  "startup_fill": False}
    assert report["kv_cache_groups"] == [{"index": 0, "kind": "FullAttention", "block_size": 16,
                                          "sliding_window": None, "layers": 1, "fill": "per request"}]
    assert report["versions"]["vllm"] == vllm.__version__
    assert report["hardware"]["cpu_cores"] == os.cpu_count()
    assert "gpus" not in report["hardware"]  # a CPU server
    assert report["env"] == {"CUDA_VISIBLE_DEVICES": "", "VLLM_API_KEY": REDACTED,
                             "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert TOKEN not in json.dumps(report["argv"]) and "sk-secret" not in report["argv"]
    # What the service takes: plain JSON, every section kept (the worker side sends ``roofline``).
    taken = WorkerProvenance.model_validate(json.loads(json.dumps(report)))
    assert taken.model_dump(exclude_unset=True) == report


class ProvenanceSink:
    """A control service that keeps the provenance reports it is sent."""

    def __init__(self, answer_after_s: float = 0.0) -> None:
        self.reports: list[tuple[str, dict[str, Any]]] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/api/connector/provenance":
                    sink.reports.append((self.headers.get("Authorization", ""), body))
                    time.sleep(answer_after_s)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_scheduler_side_sends_its_provenance_once_at_start(tmp_path: Path) -> None:
    from tests import vllm_harness

    # The sink answers late, so the engine shuts the connector down while the report
    # thread's post is still in flight: the shutdown's flush must not send it again.
    sink = ProvenanceSink(answer_after_s=0.5)
    try:
        config = vllm_harness.vllm_config(tmp_path, vllm_harness.OURS,
                                          {"control_url": sink.url, "worker_token": TOKEN})
        kv = vllm_harness.kv_config([(["layer.0"], vllm_harness.attention())], num_blocks=500)
        scheduler = vllm_harness.scheduler(config, kv)
        deadline = time.monotonic() + 10
        while not sink.reports and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.connector is not None
        scheduler.connector.shutdown()
        assert len(sink.reports) == 1
        auth, report = sink.reports[0]
        assert auth == f"Bearer {TOKEN}"
        assert report["engine"]["max_model_len"] == 8192
        assert report["kv_cache"]["tokens"] == 500 * 16
    finally:
        sink.server.shutdown()
        sink.server.server_close()
