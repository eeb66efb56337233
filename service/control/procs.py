"""Processes and their logs: process groups started and stopped as one, log files kept
to a size, and the marker that tells our workers from anyone else's after a crash.

Workers and drivers each lead a process group of their own (stopped as one with
``killpg``) but stay in the service's session. Linux with ``sched_autogroup_enabled``
(the default on most distributions) schedules each session as one group with an equal
share of a CPU: a driver in a session of its own, next to the vLLM server's busy
EngineCore and Worker in another, went unscheduled for the 200-300 ms of a whole
decode while the server sent a token every 4 ms, so its streams reached it in one
burst (22 of 36 requests at 8192 x 1 on 2 cores, 0 of 48 in one session;
``benchmarks/README.md``, "bunched streams").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

from service.control.startup_errors import failure_message, is_wrapper, root_cause
from service.storage.logs import last_lines, log_end

# Environment variable that marks a process as ours, so that after a crash we only
# ever stop process groups this service started.
WORKER_ENV = "DECODEBENCH_WORKER_ID"


def rpc_dir(worker_id: str) -> Path:
    """Where a server's vLLM makes its inter-process sockets (``VLLM_RPC_BASE_PATH``): a
    directory of its own in the temp directory of the machine it runs on, removed once the
    server stopped (``service.control.local``; on a Ray node, its ``ServerHost``). vLLM's
    default is the temp directory itself, and a process group stopped by signal leaves its
    sockets there (seven a server start on a CPU). Short, as a socket's path is at most
    107 bytes."""
    return Path(tempfile.gettempdir()) / f"decodebench-rpc-{worker_id}"


def remove_rpc_dir(worker_id: str) -> None:
    """Remove ``rpc_dir`` with whatever a stopped server left in it."""
    shutil.rmtree(rpc_dir(worker_id), ignore_errors=True)


# How often the service's log says what a server that is still starting is doing.
STARTING_LINE_S = 15.0
# Once a starting server's log says its engine failed: how long its root cause may take to
# follow (the marker line can come before the traceback that names it).
ROOT_CAUSE_WAIT_S = 1.0
# How much of a failed server's log is searched for the root cause: vLLM's wrappers of it
# fill the last lines, and the cause can be hundreds of lines above them.
LOG_SEARCHED_BYTES = 4 << 20


def start_failure(log_path: Path, what: str) -> tuple[str, bool]:
    """The message of a server start that failed (``what`` happened), the root cause from
    its log first, and whether the log holds that cause yet, not only vLLM's wrappers of it
    (blocking: a search of up to LOG_SEARCHED_BYTES). The same for a server here and one a
    Ray node's ``ServerHost`` runs."""
    text = log_end(log_path, LOG_SEARCHED_BYTES)
    cause = root_cause(text)
    return failure_message(what, text, last_lines(text)), cause is not None and not is_wrapper(cause.line)


class NoFreePort(Exception):
    """No free port was found."""


def log_head(path: Path, max_bytes: int = 1 << 20) -> str:
    """The first ``max_bytes`` of a log file (empty if missing)."""
    try:
        with path.open("rb") as f:
            return f.read(max_bytes).decode("utf-8", errors="replace")
    except OSError:
        return ""


class LogFollower:
    """What a growing log file gained since the last look, in whole lines; a file rotated
    meanwhile (``drain_to_capped_file``) is read from its start again, after what the
    rotated copy gained before it was moved aside (a failure line is often the last one
    written before a rotation)."""

    def __init__(self, path: Path, max_bytes: int = 1 << 20) -> None:
        self.path = path
        # At most this much is read at a time, and kept of a line not yet ended.
        self.max_bytes = max_bytes
        self._offset = 0
        self._partial = b""
        self._inode: int | None = None

    def new_lines(self) -> str:
        """The lines ended since the last call (blocking: call it from a thread)."""
        rest = b""
        try:
            with self.path.open("rb") as f:
                stat = os.fstat(f.fileno())
                inode = stat.st_ino
                # The first look, or a new file after a rotation: another inode, or a file
                # shorter than what was read of it (a removed file's inode can be reused).
                if inode != self._inode or stat.st_size < self._offset:
                    rest = self._rest_of_rotated() if self._inode is not None else b""
                    if not rest:
                        self._partial = b""  # the file it began in is gone: not joined to another
                    self._inode, self._offset = inode, 0
                f.seek(self._offset)
                data = f.read(self.max_bytes)
        except OSError:
            return ""
        self._offset += len(data)
        complete, _, partial = (self._partial + rest + data).rpartition(b"\n")
        self._partial = partial[-self.max_bytes:]
        return complete.decode("utf-8", errors="replace")


    def _rest_of_rotated(self) -> bytes:
        """What the file last read gained since, if it is the rotated copy now (``.1``);
        empty when that copy is another file (rotated again since) or gone."""
        try:
            with self.path.with_name(self.path.name + ".1").open("rb") as f:
                if os.fstat(f.fileno()).st_ino != self._inode:
                    return b""
                f.seek(self._offset)
                return f.read(self.max_bytes)
        except OSError:
            return b""


def drain_to_capped_file(pipe: IO[bytes], path: Path, max_bytes: int) -> None:
    """Copy a worker's output to ``path`` until it closes; past ``max_bytes`` the file
    moves to ``path.1`` (replacing an older one) and a new one starts, so a chatty
    worker never fills the disk and never blocks on a full pipe."""
    out = path.open("ab")
    try:
        for chunk in iter(lambda: pipe.read1(64 * 1024), b""):  # type: ignore[attr-defined]
            if out.tell() + len(chunk) > max_bytes:
                out.close()
                os.replace(path, path.with_name(path.name + ".1"))
                out = path.open("ab")
            out.write(chunk)
            out.flush()
    except (OSError, ValueError):
        pass
    finally:
        out.close()
        pipe.close()


def free_port(taken: set[int], ports: range | None = None, address: str = "127.0.0.1") -> int:
    """A port free on ``address`` now and not in ``taken``: one the system picks, or the
    first free one of ``ports`` (``Settings.server_port_range``)."""
    if ports is None:
        for _ in range(100):
            port = try_bind(address, 0)
            if port is not None and port not in taken:
                return port
        raise NoFreePort("no free port found for a new server")
    for port in ports:
        if port not in taken and try_bind(address, port) is not None:
            return port
    raise NoFreePort(f"no port of {ports.start}-{ports.stop - 1} (DECODEBENCH_SERVER_PORTS) is "
                     "free for a new server: widen the range, or stop what holds its ports")


def try_bind(address: str, port: int) -> int | None:
    """The port a socket bound to (``address``, ``port``) got; None if it is taken. Without
    SO_REUSEADDR: a port a starting server has bound (and listens on only later) is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))
        except OSError:
            return None
        return int(s.getsockname()[1])


def is_our_worker(pid: int, worker_id: str) -> bool:
    """True if ``pid`` is alive and was started by us as ``worker_id`` (guards against pid reuse)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{WORKER_ENV}={worker_id}".encode() in environ.split(b"\0")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(pgid: int, grace_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def stop_process_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``, and reap the leader."""
    pgid = process.pid  # process_group=0 makes the child its group's leader
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if process.poll() is not None and not group_alive(pgid):
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
