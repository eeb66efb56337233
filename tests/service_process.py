"""The service as a real process (``python -m service``), for tests that kill it."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from service.control.procs import remove_rpc_dir
from tests.conftest import API_TOKEN, AUTH, STUB_COMMAND, wait_answering
from tests.ports import free_port, service_server_ports

REPO = Path(__file__).resolve().parents[1]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _processes() -> Iterator[tuple[int, int, list[bytes]]]:
    """(pid, parent pid, argv) of every process still running."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if pid_alive(int(entry.name)):
            yield int(entry.name), ppid, argv


def group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that still run (zombies count as gone: a
    zombie holds no memory, and is reaped once its parent is)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def host_pids(parent: int | None = None) -> list[int]:
    """Warm driver hosts (``python -m service.load.forkserver``) that are children of
    ``parent`` (this process by default) and still run."""
    parent = os.getpid() if parent is None else parent
    return [pid for pid, ppid, argv in _processes() if ppid == parent and b"service.load.forkserver" in argv]


def driver_pids(parent: int | None = None, run_id: str | None = None) -> list[int]:
    """Load driver processes of the service ``parent`` (this process by default) that
    still run: its ``python -m service.load.driver`` children and the drivers its warm
    host forked; with ``run_id``, only those driving that run (their stderr goes to the
    run's driver log), not idle spares."""
    parent = os.getpid() if parent is None else parent
    hosts = set(host_pids(parent))
    found = []
    for pid, ppid, argv in _processes():
        if not ((ppid == parent and b"service.load.driver" in argv) or ppid in hosts):
            continue
        if run_id is not None:
            try:
                if f"{run_id}.driver" not in os.readlink(f"/proc/{pid}/fd/2"):
                    continue
            except OSError:
                continue
        found.append(pid)
    return found


class ServiceProcess:
    """Starts, kills and restarts one service process on one data dir, with stub workers."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "DECODEBENCH_DATA_DIR": str(data_dir),
            "DECODEBENCH_PORT": str(self.port),
            "DECODEBENCH_GPUS": "",
            "DECODEBENCH_VLLM_COMMAND": STUB_COMMAND,
            "DECODEBENCH_WORKER_STOP_GRACE_S": "2",
            "DECODEBENCH_SCHEDULER_POLL_S": "0.1",
            "DECODEBENCH_API_TOKEN": API_TOKEN,
            # Its servers' ports from this xdist worker's share, below the ephemeral range: a
            # port the system chose was taken by some other process's outgoing connection
            # between the choice and the stub's bind once in CI ("address already in use",
            # a queued run failed in test_crash_recovery).
            "DECODEBENCH_SERVER_PORTS": service_server_ports(),
            # Tests never reach the Hugging Face hub.
            "DECODEBENCH_HUB_CHECK": "cache",
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / "service.log"

    def start(self, timeout: float = 120) -> float:
        """Start the service and wait until /healthz answers; return how long that took.
        A service that does not come up is stopped, its workers with it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT)
        proc = self.proc
        try:
            wait_answering(f"{self.url}/healthz", timeout, 0.05, "the service",
                           ended=lambda: None if proc.poll() is None else self.log()[-3000:],
                           detail=lambda: f": {self.log()[-3000:]}")
            return time.monotonic() - started
        except BaseException:
            self.stop()
            raise

    def client(self) -> httpx.Client:
        """An HTTP client for this service that sends the API token."""
        return httpx.Client(base_url=self.url, headers=AUTH, timeout=60)

    def kill(self) -> None:
        """SIGKILL the service process alone (its workers live on, as after a real crash)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        """A clean shutdown (SIGTERM), if it still runs. A service that hangs has its
        stacks dumped to its log (SIGUSR1) before it and its workers are killed, so a
        test never leaves processes behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGUSR1)
                time.sleep(1)
                self.proc.kill()
                self.proc.wait()
                self._kill_workers()

    def _kill_workers(self) -> None:
        db = self.data_dir / "decodebench.sqlite3"
        if not db.exists():  # it died before it made its store: it started no worker
            return
        with sqlite3.connect(db) as conn:
            rows = conn.execute("SELECT id, pid FROM worker").fetchall()
        for worker_id, pid in rows:
            if pid is not None and pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            # As a restarted service would (``LocalServers.reap_orphans``): its socket directory.
            remove_rpc_dir(worker_id)

    def log(self) -> str:
        """The service's output so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
