"""Real processes for end-to-end tests: the service (``python -m service``) with no stub
vLLM command, and plain vLLM CPU servers started by the test itself as references.

Each is a process group of its own (stopped as one) in the suite's session, as the service
keeps its servers in its own session (``service.control.procs``). Linux schedules each
session as one group with an equal share of the CPU: a vLLM server in a session of its own
took a whole share beside the one that every other test, its service and its stub servers
shared on the pytest-xdist workers (where a fresh-clone run on 4 workers once saw a stub
server not answer /health for a minute).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.conftest import API_TOKEN, AUTH, wait_answering
from tests.ports import free_port, service_server_ports

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def real_service(data_dir: Path, **env_extra: str) -> Iterator[httpx.Client]:
    """The service as a real process that starts real vLLM servers; stopped with SIGTERM."""
    port = free_port()
    env = {**os.environ, "DECODEBENCH_DATA_DIR": str(data_dir), "DECODEBENCH_PORT": str(port),
           "DECODEBENCH_GPUS": "", "DECODEBENCH_API_TOKEN": API_TOKEN,
           "DECODEBENCH_SERVER_PORTS": service_server_ports(), **env_extra}
    env.pop("DECODEBENCH_VLLM_COMMAND", None)
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir.parent / "service.log"
    with log_path.open("wb") as log:
        # A process group of its own, in the suite's session (see the module's docstring).
        proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, process_group=0)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=30)
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


# A started server's socket directory, by its pid: ``stop`` removes it.
_RPC_DIRS: dict[int, Path] = {}


def start_vllm(model_dir: Path, log_path: Path, *extra: str, served_name: str, dtype: str = "float32",
               kv_bytes: int = 1 << 30, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A plain vLLM server on ``model_dir`` with dummy weights, in a process group of its
    own in the suite's session, on ``port`` or a free one."""
    port = port or free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--load-format", "dummy", "--enforce-eager",
            # A fixed KV cache (1 GiB by default) leaves room for the service's own server.
            "--kv-cache-memory-bytes", str(kv_bytes), *extra]
    # The connector package is importable the way a user installs it next to vLLM.
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    # Its sockets in a directory of its own, removed by ``stop``, as the service does.
    rpc = Path(tempfile.mkdtemp(prefix="decodebench-test-rpc-"))
    env = {**os.environ, "PYTHONPATH": path, "VLLM_RPC_BASE_PATH": str(rpc)}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, process_group=0, env=env)
    _RPC_DIRS[proc.pid] = rpc
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    """Wait until a server answers /health; fail with its log's end if it exits or hangs."""
    wait_answering(f"{url}/health", timeout=300, every=0.5, what="the vLLM server",
                   ended=lambda: None if proc.poll() is None else log_path.read_text()[-3000:])
    # What answered is this server, not another program on its port: its own HTTP server
    # said it started (uvicorn's line, before it answers), and it still runs.
    started = "Application startup complete." in log_path.read_text(errors="replace")
    assert started and proc.poll() is None, (
        f"something answered {url}/health but the vLLM server there has not started"
        f" (exit code {proc.poll()}):\n{log_path.read_text(errors='replace')[-3000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server's whole process group: SIGTERM, then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    rpc = _RPC_DIRS.pop(proc.pid, None)
    if rpc is not None:
        shutil.rmtree(rpc, ignore_errors=True)
