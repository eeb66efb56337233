"""The warm driver host: one process that has imported everything a load driver needs
and forks a driver per request, so a run's shard starts in milliseconds instead of
paying an interpreter start and its imports (about 0.4 s of CPU) each time.

``DriverPool.start`` (``service.load.shards``) starts ``python -m service.load.forkserver
FD PID``; this module is the host process (``main``, ``serve``), and ``DriverHost`` in
``service.load.forkserver_client`` the service's side of it.
They talk over a Unix ``SOCK_SEQPACKET`` socket pair (one JSON object a message):

host -> service
    ``{"ready": pid}`` once the imports are done; ``{"forked": n, "pid": pid}`` (or
    ``{"forked": n, "error": why}``) for request ``n``; ``{"exited": pid, "code": c}``
    when a driver it forked has ended (``c`` as ``asyncio`` gives a return code: the
    exit status, or ``-signal``).
service -> host
    ``{"fork": n}`` with three file descriptors (SCM_RIGHTS): the driver's stdin and
    stdout (each the far end of a socket pair) and stderr. The child puts them on 0, 1
    and 2 and runs ``service.load.driver.main``, so it speaks the driver's line protocol
    exactly as ``python -m service.load.driver`` does. Closing its end of the socket (or
    dying) ends the host.

Lifetimes: the host dies with the service (end of the socket; ``PR_SET_PDEATHSIG`` too)
and every driver dies with its host (``PR_SET_PDEATHSIG``), so nothing outlives the
service, and a driver whose host died is known to have been killed (code -9). The host
stays single-threaded and never starts an event loop, so each fork starts clean; it
reaps its children itself (``SIGCHLD`` through a wakeup pipe) and reports their codes,
since the service, not their parent, cannot wait for them.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
import os
import selectors
import signal
import socket
import sys
import traceback
from typing import Any, NoReturn

# What a driver needs, imported once here so that no fork pays for it: the driver and its
# generator (aiohttp, numpy, pydantic), and what they import only when first used.
import numpy.random  # noqa: F401

from service.load import driver

log = logging.getLogger(__name__)

# The three descriptors a fork request carries, in this order.
STDIO = 3
MESSAGE_MAX = 4096
# ``prctl(PR_SET_PDEATHSIG, ...)``.
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(3)


def _become_driver(stdio: list[int], inherited: list[int], host: int) -> NoReturn:
    """In a child just forked: take the service's sockets and log as 0, 1, 2, shed the
    host's own descriptors and signal set-up, and run the driver; never return."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in stdio:
            os.close(fd)
        _die_with_parent(host)
        driver.main()
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def serve(sock: socket.socket) -> None:
    """Fork a driver for every request on ``sock``, report the children's pids and exit
    codes, until the service closes its end."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    # A handler only so that SIGCHLD is delivered (and written to the wakeup pipe).
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    host = os.getpid()
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is sock:
                    message, fds, _, _ = socket.recv_fds(sock, MESSAGE_MAX, STDIO)
                    if not message:
                        return  # the service closed its end, or died
                    _fork(sock, json.loads(message)["fork"], fds,
                          [sock.fileno(), wake_r, wake_w, selector.fileno()], host)
                else:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake_r, 512):
                            pass
                    _reap(sock)


def _fork(sock: socket.socket, request: int, fds: list[int], inherited: list[int], host: int) -> None:
    try:
        if len(fds) != STDIO:
            _send(sock, {"forked": request, "error": f"{len(fds)} descriptors, not {STDIO}"})
            return
        # Nothing buffered may be written twice, once by each process.
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as e:
            _send(sock, {"forked": request, "error": str(e)})
            return
        if pid == 0:
            _become_driver(fds, inherited, host)
        _send(sock, {"forked": request, "pid": pid})
    finally:
        for fd in fds:
            os.close(fd)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def main() -> None:
    """Entry point of ``python -m service.load.forkserver FD PID``: FD is the host's end
    of the socket pair, inherited from the service, whose process id is PID."""
    # Its own process group, in the service's session, as a driver's (``driver.main``).
    os.setpgrp()
    _die_with_parent(int(sys.argv[2]) if len(sys.argv) > 2 else os.getppid())
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.set_inheritable(False)
    # Everything imported so far is shared with every child: keep the collector's passes
    # from touching (and so copying) it in each of them.
    gc.collect()
    gc.freeze()
    try:
        _send(sock, {"ready": os.getpid()})
        serve(sock)
    except OSError:
        pass  # the service is gone
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
