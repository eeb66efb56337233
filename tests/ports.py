"""The suite's one source of TCP ports: ``free_port`` for every service, stub or real vLLM
server a test (or a benchmark) starts, and for URLs where nothing may answer.

A port chosen by binding port 0 is free at that moment only. A vLLM server binds its own
some 10 s later (its imports), a service 1-2 s later, and in between another test, on
another pytest-xdist worker, could be handed the same port by the system; its /health
then answers for the server. Seen once in CI: a reference vLLM server taken for healthy
before its own HTTP server ran, and refusing every request once the other test ended.

So these ports come from below the system's ephemeral range (where binding port 0, and
outgoing connections, never go), each xdist worker from a range of its own: the first
``SERVER_SHARE`` ports for the servers services start (``DECODEBENCH_SERVER_PORTS``, one
block of ``SERVICE_BLOCK`` per service), the rest handed out one at a time by ``free_port``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from service.control import procs

PORTS_BASE = 20000
PORTS_PER_WORKER = 1000
SERVER_SHARE = 600
# A service takes the first free port of its range for each server it starts, and the server
# binds it only after its imports: two services choosing from one range at once (a test's own
# beside the shared tiny one, or a service process beside an in-process one) could pick the
# same port. So each service gets a block of the share of its own, in turn.
SERVICE_BLOCK = 100
# Where the next port is looked for, as an index into this worker's share: a random start,
# so two runs of the suite at once (on one range when both are on xdist workers) do not walk the
# range in step, each handing out the port the other just handed to a process still starting.
_next = random.SystemRandom().randrange(PORTS_PER_WORKER - SERVER_SHARE)
_next_block = random.SystemRandom().randrange(SERVER_SHARE // SERVICE_BLOCK)


# Outside pytest-xdist, the range of worker 4 to 7, chosen once per process: a run of some
# tests beside a whole suite on 4 workers (a fresh-clone CI run) would otherwise share gw0's
# range, and both runs' services would choose the same first free server port. A CI run's
# gw0 test failed so while tests ran beside it (its cause was not kept; most likely this).
_ALONE = random.SystemRandom().randrange(4, 8)


def _worker_ports() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else _ALONE
    low = PORTS_BASE + index * PORTS_PER_WORKER
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert low + PORTS_PER_WORKER <= ephemeral, f"worker {worker}'s ports reach the ephemeral range"
    return range(low, low + PORTS_PER_WORKER)


def service_server_ports() -> str:
    """``DECODEBENCH_SERVER_PORTS`` for a new service of this worker: the next block of the
    worker's server share, so a block comes again only after every other block has been given
    to a service since (most live one test or module; a long-lived one's servers hold their
    ports, which the first-free choice then passes over)."""
    global _next_block
    low = _worker_ports().start + _next_block * SERVICE_BLOCK
    _next_block = (_next_block + 1) % (SERVER_SHARE // SERVICE_BLOCK)
    return f"{low}-{low + SERVICE_BLOCK - 1}"


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now, for a process about to bind it. Races kept off:

    - it is this xdist worker's own, below the ephemeral range: no other worker hands it out,
      and no process binding port 0 or connecting out is given it by the system;
    - it is checked by a bind without ``SO_REUSEADDR`` (``procs.try_bind``): a port another
      process has bound but not yet listens on, or one still in TIME_WAIT, is passed over;
    - the ports are handed out in turn around the worker's share, so one comes again only
      after all the others: the process given it a moment ago has had time to bind it.
    """
    global _next
    ports = _worker_ports()[SERVER_SHARE:]
    for step in range(len(ports)):
        index = (_next + step) % len(ports)
        if procs.try_bind("127.0.0.1", ports[index]) is not None:
            _next = index + 1
            return ports[index]
    raise AssertionError(f"no port of {ports.start}-{ports.stop - 1} is free: what holds them all?")
