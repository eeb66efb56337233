"""The service's terminal says what happened (runs queued, started and ended; servers
starting, with what they are doing, and ready), not every poll; and a run waiting for its
server says so on the command line and in ``/live``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from service.control.startup_errors import clock, startup_phase
from tests.conftest import API_TOKEN
from tests.service_process import REPO, ServiceProcess

ACCESS = re.compile(r'"(GET|POST|PUT|DELETE|HEAD) (\S+) HTTP/[\d.]+" (\d{3})')
# The start of a real vLLM 0.32 log (CPU), up to the weights being loaded.
VLLM_START = """\
(APIServer pid=6392) INFO 11-26 16:00:27 [api_utils.py:286] non-default args: {'host': '127.0.0.1'}
(APIServer pid=6392) INFO 11-26 16:00:27 [model.py:733] Resolved architecture: LlamaForCausalLM
(APIServer pid=6392) WARNING [vllm.py:1703] Enforce eager set, disabling torch.compile, CUDAGraphs
(EngineCore pid=6420) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='m'
(Worker pid=6439) INFO 11-26 16:00:40 [cpu_model_runner.py:68] Starting to load model /models/tiny...
"""


def test_the_phase_of_a_start_is_read_from_the_servers_log() -> None:
    lines = VLLM_START.splitlines()
    assert startup_phase(lines[:1]) == "reading its model's config"
    # "torch.compile" in a warning at the start is no compile phase: phases only move on.
    assert startup_phase(lines[:3]) == "reading its model's config"
    assert startup_phase(lines[:4]) == "starting its engine"
    assert startup_phase(lines) == "loading weights"
    ready = "(EngineCore pid=1) INFO [core.py:402] init engine (profile, create kv cache, warmup) took 6.59 s"
    assert startup_phase([ready], "loading weights") == "engine ready, starting its API server"
    assert startup_phase(["(EngineCore pid=1) INFO connector line"], "loading weights") == "loading weights"
    assert [clock(s) for s in (5, 80, 3725)] == ["5s", "1m20s", "1h02m"]


def test_the_log_tells_what_happened_and_the_wait_for_a_server_is_said(tmp_path: Path) -> None:
    excerpt = tmp_path / "vllm-start.log"
    excerpt.write_text(VLLM_START)
    # A server whose start takes 17 s, its log stopped at loading weights meanwhile.
    service = ServiceProcess(tmp_path / "var", {"STUB_PRINT_LOG": str(excerpt), "STUB_STARTUP_DELAY_S": "17"})
    service.start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "service.cli", "--url", service.url, "--token", API_TOKEN,
             "bench", "serve", "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4"],
            cwd=REPO, capture_output=True, text=True, timeout=180)
    finally:
        service.stop()
    assert done.returncode == 0, done.stderr
    # The command line said what it waited for (not a bare "starting"), phase and all.
    waited = re.findall(r"r-\w+ starting vLLM server w-\w+: \d+s, (.*)", done.stderr)
    assert waited and waited[-1] == "loading weights", done.stderr
    # A new line when the phase moves, or every 10 s: not one a second for 17 s.
    assert len(waited) <= 3, done.stderr
    log = service.log()
    run_id = re.search(r"run (r-\w+) queued: decodebench-tiny, ISL 8, OSL 4, 4 prompts", log)
    assert run_id, log[-3000:]
    rid = run_id[1]
    assert re.search(rf"starting vLLM server (w-\w+) for run {rid}: 15s, loading weights", log), log[-3000:]
    assert re.search(rf"vLLM server w-\w+ ready at http://\S+ for run {rid}", log)
    assert re.search(rf"run {rid} started on vLLM server w-\w+: decodebench-tiny", log)
    assert re.search(rf"run {rid} succeeded \(4 requests answered, 0 failed\): decode median ITL "
                     r"[\d.]+ ms, decode median TPOT [\d.]+ ms", log), log[-3000:]
    # The access log keeps the call that changed something, not the polls (the command
    # line asked for /live twice a second for some 17 s).
    access = [(m[1], m[2], int(m[3])) for m in ACCESS.finditer(log)]
    assert ("POST", "/api/runs", 201) in access
    assert [a for a in access if a[0] == "GET"] == [], access


def test_every_request_is_in_the_access_log_when_asked(tmp_path: Path) -> None:
    service = ServiceProcess(tmp_path / "var", {"DECODEBENCH_ACCESS_LOG": "all"})
    service.start()
    try:
        with service.client() as c:
            assert c.get("/api/runs").status_code == 200
    finally:
        service.stop()
    assert ("GET", "/api/runs", 200) in [(m[1], m[2], int(m[3])) for m in ACCESS.finditer(service.log())]
