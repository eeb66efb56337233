"""Processes the service benchmarks start: the service itself and token stubs registered
with it. Not a benchmark of its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TOKEN = "bench-token-" + "x" * 24
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL = "bench/remote"

# The suite's ports (tests/ports.py: below the ephemeral range, checked free, handed in turn);
# the scripts import free_port from here.
sys.path.insert(0, str(REPO))
from tests.ports import free_port  # noqa: E402


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Wait until ``url`` answers at all; fail if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with code {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer") from None
            time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started in its own session, and its group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def service_with_stubs(data_dir: Path, stubs: int = 1, interval: float = 0.001,
                       env: dict[str, str] | None = None, log: Path | None = None
                       ) -> Iterator[tuple[httpx.Client, subprocess.Popen[bytes], list[dict[str, Any]]]]:
    """A service process (real HTTP, real SQLite) with ``stubs`` registered token stubs
    (``token_stub.py``, tokens ``interval`` s apart), all ready. Yields a client, the
    service's process and the stubs' registrations (``id``, ``url``, worker ``token``);
    everything is stopped afterwards. ``log``: where the service's output goes (else nowhere)."""
    procs: list[subprocess.Popen[bytes]] = []
    port = free_port()
    full_env = {**os.environ, "DECODEBENCH_DATA_DIR": str(data_dir), "DECODEBENCH_PORT": str(port),
                "DECODEBENCH_API_TOKEN": TOKEN, "DECODEBENCH_GPUS": "",
                "DECODEBENCH_VLLM_COMMAND": "/bin/false", "DECODEBENCH_WORKER_PROBE_S": "1",
                **(env or {})}
    base = f"http://127.0.0.1:{port}"
    try:
        out = log.open("ab") if log is not None else subprocess.DEVNULL
        service = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=full_env,
                                   stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        if log is not None:
            out.close()  # the service has its own copy
        procs.append(service)
        wait_http(f"{base}/healthz", service)
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as client:
            registered: list[dict[str, Any]] = []
            for _ in range(stubs):
                # Registered first: the stub is started with the connector config the
                # registration answers (its control URL and worker token), as a vLLM
                # server would be.
                stub_port = free_port()
                url = f"http://127.0.0.1:{stub_port}"
                answer = client.post("/api/workers", json={"url": url, "model": MODEL})
                answer.raise_for_status()
                registered.append(answer.json())
                stub = subprocess.Popen(
                    [sys.executable, str(HERE / "token_stub.py"), "--port", str(stub_port),
                     "--interval", str(interval), "--served-model-name", MODEL,
                     "--kv-transfer-config", json.dumps(answer.json()["kv_transfer_config"])],
                    start_new_session=True)
                procs.append(stub)
                wait_http(f"{url}/health", stub)
            deadline = time.monotonic() + 30
            while not all(client.get(f"/api/workers/{r['id']}").json()["status"] == "ready"
                          for r in registered):
                if time.monotonic() > deadline:
                    raise RuntimeError("registered stubs never became ready")
                time.sleep(0.1)
            yield client, service, registered
    finally:
        for proc in reversed(procs):
            stop(proc)


def children(parent: int, marker: bytes) -> list[int]:
    """Processes whose parent is ``parent`` and whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and marker in argv:
            found.append(int(entry.name))
    return found


def rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    """A process's resident memory (``VmRSS``) or its peak (``VmHWM``) in MB, or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
