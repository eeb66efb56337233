"""End to end with a real vLLM (CPU) server and the FillConnector, through the service's own API.

One service process (``python -m service``, real HTTP, real SQLite) for the module;
its first run starts a real vLLM server on the bundled tiny model, later runs
reuse it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.control.procs import rpc_dir
from service.core.spec import RunSpec
from service.core.tinymodel import MAX_MODEL_LEN, TINY_MODEL_NAME, VOCAB_SIZE, ensure_tiny_model
from service.load.plan import make_plan
from tests.conftest import API_TOKEN, wait_finished, wait_for
from tests.ports import free_port
from tests.vllm_process import start_vllm
from tests.vllm_process import stop as _stop
from tests.vllm_process import wait_healthy as _wait_healthy

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


class SlowPulls:
    """A proxy in front of the service that holds every fill-parameter pull ``delay_s``
    before forwarding it (the slow control plane is the point); reports pass straight."""

    def __init__(self, upstream: str, delay_s: float) -> None:
        self.pulls = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                if self.path.startswith("/api/connector/fill"):
                    proxy.pulls += 1
                    time.sleep(delay_s)
                length = int(self.headers.get("Content-Length") or 0)
                answer = httpx.request(
                    method, upstream.rstrip("/") + self.path, content=self.rfile.read(length),
                    headers={k: v for k, v in self.headers.items()
                             if k.lower() in ("authorization", "content-type")}, timeout=30)
                self.send_response(answer.status_code)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def service(real_tiny_service: httpx.Client) -> httpx.Client:
    return real_tiny_service  # one service and tiny server for the tiny model's e2e modules


def _start_vllm(model_dir: Path, log_path: Path, *extra: str,
                port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    return start_vllm(model_dir, log_path, *extra, served_name=TINY_MODEL_NAME, port=port)


@pytest.fixture(scope="module")
def reference_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Two plain vLLM servers on the tiny model: one without a connector, one with vLLM's
    own DecodeBenchConnector (fill mean 0.7)."""
    root = tmp_path_factory.mktemp("reference")
    model_dir = ensure_tiny_model(root / "models")
    upstream_config = json.dumps({"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"fill_mean": 0.7, "fill_std": 0.0}})
    plain = _start_vllm(model_dir, root / "plain.log")
    upstream = _start_vllm(model_dir, root / "upstream.log", "--kv-transfer-config", upstream_config)
    try:
        _wait_healthy(*plain, root / "plain.log")
        _wait_healthy(*upstream, root / "upstream.log")
        _REFERENCES.update({plain[1]: (plain[0], root / "plain.log"),
                            upstream[1]: (upstream[0], root / "upstream.log")})
        yield {"plain": plain[1], "upstream": upstream[1]}
    finally:
        _REFERENCES.clear()
        _stop(plain[0])
        _stop(upstream[0])


# A reference server's process and log, by URL: a failure says how the server ended.
_REFERENCES: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}


def _reference_end(url: str) -> str:
    if url not in _REFERENCES:
        return ""
    proc, log_path = _REFERENCES[url]
    return f"; its exit code: {proc.poll()}; its log's end:\n{log_path.read_text(errors='replace')[-3000:]}"


def _generate(url: str, spec: dict[str, Any]) -> list[str]:
    """What a server generates, greedily, for the prompts a run with ``spec`` sends."""
    plan = make_plan(RunSpec(**spec), VOCAB_SIZE)
    texts = []
    for position in range(plan.warmups, len(plan.input_lens)):
        body = {"model": TINY_MODEL_NAME, "prompt": plan.prompt(position),
                "max_tokens": int(plan.output_lens[position]), "ignore_eos": True,
                "temperature": 0.0}
        try:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        except httpx.TransportError as exc:
            raise AssertionError(f"{url} did not answer ({exc}){_reference_end(url)}") from None
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


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
    # The service is shared with the tiny model's other e2e modules: its server may have
    # served their runs already.
    served_before = {w["id"]: w["runs_served"] for w in service.get("/api/workers").json()}
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
    # vLLM made its inter-process sockets in the server's own directory (removed when the
    # server stops), not loose in the temp dir, where a stopped server's stay.
    sockets = list(rpc_dir(first["worker_id"]).iterdir())
    assert sockets and all(path.is_socket() for path in sockets), sockets
    # vLLM bound the worker the way the service asked: one core reserved, as for a server
    # without a connector (service/control/cpu_binding.py), not none.
    binding = first["cpu_binding"]
    assert binding["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    if len(os.sched_getaffinity(0)) > 1:
        assert len(binding["reserved_cores"]) == 1
        assert binding["omp_cores"]["0"] and not set(binding["omp_cores"]["0"]) & set(
            binding["reserved_cores"])
    assert {w["code"] for w in first["warnings"]} <= {"bunched_streams"}, first["warnings"]
    # Every request was filled with this run's values, on both connector sides.
    connector = first["connector"]
    assert connector["filled_requests"] == 16 and connector["requests_filled"] == 16
    assert connector["other_requests"] == 0
    # The server's own view was read at the run's start and end (not during it: a scrape
    # stalls the server's streams, service/settings.py) and kept; its counters cover the run.
    view = service.get(f"/api/runs/{first['id']}/server-metrics").json()
    assert len(view["points"]) == 2
    running = [p["values"].get("vllm:num_requests_running", 0) for p in view["points"]]
    assert max(running) <= 4
    assert view["summary"]["deltas"]["vllm:generation_tokens"] >= 16 * 32

    second = _run(service, input_len=4096, output_len=32, num_prompts=8, max_concurrency=4,
                  fill={"mean": 0.5, "std": 0.0})
    assert second["worker_id"] == first["worker_id"]
    assert second["connector"]["pulls"] == 1
    workers = service.get("/api/workers").json()
    live = [(w["id"], w["status"]) for w in workers if w["status"] not in ("stopped", "failed", "removed")]
    assert live == [(first["worker_id"], "ready")]
    (worker,) = [w for w in workers if w["id"] == first["worker_id"]]
    assert worker["kv_tokens"] > 100_000  # read from the server's cache_config_info
    # Started with --max-model-len -1: vLLM kept the tiny model's own length, which its KV
    # cache holds, and said so on /v1/models.
    assert worker["max_model_len"] == MAX_MODEL_LEN
    assert worker["runs_served"] == served_before.get(worker["id"], 0) + 2

    # The real connector reported what the server resolved, and the run recorded it.
    prov = first["provenance"]
    assert prov["reported"] is True, prov
    engine = prov["engine"]
    assert engine["dtype"] == "float32" and engine["max_model_len"] == MAX_MODEL_LEN
    assert engine["gpu_memory_utilization"] == 0.3 and engine["enforce_eager"] is True
    assert engine["load_format"] == "dummy" and engine["device"] == "cpu"
    assert engine["tensor_parallel_size"] == 1 and engine["block_size"] > 0
    assert prov["kv_cache"]["tokens"] == prov["kv_cache_tokens"] == worker["kv_tokens"]
    assert prov["versions"]["vllm"] and prov["versions"]["torch"] == importlib.metadata.version("torch")
    assert prov["hardware"]["cpu_cores"] == os.cpu_count() and prov["hardware"]["cpu_model"]
    argv = prov["worker"]["argv"]
    assert "--kv-transfer-config" in argv
    assert argv[argv.index("--max-model-len") + 1] == "-1"
    exported = service.get(f"/api/runs/{first['id']}/export").json()
    assert exported["kv_prefill"].startswith("filled") and exported["dtype"] == "float32"
    assert exported["decodebench"]["provenance"]["engine"] == engine

    page = service.get(f"/runs/{first['id']}")
    assert page.status_code == 200 and "median" in page.text
    assert first["id"] in service.get("/").text


def test_a_run_cancelled_midway_leaves_its_real_server_serving(service: httpx.Client) -> None:
    # After a cancel the server must answer a one-token request (untagged: the connector
    # treats it as its defaults say) before it takes another run; a real one does.
    # Long enough that an idle machine cannot finish it before the cancel (about 100 s
    # uncancelled); the cancel comes after the first request is in.
    spec = {"input_len": 2048, "output_len": 512, "num_prompts": 400, "max_concurrency": 4}
    run = service.post("/api/runs", json=spec).json()
    going = wait_for(service, run["id"], lambda r: r["progress"]["completed"] >= 1, timeout=600)
    assert going["status"] == "running"
    cancelled = service.post(f"/api/runs/{run['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    after = _run(service, input_len=1024, output_len=16, num_prompts=4, max_concurrency=2)
    assert after["worker_id"] == going["worker_id"]
    assert service.get(f"/api/workers/{going['worker_id']}").json()["status"] == "ready"


def test_the_command_line_runs_a_fill_benchmark_on_the_real_server(
        service: httpx.Client, tmp_path: Path) -> None:
    """``decodebench bench serve`` with vLLM's flags, once against a real vLLM CPU server: the
    result block, decodebench's lines and the result file, from the connector's fill."""
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "--url", str(service.base_url), "--token", API_TOKEN,
         "bench", "serve", "--dataset-name", "random", "--random-input-len", "4096",
         "--random-output-len", "16", "--num-prompts", "4", "--max-concurrency", "2",
         "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{'Successful requests:':<40} {4:<10}" in done.stdout
    assert "fill: KV cache filled by the connector" in done.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 4 and result["total_input_tokens"] == 4 * 4096
    assert result["decodebench_mode"] == "fill"
    assert result["decodebench"]["connector"]["pulls"] == 1
    assert result["decodebench"]["decode"]["decode_median_itl_ms"] > 0


def test_fill_values_change_the_generated_tokens(service: httpx.Client) -> None:
    common: dict[str, Any] = {"input_len": 2048, "output_len": 16, "num_prompts": 3,
                              "max_concurrency": 1, "seed": 7}
    low = _run(service, **common, fill={"mean": 0.015})
    high = _run(service, **common, fill={"mean": 1.5})
    low_again = _run(service, **common, fill={"mean": 0.015})
    assert _texts(service, low["id"]) == _texts(service, low_again["id"])
    assert _texts(service, low["id"]) != _texts(service, high["id"])


def _connector_settled(client: httpx.Client, run_id: str, key: str, value: int) -> dict[str, Any]:
    """The run once its connector report (sent about once a second) shows ``key == value``."""
    run = wait_for(client, run_id, lambda r: r["connector"].get(key) == value, timeout=15)
    return dict(run["connector"])


def test_connector_reports_what_it_filled(service: httpx.Client) -> None:
    run = _run(service, input_len=3000, output_len=4, num_prompts=5, max_concurrency=5)
    report = _connector_settled(service, run["id"], "requests_filled", 5)
    assert report["requests_seen"] == 5 and report["filled_requests"] == 5
    assert report["prefill_requests"] == 0 and report["other_requests"] == 0
    assert report["blocks_filled"] >= 5
    # 2 layers x (K, V) x 2 KV heads x head dim 32 x 4 bytes = 1,024 bytes per token,
    # and every filled block holds block_size tokens.
    per_block = report["bytes_filled"] / report["blocks_filled"]
    assert per_block >= 1024 and per_block % 1024 == 0
    assert report["fill_seconds"] > 0


def test_the_connector_reports_the_decode_roofline_of_its_server(service: httpx.Client) -> None:
    run = _run(service, input_len=256, output_len=4, num_prompts=2, max_concurrency=2)
    (worker,) = [w for w in service.get("/api/workers").json() if w["id"] == run["worker_id"]]
    roof = worker["provenance"]["reported"]["roofline"]
    # 2 layers x (K, V) x 2 KV heads x head dim 32 x 4 bytes (float32), from the server's tensors.
    assert roof["kv_bytes_per_token"] == 1024
    # The tiny model without its input embedding table (tests/test_roofline_facts.py).
    assert roof["weight_params"] == 1_344_128 and roof["weight_bytes"] == 1_344_128 * 4
    assert (roof["kv_dtype"], roof["weight_dtype"], roof["tensor_parallel_size"]) == (
        "float32", "float32", 1)
    measured = roof["bandwidth"]
    assert measured["measured_bytes_per_s"] > 0 and measured["fill_bytes_per_s"] > 0
    assert measured["how"] == "copy of 64 MiB on cpu, best of 5"
    assert measured["spec_bytes_per_s"] is None and roof["device"].startswith("cpu")
    assert run["provenance"]["roofline"] == roof


def test_fill_run_generates_what_vllms_decode_bench_connector_generates(
    service: httpx.Client, reference_servers: dict[str, str]
) -> None:
    spec: dict[str, Any] = {"input_len": 3000, "output_len": 12, "num_prompts": 3,
                            "max_concurrency": 1, "seed": 21, "fill": {"mean": 0.7, "std": 0.0}}
    ours = _run(service, **spec)
    expected = _generate(reference_servers["upstream"], spec)
    assert _texts(service, ours["id"]) == expected
    # The tokens depend on the fill: a server without a connector generates others.
    assert _generate(reference_servers["plain"], spec) != expected


def test_prefill_run_after_fill_run_matches_a_server_without_connector(
    service: httpx.Client, reference_servers: dict[str, str]
) -> None:
    # Longer than one prompt block (``service.load.plan.PROMPT_BLOCK``): the driver streams
    # these prompts block by block, and the server must still see exactly them.
    spec: dict[str, Any] = {"input_len": 9000, "output_len": 12, "num_prompts": 3,
                            "max_concurrency": 1, "seed": 33}
    fill = _run(service, **spec, fill={"mean": 2.0})
    prefill = _run(service, **spec, mode="prefill")
    assert prefill["worker_id"] == fill["worker_id"]  # same server, no restart
    expected = _generate(reference_servers["plain"], spec)
    assert _texts(service, prefill["id"]) == expected
    assert _texts(service, fill["id"]) != expected
    report = _connector_settled(service, prefill["id"], "prefill_requests", 3)
    assert report["requests_filled"] == 0 and report["filled_requests"] == 0
    assert report["other_requests"] == 0


def test_a_registered_vllm_server_fills_with_the_values_the_service_gives_it(
    service: httpx.Client, reference_servers: dict[str, str], tmp_path: Path
) -> None:
    """A vLLM server started by someone else, loaded with the connector config that
    registration answers, serves a run and fills with that run's values, even when the
    service answers its pull slowly (through a proxy that holds each pull 1 s): the
    request waits in vLLM's queue for its run's values, it is never filled with others."""
    engine = {"max_model_len": 8192}
    port = free_port()
    response = service.post("/api/workers", json={
        "url": f"http://127.0.0.1:{port}", "model": TINY_MODEL_NAME, "engine": engine})
    assert response.status_code == 201, response.text
    registered = response.json()
    assert "--max-model-len 8192" in registered["vllm_serve"]
    model_dir = ensure_tiny_model(tmp_path / "models")
    log_path = tmp_path / "registered.log"
    slow = SlowPulls(str(service.base_url), delay_s=1.0)
    kv_config = registered["kv_transfer_config"]
    kv_config["kv_connector_extra_config"]["control_url"] = slow.url
    proc, url = _start_vllm(model_dir, log_path, "--max-model-len", "8192", "--kv-transfer-config",
                            json.dumps(kv_config), port=port)
    try:
        _wait_healthy(proc, url, log_path)
        wait_worker = time.monotonic() + 30
        while service.get(f"/api/workers/{registered['id']}").json()["status"] != "ready":
            assert time.monotonic() < wait_worker, "the service never saw the server answer"
            time.sleep(0.2)
        spec: dict[str, Any] = {"input_len": 3000, "output_len": 12, "num_prompts": 3,
                                "max_concurrency": 1, "seed": 21, "fill": {"mean": 0.7, "std": 0.0},
                                "engine": engine}
        run = _run(service, **spec)
        assert run["worker_id"] == registered["id"]
        assert run["connector"]["pulls"] == 1
        # The same tokens as vLLM's own DecodeBenchConnector filling with 0.7.
        assert _texts(service, run["id"]) == _generate(reference_servers["upstream"], spec)
        report = _connector_settled(service, run["id"], "requests_filled", 3)
        assert report["filled_requests"] == 3 and report["other_requests"] == 0
        assert report["waited_requests"] >= 1  # the first request waited for the slow pull
        assert slow.pulls == 1
    finally:
        slow.close()
        _stop(proc)
        service.delete(f"/api/workers/{registered['id']}")


def test_a_run_that_oversubscribes_the_server_carries_preempted_and_queued(
    service: httpx.Client
) -> None:
    """A server with 24 blocks of 128 tokens (3,072 tokens) that runs at most 2 requests:
    four requests of 1,000 + 1,000 tokens sent at once (each fits; two together do not)
    make vLLM preempt, and two wait in its queue for a whole request; the run says both,
    from the server's counters read at its start and end. Last in the module: its own
    small server replaces the shared one."""
    engine = {"max_model_len": 2048,
              "extra_args": ["--num-gpu-blocks-override=24", "--max-num-seqs=2"]}
    run = _run(service, input_len=1000, output_len=1000, num_prompts=4, max_concurrency=None,
               request_rate=100.0, seed=5, engine=engine)
    preempted = [w for w in run["warnings"] if w["code"] == "preempted"]
    assert preempted, run["warnings"]
    assert preempted[0]["figure"] >= 1
    queued = [w for w in run["warnings"] if w["code"] == "queued_in_server"]
    assert queued and "vllm:request_queue_time_seconds" in queued[0]["message"], run["warnings"]
    view = service.get(f"/api/runs/{run['id']}/server-metrics").json()
    assert view["summary"]["deltas"]["vllm:num_preemptions"] >= 1
    assert view["summary"]["deltas"]["vllm:request_queue_time_seconds_count"] >= 4
    assert queued[0]["figure"] >= 0.2  # two of four waited for one of the others to finish
    # The same arithmetic at a fixed concurrency is refused before anything is sent.
    refused = service.post("/api/runs", json={"input_len": 1000, "output_len": 1000,
                                              "num_prompts": 4, "max_concurrency": 4,
                                              "engine": engine}).json()
    done = wait_finished(service, refused["id"], timeout=120)
    assert done["status"] == "failed"
    assert "4 requests at once x 2,000 tokens" in done["error"] and "3,072" in done["error"]
