"""Reports what the connector did, per run, to the decodebench service.

A daemon thread posts cumulative counters every ``interval_s`` to
``POST {control_url}/api/connector/report``, off the engine's path: the fill and
the scheduling step only update a dict under a lock. Counters are cumulative
per (run, role, rank), so a lost or repeated report does no harm.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

MAX_TRACKED_RUNS = 4096


class Reporter:
    """Collects per-run counters and ships them in the background."""

    def __init__(
        self,
        control_url: str | None,
        token: str | None,
        role: str,
        rank: int,
        interval_s: float = 1.0,
    ) -> None:
        self.url = f"{control_url.rstrip('/')}/api/connector/report" if control_url else None
        self.token = token or ""
        self.role = role
        self.rank = rank
        self.interval_s = interval_s
        self._counters: dict[str, dict[str, float]] = {}
        self._dirty: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def add(self, run_id: str, **deltas: float) -> None:
        """Add to a run's counters (cheap: called on the engine's path)."""
        with self._lock:
            counters = self._counters.setdefault(run_id, {})
            for name, value in deltas.items():
                counters[name] = counters.get(name, 0) + value
            self._dirty.add(run_id)
            while len(self._counters) > MAX_TRACKED_RUNS:
                oldest = next(iter(self._counters))
                self._counters.pop(oldest)
                self._dirty.discard(oldest)
        if self._thread is None and self.url is not None:
            self._thread = threading.Thread(
                target=self._loop, name="decodebench-report", daemon=True
            )
            self._thread.start()

    def snapshot(self, run_id: str) -> dict[str, float]:
        """A copy of one run's counters."""
        with self._lock:
            return dict(self._counters.get(run_id, {}))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def flush(self) -> bool:
        """Send the counters of runs that changed; True if nothing is left to send."""
        if self.url is None:
            return True
        with self._lock:
            if not self._dirty:
                return True
            runs = {run_id: dict(self._counters[run_id]) for run_id in self._dirty}
            self._dirty.clear()
        body = json.dumps({"role": self.role, "rank": self.rank, "runs": runs}).encode()
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                resp.read()
            return True
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if not self._warned:
                log.warning("could not report connector counters to %s: %s", self.url, exc)
                self._warned = True
            with self._lock:
                self._dirty.update(r for r in runs if r in self._counters)
            return False

    def close(self) -> None:
        """Send what is left and stop the thread."""
        self._stop.set()
        self.flush()
