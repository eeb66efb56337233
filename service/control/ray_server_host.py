"""A vLLM server's host on a Ray node: the actor's side of ``service.control.ray_servers``.

``ServerHost`` runs in a detached, named actor on the node Ray picked, one per server. It
starts vLLM there as a child process group listening on the node's address, copies its
output to a log file on that node, answers for its state and reads the node's energy
beside it. The child gets SIGTERM from the kernel when the actor's process dies
(``PR_SET_PDEATHSIG``), so a lost actor does not leave vLLM behind on a node that lives on.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import ray

from service.control.cpu_binding import binding_env
from service.control.energy import EnergyMeter
from service.control.procs import (
    WORKER_ENV,
    LogFollower,
    drain_to_capped_file,
    free_port,
    log_head,
    remove_rpc_dir,
    rpc_dir,
    start_failure,
    stop_process_group,
)
from service.control.startup_errors import engine_failed, startup_phase
from service.core.shapes import ensure_bundled
from service.storage.logs import log_tail

# prctl option: the signal a child gets when the thread that started it exits.
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the actor's process dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class ServerHost:
    """Runs on the node Ray chose, for one server: starts it, keeps its log, stops it.
    Methods are called one at a time (a threaded actor of one)."""

    def __init__(self, worker_id: str, data_dir: str) -> None:
        self.worker_id = worker_id
        # The service's data dir where this node has it (the service's machine, or a shared
        # disk); a node without it writable uses its temp dir.
        self.dir = Path(data_dir) / "ray"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            self.dir = Path(tempfile.gettempdir()) / "decodebench"
            self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / f"{worker_id}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.meter: EnergyMeter | None = None
        # Read while the server starts, as the service reads a local server's log.
        self.follower = LogFollower(self.log_path)
        self.phase: str | None = None
        self.failed = False

    def where(self) -> dict[str, Any]:
        """The node, its address, the GPUs Ray gave this actor, and where the bundled tiny
        model can be written."""
        context = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        return {"id": context.get_node_id(), "address": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
                "gpu_ids": gpu_ids, "models_dir": str(self.dir / "models")}

    def free_port(self, address: str, ports: tuple[int, int] | None = None,
                  taken: list[int] | None = None) -> int:
        """A port free on this node's address now and not in ``taken``: one the system
        picks, or the first free one of ``ports`` (first and last, ``DECODEBENCH_SERVER_PORTS``)."""
        chosen = None if ports is None else range(ports[0], ports[1] + 1)
        return free_port(set(taken or ()), chosen, address)

    def start(self, argv: list[str], env: dict[str, str], tensor_parallel_size: int,
              on_cpu: bool, log_max_bytes: int, bundled: tuple[str, int | None] | None) -> dict[str, Any]:
        """Start the server as a process group of its own; its pid and, on a CPU, the
        binding variables it got. ``bundled``: the bundled model (name, layers) to write
        on this node first."""
        if bundled is not None:
            ensure_bundled(self.dir / "models", *bundled)
        full = dict(os.environ)
        full.update(env)
        full[WORKER_ENV] = self.worker_id
        chosen: dict[str, str] | None = None
        if on_cpu:
            chosen = binding_env(tensor_parallel_size, full)
            full.update(chosen)
        # vLLM's sockets in a directory of this server's own, removed when it stops.
        full["VLLM_RPC_BASE_PATH"] = str(rpc_dir(self.worker_id))
        rpc_dir(self.worker_id).mkdir(mode=0o700, parents=True, exist_ok=True)
        # On a GPU node Ray set CUDA_VISIBLE_DEVICES of this process to the GPUs it holds.
        try:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=full, cwd=str(self.dir), process_group=0, preexec_fn=_die_with_parent,
            )
        except BaseException:
            remove_rpc_dir(self.worker_id)
            raise
        assert self.process.stdout is not None
        threading.Thread(target=drain_to_capped_file,
                         args=(self.process.stdout, self.log_path, log_max_bytes),
                         name=f"log-{self.worker_id}", daemon=True).start()
        return {"pid": self.process.pid, "log_path": str(self.log_path),
                "cpu_binding": {"env": chosen} if chosen is not None else None}

    def poll(self) -> int | None:
        """The server's exit code once it has ended, else None."""
        return None if self.process is None else self.process.poll()

    def tail(self) -> str:
        """The last lines of the server's log."""
        return log_tail(self.log_path)

    def starting(self) -> dict[str, Any]:
        """While the server starts: its exit code (None while it runs), the phase its log
        has reached, and whether the log has said that its engine failed (its API server
        may hang on the dead engine, never to answer)."""
        lines = self.follower.new_lines()
        self.phase = startup_phase(lines.splitlines(), self.phase)
        self.failed = self.failed or engine_failed(lines)
        return {"code": self.poll(), "phase": self.phase, "engine_failed": self.failed}

    def failure(self, what: str) -> tuple[str, bool]:
        """The message of a start that failed (``what`` happened), its root cause from the
        log first, and whether the log holds that cause yet, not only vLLM's wrappers of it."""
        return start_failure(self.log_path, what)

    def head(self) -> str:
        """The first part of the server's log (what vLLM said while it started)."""
        return log_head(self.log_path)

    def energy_start(self, gpu_ids: list[str]) -> None:
        """Start reading the energy and clocks of this node's GPUs ``gpu_ids`` (NVML), or of
        its CPU packages without GPUs, beside the server (``service.control.energy``)."""
        self.meter = EnergyMeter.on_this_host(gpu_ids)
        self.meter.start()

    def energy_stop(self) -> dict[str, Any]:
        """Stop reading; what was read (``EnergyMeter.state``)."""
        if self.meter is None:
            return EnergyMeter(None, "the meter on the node was never started").state()
        self.meter.stop()
        return self.meter.state()

    def stop(self, grace_s: float) -> int | None:
        """Stop the server's process group (SIGTERM, SIGKILL after ``grace_s``) and remove
        its sockets' directory."""
        if self.process is not None:
            stop_process_group(self.process, grace_s)
            remove_rpc_dir(self.worker_id)
            return self.process.returncode
        return None
