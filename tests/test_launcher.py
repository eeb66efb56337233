"""Launcher pieces: capped worker logs, the log tail in errors, a starting worker's log followed."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from service.control.procs import LogFollower, drain_to_capped_file
from service.storage.logs import log_tail

pytestmark = pytest.mark.unit


def test_worker_output_is_drained_to_a_capped_file(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    log = tmp_path / "w.log"
    drain = threading.Thread(
        target=drain_to_capped_file, args=(os.fdopen(read_end, "rb"), log, 64 * 1024)
    )
    drain.start()
    with os.fdopen(write_end, "wb") as out:
        for i in range(5000):  # about 390 KiB: six times the cap
            out.write(f"line {i:05d} {'x' * 64}\n".encode())
    drain.join(timeout=10)
    assert not drain.is_alive()
    rotated = log.with_name("w.log.1")
    assert log.stat().st_size <= 64 * 1024 and rotated.stat().st_size <= 64 * 1024
    # The newest output is kept, in order, and the tail shows the very last lines.
    assert log_tail(log, 2).splitlines() == [f"line 04998 {'x' * 64}", f"line 04999 {'x' * 64}"]
    assert "line 00000" not in log.read_text() + rotated.read_text()


def test_a_starting_workers_log_is_followed_in_whole_lines_across_a_rotation(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    follower = LogFollower(log)
    assert follower.new_lines() == ""  # not written yet
    with log.open("ab") as out:
        out.write(b"(EngineCore pid=1) INFO loading\n(EngineCore pid=1) ERROR EngineCore fai")
    assert follower.new_lines() == "(EngineCore pid=1) INFO loading"
    with log.open("ab") as out:
        out.write(b"led to start.\n")
    # A line split between two writes is read once it has ended, whole.
    assert follower.new_lines() == "(EngineCore pid=1) ERROR EngineCore failed to start."
    assert follower.new_lines() == ""
    # The copier moved the file aside and began a new one: read from its start.
    os.replace(log, log.with_name("w.log.1"))
    log.write_bytes(b"after\n")
    assert follower.new_lines() == "after"


def test_a_line_written_just_before_a_rotation_is_not_lost(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    follower = LogFollower(log)
    log.write_bytes(b"(EngineCore pid=1) INFO loading\n")
    assert follower.new_lines() == "(EngineCore pid=1) INFO loading"
    # The engine's failure line lands in the file, the copier rotates it (the next chunk did
    # not fit) and goes on in a new file, all before the follower looks again; the new file
    # begins with the end of a line the old one began.
    with log.open("ab") as out:
        out.write(b"(EngineCore pid=1) ERROR EngineCore failed to start.\n(APIServer pid=2) Traceba")
    os.replace(log, log.with_name("w.log.1"))
    log.write_bytes(b"ck (most recent call last):\n")
    assert follower.new_lines().splitlines() == [
        "(EngineCore pid=1) ERROR EngineCore failed to start.",
        "(APIServer pid=2) Traceback (most recent call last):"]
    # Two rotations between looks: what the older file held is gone with it, not guessed.
    os.replace(log, log.with_name("w.log.1"))
    log.write_bytes(b"one\n")
    os.replace(log, log.with_name("w.log.1"))
    log.write_bytes(b"two\n")
    assert follower.new_lines() == "two"
