"""Log files in the data dir's ``logs`` folder, and how long they are kept.

A run's driver logs (``{run_id}.driver{shard}.log``, written by ``service.load.driver``;
a seeded run's seeding pass also ``{run_id}.seeding.driver{shard}.log``) are the run's: they
go when the run is deleted. A worker's log (``{worker_id}.log`` and its
rotated copy ``.log.1``, written by ``service.control.local``) is kept while the worker lives
and, once it has ended, while it is among the last ``keep`` workers to end (the index page
lists the last of them with their reasons); older ones are deleted. A path outside the logs
folder (a database carried over from another data dir) is never touched.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

from sqlalchemy import Engine

from service.storage import workers

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40


def log_end(path: Path, max_bytes: int = 64 * 1024) -> str:
    """The last ``max_bytes`` of a log file (empty if missing)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def last_lines(text: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.splitlines()[-lines:])


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (empty if missing)."""
    return last_lines(log_end(path), lines)


def run_files(logs_dir: Path, run_id: str) -> list[Path]:
    """The files kept for one run: its driver logs (its seeding pass's too)."""
    run = glob.escape(run_id)
    return sorted([*logs_dir.glob(f"{run}.driver*.log"), *logs_dir.glob(f"{run}.seeding.driver*.log")])


def delete_run_files(logs_dir: Path, run_id: str) -> list[Path]:
    """Delete the files kept for one run; returns those deleted."""
    removed = []
    for path in run_files(logs_dir, run_id):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def prune_worker_logs(engine: Engine, logs_dir: Path, keep: int) -> list[Path]:
    """Delete the logs of ended workers but for the ``keep`` that ended last; never the log
    of a worker that has not ended. Returns the files deleted."""
    live = workers.live_log_paths(engine)
    removed = []
    for name in workers.ended_log_paths(engine, keep):
        if name in live or not _inside(Path(name), logs_dir):
            continue
        for path in (Path(name), Path(name + ".1")):
            if path.exists():
                path.unlink(missing_ok=True)
                removed.append(path)
    if removed:
        log.info("deleted %d log files of workers that ended before the last %d", len(removed), keep)
    return removed
