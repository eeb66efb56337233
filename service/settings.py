"""Service settings, read from the environment with the ``DECODEBENCH_`` prefix."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shlex
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger(__name__)


class Settings(BaseSettings):
    """Everything the service can be told; each field is documented in docs/reference.md."""

    model_config = SettingsConfigDict(env_prefix="DECODEBENCH_")

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("./var")
    api_token: str | None = None
    # Let anyone who can reach the service read runs and pages without the token.
    public_read: bool = False
    # Listen beyond loopback with a generated token: for a container whose port is
    # published on the host's loopback only (docker/compose.yaml does that).
    allow_open_bind: bool = False
    # Comma-separated GPU ids; None means "all visible", empty means none.
    gpus: str | None = None
    # What NVML found, asked once: the scheduler wants the GPU ids on every pass.
    _nvml_gpus: list[str] | None = PrivateAttr(default=None)
    vllm_command: str | None = None
    # The ports the servers the service starts listen on, "LOW-HIGH" (both included), here
    # and on Ray nodes; None: any port the system has free. A range outside the system's
    # ephemeral ports (Linux: /proc/sys/net/ipv4/ip_local_port_range) is never taken by
    # another program asking the system for a free port, or by an outgoing connection,
    # while a server starts; it is also what a firewall or a published container port needs.
    server_ports: str | None = None
    # URL the connector inside a worker uses to reach this service.
    control_url: str | None = None
    worker_start_timeout_s: float = Field(default=600.0, gt=0)
    worker_stop_grace_s: float = Field(default=10.0, ge=0)
    # On shutdown, how long the runs in progress get to record their end before every
    # server is stopped anyway (servers are stopped then, whatever their runs were doing).
    shutdown_wait_s: float = Field(default=10.0, ge=0)
    # A stream that sends nothing for this long is failed (the server hung).
    request_timeout_s: float = Field(default=600.0, gt=0)
    # A load driver process that sends nothing (not even its heartbeat) for this long has
    # hung: its run fails.
    driver_hang_s: float = Field(default=15.0, gt=0)
    # A worker whose open streams all got nothing, and whose /metrics did not move (a
    # prefill's chunks move it), for this long (or for three times the longest time to
    # first token or engine step the run has seen, if more) has hung: its run fails and it
    # is stopped, whatever ``request_timeout_s`` says (``service.control.watchdog``).
    stall_s: float = Field(default=30.0, gt=0)
    scheduler_poll_s: float = Field(default=0.5, gt=0)
    # The most output tokens a run may ask for (its requests x output_len), refused at
    # submit above it: while a run is measured and summarised the service holds every
    # request's token gaps in memory, about 90 bytes a token at the summary's peak
    # (``service.web.admission.RUN_BYTES_PER_TOKEN``): 20 M tokens, about 1.8 GB.
    max_run_output_tokens: int = Field(default=20_000_000, gt=0)
    # The memory of the machine servers start on where it has no GPUs, in GiB, against which
    # a bundled shape's CPU server is checked before it starts (``shapes.cpu_memory_problem``).
    # None: this host's, or its cgroup's limit if lower; on a Ray cluster, not checked.
    cpu_memory_gib: float | None = Field(default=None, gt=0)
    # The worker's /metrics is read at a run's start and end, and with a value above 0 also
    # this often during it. 0 by default: vLLM renders /metrics on the event loop that
    # streams the tokens, and on a busy 2-core machine one render took up to 0.7 s; every
    # stream open then stalls and its tokens reach the client in one burst
    # (benchmarks/README.md, "scrape.py"). Counters (preemptions, prefix hits, queue time)
    # need only the two ends; the running/waiting time series needs the scrapes.
    scrape_every_s: float = Field(default=0.0, ge=0)
    # How far a submitted hub model id is looked for before it is accepted (service/control/hub.py):
    # "cache" (the local Hugging Face cache), "online" (then the hub, unless HF_HUB_OFFLINE
    # is set) or "off".
    hub_check: Literal["off", "cache", "online"] = "online"
    # How often registered (external) vLLM servers are health-probed.
    worker_probe_s: float = Field(default=5.0, gt=0)
    # The access log (uvicorn's line per request): "changes" (the default: requests that are
    # not reads, and every answer of 400 or more), "all" (every request, the polls of pages
    # and progress displays too: most of the log) or "off". What happened (runs queued,
    # started and ended, servers starting, ready and stopped) is logged as events whatever it says.
    access_log: Literal["changes", "all", "off"] = "changes"
    # Log the connector's routine calls (``/api/connector/*`` answered 2xx) in the access
    # log: off by default, they were a third of the log; their failures are always logged.
    log_connector_traffic: bool = False
    # Each worker log is kept to about twice this (the file and one rotated copy).
    worker_log_max_bytes: int = Field(default=32 * 1024 * 1024, ge=4096)
    # The logs of this many ended workers, the last to end, are kept; older ones are deleted
    # when the service starts and every minute (``service.storage.logs``). At least the 10 the
    # index page lists, so a failure shown there still has its log.
    worker_logs_kept: int = Field(default=50, ge=10)
    # Fork load drivers from a warm host that has imported them (``service.load.forkserver``:
    # milliseconds a run instead of an interpreter start). Off: each driver is a Python
    # process of its own (about 0.4 s of CPU each).
    warm_drivers: bool = True
    # A Ray cluster to place servers and load drivers on (``HOST:6379`` or
    # ``ray://HOST:10001``); None: local processes, and Ray is never imported. Not ``auto``:
    # that joins whichever cluster runs on this machine, another user's included.
    ray_address: str | None = None
    # The Ray namespace of the actors this service makes; on a restart every actor left in
    # it is stopped, so give each service its own.
    ray_namespace: str = "decodebench"
    # The address servers on Ray nodes listen on and are reached at; None: their node's
    # address as Ray knows it. (127.0.0.1 only where every node is this machine.)
    ray_server_host: str | None = None
    # CPUs a server asks Ray for (per tensor-parallel rank) on a cluster without GPUs.
    ray_server_cpus: float = Field(default=1.0, gt=0)
    # Environment variables (by prefix, comma-separated) passed from the service to the
    # servers it starts on other nodes; the rest of a server's environment is its node's.
    ray_forward_env: str = "VLLM_,HF_,HUGGING_FACE_,TRANSFORMERS_"

    def cpu_memory_bytes(self) -> int:
        """``cpu_memory_gib``, else this host's memory (its cgroup's limit if lower)."""
        if self.cpu_memory_gib is not None:
            return int(self.cpu_memory_gib * 2**30)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        with contextlib.suppress(OSError, ValueError):
            limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
            if limit != "max":
                memory = min(memory, int(limit))
        return memory

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        # Workers run with the data dir as their working directory: paths must not be relative.
        return value.expanduser().resolve()

    @field_validator("ray_address")
    @classmethod
    def _explicit_cluster(cls, value: str | None) -> str | None:
        if value is not None and value.strip().lower() == "auto":
            raise ValueError(
                "auto would join whichever Ray cluster runs on this machine, "
                "another user's included: give your cluster's address, HOST:6379 (as `ray start "
                "--head` printed it) or ray://HOST:10001")
        return value or None

    @field_validator("server_ports")
    @classmethod
    def _port_range(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
        if match is None:
            raise ValueError(f"{value!r} is not a range of ports: give LOW-HIGH, as 20000-20099")
        low, high = int(match[1]), int(match[2])
        if not 1024 <= low <= high <= 65535:
            raise ValueError(f"{value!r}: give 1024 <= LOW <= HIGH <= 65535")
        return f"{low}-{high}"

    @property
    def server_port_range(self) -> range | None:
        """``server_ports`` as the ports it names; None: any free port."""
        if self.server_ports is None:
            return None
        low, high = (int(part) for part in self.server_ports.split("-"))
        return range(low, high + 1)

    @property
    def db_path(self) -> Path:
        """The SQLite file."""
        return self.data_dir / "decodebench.sqlite3"

    @property
    def logs_dir(self) -> Path:
        """Where worker and driver logs go."""
        return self.data_dir / "logs"

    @property
    def models_dir(self) -> Path:
        """Where the bundled tiny model is written."""
        return self.data_dir / "models"

    def worker_command(self) -> list[str]:
        """argv prefix that starts a vLLM OpenAI-compatible server."""
        if self.vllm_command:
            return shlex.split(self.vllm_command)
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]

    def control_base_url(self) -> str:
        """Base URL of this service as seen from a local worker."""
        if self.control_url:
            return self.control_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def gpu_ids(self) -> list[str]:
        """GPU ids workers may be placed on: the setting, else the service's own
        ``CUDA_VISIBLE_DEVICES``, else every GPU NVML sees; empty on a CPU machine."""
        if self.gpus is not None:
            return [g.strip() for g in self.gpus.split(",") if g.strip()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return [g.strip() for g in visible.split(",") if g.strip()]
        if self._nvml_gpus is None:
            self._nvml_gpus = _detect_gpus()
        return list(self._nvml_gpus)

    def resolve_api_token(self) -> str:
        """The API token: the setting, else the one stored in the data dir (made on first start)."""
        if self.api_token:
            return self.api_token
        path = self.data_dir / "api-token"
        if path.exists():
            return path.read_text().strip()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token


def _detect_gpus() -> list[str]:
    """GPU indices as NVML numbers them, which is PCI bus order (``nvidia-smi``'s, and CUDA's
    with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); none when NVML or the driver is missing."""
    # NVML and not /dev/nvidia*: device node numbers are the host's, so a container given
    # GPU 3 alone sees /dev/nvidia3 while CUDA inside it calls that GPU 0.
    try:
        import pynvml
    except ImportError:
        log.info("no GPUs: nvidia-ml-py is not installed")
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        # libnvidia-ml missing (a CPU machine) or no driver loaded.
        log.info("no GPUs: NVML did not start (%s)", exc)
        return []
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        log.warning("no GPUs: NVML started but could not count them (%s)", exc)
        count = 0
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("NVML shutdown failed: %s", exc)
    log.info("NVML sees %d GPU(s)", count)
    return [str(i) for i in range(count)]
