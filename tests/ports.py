"""Ports for the processes tests start that take seconds to bind theirs: services
(``python -m service``) and real vLLM servers.

A port chosen by binding port 0 is free at that moment only. A vLLM server binds its own
some 10 s later (its imports), a service 1-2 s later, and in between another test, on
another pytest-xdist worker, could be handed the same port by the system; its /health
then answers for the server. Seen once in CI: a reference vLLM server taken for healthy
before its own HTTP server ran, and refusing every request once the other test ended.

So these ports come from below the system's ephemeral range (where binding port 0, and
outgoing connections, never go), each xdist worker from a range of its own: the first
``SERVER_SHARE`` ports for the servers a service starts (``DECODEBENCH_SERVER_PORTS``),
the rest handed out one at a time by ``worker_port``.
"""

from __future__ import annotations

import os
from pathlib import Path

from service.control import procs

PORTS_BASE = 20000
PORTS_PER_WORKER = 1000
SERVER_SHARE = 300
# The ports handed out already: a process started a moment ago may not have bound its own.
_HANDED: set[int] = set()


def _worker_ports() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = PORTS_BASE + index * PORTS_PER_WORKER
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert low + PORTS_PER_WORKER <= ephemeral, f"worker {worker}'s ports reach the ephemeral range"
    return range(low, low + PORTS_PER_WORKER)


def service_server_ports() -> str:
    """``DECODEBENCH_SERVER_PORTS`` for a service of this worker that starts servers."""
    low = _worker_ports().start
    return f"{low}-{low + SERVER_SHARE - 1}"


def worker_port() -> int:
    """A port of this worker's own, free now and not handed out before (until all were)."""
    ports = _worker_ports()[SERVER_SHARE:]
    if set(ports) <= _HANDED:
        _HANDED.clear()
    port = procs.free_port(_HANDED, ports)
    _HANDED.add(port)
    return port
