"""The service's side of the warm driver host (``service.load.forkserver``, where the
protocol is described): ``DriverHost`` starts the host process, asks it for a driver per
shard (``spawn``) and learns its drivers' exit codes; ``HostedDriver`` is a forked driver
as ``Drivers`` uses a process. A driver's stdin and stdout are socket pairs whose ends
here become the loop's transports; each is closed once, by its transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from service.load.forkserver import MESSAGE_MAX

log = logging.getLogger(__name__)

# How long a host told to end (or a driver's host gone) is waited for.
HOST_STOP_WAIT_S = 3.0
# How often the service looks whether a driver whose host died is gone.
ORPHAN_POLL_S = 0.05
# Hosts started by this process, to name their logs apart.
_hosts = itertools.count(1)
# A fork request's answer: the driver's pid, and its exit code to come.
Forked = asyncio.Future[tuple[int, asyncio.Future[int]]]


class HostLost(Exception):
    """The driver host is not there (it died, or never started): fork no driver from it."""


class HostedDriver:
    """A driver forked by the host, as ``Drivers`` uses a process: its streams, its pid,
    signals, and its exit code (reported by the host, which is its parent)."""

    def __init__(self, pid: int, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader,
                 exited: asyncio.Future[int]) -> None:
        self.pid = pid
        self.stdin: asyncio.StreamWriter | None = stdin
        self.stdout: asyncio.StreamReader | None = stdout
        self._exited = exited
        # Once it has ended nobody reads its stdin: let it go.
        exited.add_done_callback(lambda _: stdin.close())

    @property
    def returncode(self) -> int | None:
        """The exit code (``-signal`` if a signal ended it); None while it runs."""
        if self._exited.done() and not self._exited.cancelled():
            return self._exited.result()
        return None

    async def wait(self) -> int:
        """Wait for it to end; its exit code."""
        return await asyncio.shield(self._exited)

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` while it runs (``ProcessLookupError`` if it is gone)."""
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, signum)

    def terminate(self) -> None:
        """SIGTERM: it writes the lines it holds and ends (``driver.STOPPED_FLUSH_S``)."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


class _EndingReader(asyncio.StreamReaderProtocol):
    """A driver's stdout: the transport closes once the driver's end has closed. A socket's
    transport would otherwise stay half open (``StreamReaderProtocol`` asks for that),
    its descriptor held until the collector frees it."""

    def eof_received(self) -> bool:
        super().eof_received()
        return False


class _StdinProtocol(asyncio.streams.FlowControlMixin):
    """A driver's stdin: written to, flow-controlled; it closes once the driver has gone."""


async def _streams(ours: list[socket.socket],
                   limit: int) -> tuple[asyncio.StreamWriter, asyncio.StreamReader]:
    """Streams over the service's ends of a driver's stdin and stdout (``ours``, in that
    order). Each socket is popped from ``ours`` as it is handed to the loop: from then on
    its transport closes it, even when making the transport fails or is cancelled, so
    whatever is left in ``ours`` is the caller's to close."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit)
    read_transport, _ = await loop.create_unix_connection(lambda: _EndingReader(reader), sock=ours.pop())
    try:
        transport, protocol = await loop.create_unix_connection(_StdinProtocol, sock=ours.pop())
    except BaseException:
        read_transport.close()
        raise
    return asyncio.StreamWriter(transport, protocol, None, loop), reader


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in {"Z", "X"}


class DriverHost:
    """The service's handle on one host process: start it, fork drivers from it, close it."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        # Its stderr: empty unless it failed.
        self.log_path = log_dir / f"driver-host-{os.getpid()}-{next(_hosts)}.log"
        self.pid: int | None = None
        # True once the host said it was ready: it worked, so one lost later is worth
        # replacing (one that never got there would fail again).
        self.was_ready = False
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._starting: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._requests = itertools.count()
        self._forks: dict[int, Forked] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._orphans: set[asyncio.Task[None]] = set()
        self._lost: str | None = None

    @property
    def lost(self) -> bool:
        """True once the host is gone (or closed): fork nothing from it."""
        return self._lost is not None

    def start(self) -> None:
        """Start the host process (inside the event loop); ``spawn`` waits for it."""
        self._starting = asyncio.create_task(self._start())
        self._starting.add_done_callback(self._started)

    def _started(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (e := task.exception()) is not None:
            log.warning("the driver host did not start (%s); drivers start as processes of their own", e)

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("ab") as log_file:
                self._proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "service.load.forkserver", str(theirs.fileno()), str(os.getpid()),
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=log_file,
                    pass_fds=(theirs.fileno(),),
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self._proc.pid
        ours.setblocking(False)
        self._sock = ours
        self._reader = asyncio.create_task(self._read())
        await self._ready
        self.was_ready = True

    async def _read(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        why = "it ended"
        try:
            while message := await loop.sock_recv(self._sock, MESSAGE_MAX):
                self._handle(json.loads(message))
        except OSError as e:
            why = f"its socket failed: {e}"
        finally:
            self._gone(why)

    def _handle(self, message: dict[str, Any]) -> None:
        if "ready" in message:
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif "forked" in message:
            waiter = self._forks.pop(int(message["forked"]), None)
            if "pid" in message:
                pid = int(message["pid"])
                # Made here, not by the waiter: its end may be the next message.
                exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
                self._exits[pid] = exited
                if waiter is not None and not waiter.done():
                    waiter.set_result((pid, exited))
            elif waiter is not None and not waiter.done():
                waiter.set_exception(HostLost(f"the driver host could not fork: {message.get('error')}"))
        elif "exited" in message:
            ended = self._exits.pop(int(message["exited"]), None)
            if ended is not None and not ended.done():
                ended.set_result(int(message["code"]))

    def _gone(self, why: str) -> None:
        """The host has gone: no fork request will be answered, and its drivers died
        with it (``PR_SET_PDEATHSIG``); each is reported -9 (SIGKILL) once it is gone."""
        if self._lost is None:
            self._lost = why
        for waiter in self._forks.values():
            if not waiter.done():
                waiter.set_exception(HostLost(f"the driver host is gone: {why}"))
        self._forks.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(HostLost(f"the driver host did not start: {why}"))
            self._ready.exception()  # retrieved: ``spawn`` reports it
        for pid, exited in self._exits.items():
            task = asyncio.get_running_loop().create_task(self._orphan(pid, exited))
            self._orphans.add(task)
            task.add_done_callback(self._orphans.discard)
        self._exits.clear()

    @staticmethod
    async def _orphan(pid: int, exited: asyncio.Future[int]) -> None:
        while not _gone(pid):
            await asyncio.sleep(ORPHAN_POLL_S)
        if not exited.done():
            exited.set_result(-signal.SIGKILL)

    async def spawn(self, log_path: Path, limit: int) -> HostedDriver:
        """Fork a driver with ``log_path`` as its stderr; ``limit``: its stdout reader's
        line limit. Raises ``HostLost`` if the host is not there."""
        if self._starting is None:
            raise HostLost("the driver host was not started")
        try:
            await asyncio.shield(self._starting)
        except HostLost:
            raise
        except Exception as e:
            raise HostLost(f"the driver host did not start: {e!r}") from e
        if self._lost is not None or self._sock is None:
            raise HostLost(f"the driver host is gone: {self._lost}")
        # Socket pairs, not pipes. A pipe handed to the loop as a file object is closed
        # twice under uvloop (by libuv, then by the file object), and a read pipe's
        # transport there stays open after the end of the stream until the collector frees
        # it: each second close hits whatever took the number in between, in any thread.
        # A transport made from a socket closes it exactly once on either loop.
        to_driver, stdin = socket.socketpair()
        from_driver, stdout = socket.socketpair()
        ours = [to_driver, from_driver]
        # Their ends go to the host, which has its own copies once they are sent.
        theirs = [stdin.detach(), stdout.detach()]
        try:
            theirs.append(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644))
            request = next(self._requests)
            forked: Forked = asyncio.get_running_loop().create_future()
            self._forks[request] = forked
            try:
                socket.send_fds(self._sock, [json.dumps({"fork": request}).encode()], theirs)
            except OSError as e:
                self._forks.pop(request, None)
                raise HostLost(f"the driver host took no request: {e}") from e
            finally:
                for fd in theirs:
                    os.close(fd)
                theirs.clear()
            pid, exited = await forked
            stdin_writer, stdout_reader = await _streams(ours, limit)
        except BaseException:
            for fd in theirs:
                os.close(fd)
            for sock in ours:
                sock.close()
            raise
        return HostedDriver(pid, stdin_writer, stdout_reader, exited)

    async def close(self) -> None:
        """End the host (the drivers it still has end with it) and wait for it."""
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)
        if self._proc is not None:
            if not self.was_ready:
                # Still at its imports: it has forked nothing, and would see the end of its
                # socket only once they are done (a second or two).
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
            try:
                await asyncio.wait_for(self._proc.wait(), HOST_STOP_WAIT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                await self._proc.wait()
        if self._reader is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(self._reader, return_exceptions=True), HOST_STOP_WAIT_S)
        self._gone("closed")
        # Its drivers died with it: wait (a moment) until they are gone, so their ends are known.
        if self._orphans:
            await asyncio.wait(list(self._orphans), timeout=HOST_STOP_WAIT_S)
        for task in list(self._orphans):
            task.cancel()
        await asyncio.gather(*self._orphans, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(OSError):
            if self.log_path.stat().st_size == 0:
                self.log_path.unlink()
