"""The warm driver host's descriptors: every one the service opens for a forked driver is
closed once, when the driver is done with it (not when the collector gets to it), on
asyncio's own loop and on uvloop (which the service runs on when it is installed),
however a spawn ends: normally, or cancelled at any of its waits."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.core.sample import Sample
from service.core.spec import RunSpec
from service.load import forkserver_client as client_side
from service.load.forkserver_client import DriverHost
from service.load.shards import DriverPool, Drivers

LOOPS = ["asyncio", "uvloop"]


def _run(loop: str, main: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``main`` on a new loop of kind ``loop``, failing on anything the loop itself
    reports (a transport's error, a descriptor gone under it)."""
    factory = None
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        factory = uvloop.new_event_loop
    reported: list[str] = []

    async def guarded() -> Any:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(str(ctx)))
        return await main()

    with asyncio.Runner(loop_factory=factory) as runner:
        result = runner.run(guarded())
    assert not reported, reported
    return result


def _fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


@contextlib.contextmanager
def _no_collector() -> Iterator[None]:
    """Nothing may wait for the collector to be closed: keep it off meanwhile."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _host_children(host: DriverHost) -> list[int]:
    path = Path(f"/proc/{host.pid}/task/{host.pid}/children")
    return [int(pid) for pid in path.read_text().split()]


async def _settled(host: DriverHost, before: set[int]) -> set[int]:
    """The descriptors this process holds once the host has no driver left (those forked
    for cancelled spawns end when their stdin closes) and the loop has run its callbacks;
    as a set, for a message that names them."""
    for _ in range(600):
        if not _host_children(host) and _fds() <= before:
            break
        await asyncio.sleep(0.05)
    for _ in range(3):
        await asyncio.sleep(0)
    return _fds() - before


async def _crash(host: DriverHost, log: Path) -> int:
    """Fork a driver, give it a config it refuses, read its stdout to the end: its code."""
    proc = await host.spawn(log, 1 << 16)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"not a config\n")
    await proc.stdin.drain()
    assert await proc.stdout.read() == b""
    return await asyncio.wait_for(proc.wait(), 30)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_forked_driver_that_ended_holds_no_descriptor(tmp_path: Path, loop: str) -> None:
    async def go() -> set[int]:
        host = DriverHost(tmp_path)
        host.start()
        try:
            assert await _crash(host, tmp_path / "warm.log") == 1  # the host is up
            before = _fds()
            for k in range(8):
                assert await _crash(host, tmp_path / f"d{k}.log") == 1
            return await _settled(host, before)
        finally:
            await host.close()

    with _no_collector():
        assert _run(loop, go) == set()


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("where", ["forked", "stdout", "stdin"])
def test_a_spawn_cancelled_at_any_wait_closes_what_it_opened(tmp_path: Path, loop: str, where: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while the host forks (``forked``), or while the loop makes the transport
    of the driver's stdout or stdin: nothing stays open, nothing is closed twice (the
    next driver's streams work), and the host goes on."""
    def cancelling(base: type) -> type:
        class Cancelling(base):  # type: ignore[misc]
            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                task = asyncio.current_task()
                assert task is not None
                task.cancel()  # delivered at the loop's wait for the transport
        return Cancelling

    async def go() -> set[int]:
        host = DriverHost(tmp_path)
        host.start()
        try:
            assert await _crash(host, tmp_path / "warm.log") == 1
            before = _fds()
            if where == "stdout":
                monkeypatch.setattr(client_side, "_EndingReader", cancelling(client_side._EndingReader))
            elif where == "stdin":
                monkeypatch.setattr(client_side, "_StdinProtocol", cancelling(client_side._StdinProtocol))
            for k in range(4):
                spawn = asyncio.create_task(host.spawn(tmp_path / f"c{k}.log", 1 << 16))
                if where == "forked":
                    await asyncio.sleep(0)  # the request is sent; the answer is awaited
                    spawn.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await spawn
            monkeypatch.undo()
            left = await _settled(host, before)
            assert await _crash(host, tmp_path / "after.log") == 1
            return left
        finally:
            await host.close()

    with _no_collector():
        assert _run(loop, go) == set()


@pytest.mark.parametrize("loop", LOOPS)
def test_many_runs_at_once_some_cancelled_keep_every_line_and_no_descriptor(
        stub: str, tmp_path: Path, loop: str) -> None:
    """A bounded stress: 48 one-request runs from one warm pool, 8 at a time, a third of
    them cancelled at a random moment. Every run left alone gets its sample (every line it
    read was JSON, else ``Drivers.run`` raises), and once all are done the service holds
    no descriptor more than before."""
    spec = RunSpec(input_len=16, output_len=2, num_prompts=1, max_concurrency=1, seed=1)
    rng = random.Random(28)

    async def go() -> tuple[int, int, set[tuple[int, str]]]:
        pool = DriverPool(tmp_path, spares=2, warm=True)
        pool.start()
        try:
            async def one(k: int) -> list[Sample]:
                samples: list[Sample] = []
                drivers = Drivers.for_run(f"r-{k}", spec, stub, "stub", 1000, 30, pool, hang_s=30)
                await drivers.run(samples.append)
                return samples

            await one(-1)
            # After the loop's first stream: libuv keeps a descriptor in reserve from then on.
            before = _fds()
            assert isinstance(pool.host, DriverHost) and not pool.host.lost  # drivers are forked
            finished = cancelled = 0
            for batch in range(6):
                tasks = [asyncio.create_task(one(8 * batch + k)) for k in range(8)]
                doomed = rng.sample(tasks, 3)
                await asyncio.sleep(rng.uniform(0, 0.05))
                for task in doomed:
                    task.cancel()
                for task in tasks:
                    try:
                        samples = await task
                    except asyncio.CancelledError:
                        assert task in doomed
                        cancelled += 1
                        continue
                    assert [s.success for s in samples] == [True]
                    finished += 1
            assert not pool.host.lost
        finally:
            await pool.close()
        for _ in range(100):
            if _fds() <= before:
                break
            await asyncio.sleep(0.05)
        return finished, cancelled, {(fd, os.readlink(f"/proc/self/fd/{fd}")) for fd in _fds() - before}

    with _no_collector():
        finished, cancelled, left = _run(loop, go)
    assert finished + cancelled == 48 and finished >= 30
    assert left == set()
