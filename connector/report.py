"""Reports what the connector did, per run, to the decodebench service.

A daemon thread posts cumulative counters to
``POST {control_url}/api/connector/report``, off the engine's path: the fill and
the scheduling step only update a dict under a lock. It sends every
``interval_s``, or ``SOON_S`` after ``soon()`` (a request of a run finished: the
service reads the run's counters when its last request is done). Counters are
cumulative per (run, role, rank), so a lost or repeated report does no harm; a
run's last ``note`` (why a request was not treated as its mode says) rides along
as ``error``. A report the service could not take (no answer, a 5xx) is sent again;
one it refused (a 4xx: a removed worker's token, a body it will not read) is not, since
it would be refused again: its runs go again only once their counters change.

The server's provenance (``connector.provenance``), given once at the start, goes to
``POST {control_url}/api/connector/provenance`` from the same thread, retried until the
service has it (a refusal, 4xx, is not retried: the next report would be refused too).
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

log = logging.getLogger(__name__)

MAX_TRACKED_RUNS = 4096
# Engine step rows held for the service at most (all runs): past it, the oldest go, counted
# as ``steps_dropped``. About 60 bytes a row.
MAX_PENDING_STEPS = 200_000
# Step rows in one report at most, all runs: about 40 bytes each, well under the service's
# 1 MiB body limit (it takes up to 20,000 a run); more go in the reports that follow at once.
MAX_STEPS_PER_REPORT = 5_000
# After soon(), wait this long for more changes before sending (one report, not many).
SOON_S = 0.2
MAX_NOTE_CHARS = 500
# Refusals that say "later" (a timeout, too many requests): sent again like a failure.
ASK_LATER = frozenset({408, 429})


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
        self.provenance_url = (f"{control_url.rstrip('/')}/api/connector/provenance"
                               if control_url else None)
        self._provenance: dict[str, Any] | None = None
        self.token = token or ""
        self.role = role
        self.rank = rank
        self.interval_s = interval_s
        self._counters: dict[str, dict[str, float]] = {}
        # Blocks filled per KV cache group, per run (sent as ``group_blocks``).
        self._groups: dict[str, dict[str, float]] = {}
        self._notes: dict[str, str] = {}
        # Engine steps timed and not yet sent, per run (``connector.steps``).
        self._steps: dict[str, list[list[float]]] = {}
        self._pending_steps = 0
        self._dirty: set[str] = set()
        self._lock = threading.Lock()
        # One flush at a time: close() flushes from the engine's thread while the report
        # thread may be mid-post, and two flushes would both send a provenance not yet cleared.
        self._flushing = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        self._refused_warned = False

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
                self._notes.pop(oldest, None)
                self._groups.pop(oldest, None)
                self._pending_steps -= len(self._steps.pop(oldest, []))
                self._dirty.discard(oldest)
        self._start()

    def add_groups(self, run_id: str, blocks: dict[int, int]) -> None:
        """Add to a run's blocks filled per KV cache group (cheap: called on the engine's path)."""
        with self._lock:
            groups = self._groups.setdefault(run_id, {})
            for index, count in blocks.items():
                groups[str(index)] = groups.get(str(index), 0) + count
            self._dirty.add(run_id)
            self._counters.setdefault(run_id, {})
        self._start()

    def add_step(self, run_id: str, row: list[float]) -> None:
        """Keep one timed engine step of ``run_id`` for the next report (cheap: called once
        a step on the engine's path)."""
        with self._lock:
            self._steps.setdefault(run_id, []).append(row)
            self._pending_steps += 1
            counters = self._counters.setdefault(run_id, {})
            counters["steps_timed"] = counters.get("steps_timed", 0) + 1
            self._dirty.add(run_id)
            while self._pending_steps > MAX_PENDING_STEPS:
                oldest = next(iter(self._steps))
                lost = self._steps.pop(oldest)
                self._pending_steps -= len(lost)
                if oldest in self._counters:
                    dropped = self._counters[oldest]
                    dropped["steps_dropped"] = dropped.get("steps_dropped", 0) + len(lost)
        self._start()

    def step_dropped(self, run_id: str) -> None:
        """A step of ``run_id`` that could not be timed."""
        self.add(run_id, steps_dropped=1)

    def note(self, run_id: str, text: str) -> None:
        """Keep the latest reason a request of ``run_id`` was not treated as asked."""
        with self._lock:
            self._notes[run_id] = text[:MAX_NOTE_CHARS]
            self._dirty.add(run_id)
            self._counters.setdefault(run_id, {})
        self._start()

    def provenance(self, report: dict[str, Any]) -> None:
        """Send the server's provenance (once it is through; see the module docstring)."""
        with self._lock:
            self._provenance = report
        self._start()
        self.soon()

    def soon(self) -> None:
        """Send the counters shortly instead of at the next interval."""
        self._wake.set()

    def _start(self) -> None:
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
        while not self._stop.is_set():
            if self._wake.wait(self.interval_s):
                self._stop.wait(SOON_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.flush()

    def _post(self, url: str, payload: dict[str, Any]) -> None:
        # Raises what urllib does; the callers take an answer that is not HTTP at all
        # (``http.client.HTTPException``: another program on the service's old port) as a
        # failure to send again, so the report thread outlives it.
        request = urllib.request.Request(
            url,
            data=json.dumps(payload).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            resp.read()

    def _flush_provenance(self) -> bool:
        with self._lock:
            report = self._provenance
        if report is None or self.provenance_url is None:
            return True
        try:
            self._post(self.provenance_url, report)
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500:
                log.warning("the service refused this server's provenance: %s", exc)
                with self._lock:
                    self._provenance = None
                return True
            return False
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
            return False
        with self._lock:
            if self._provenance is report:
                self._provenance = None
        return True

    def flush(self) -> bool:
        """Send the provenance if it is not through yet and the counters of runs that
        changed; True if nothing is left to send."""
        if self.url is None:
            return True
        with self._flushing:
            return self._flush(self.url)

    def _flush(self, url: str) -> bool:
        sent_provenance = self._flush_provenance()
        with self._lock:
            if not self._dirty:
                return sent_provenance
            runs: dict[str, dict[str, Any]] = {}
            for run_id in self._dirty:
                runs[run_id] = dict(self._counters[run_id])
                if run_id in self._notes:
                    runs[run_id]["error"] = self._notes[run_id]
                if run_id in self._groups:
                    runs[run_id]["group_blocks"] = dict(self._groups[run_id])
            self._dirty.clear()
            steps = self._take_steps()
        payload: dict[str, Any] = {"role": self.role, "rank": self.rank, "runs": runs}
        if steps:
            payload["steps"] = steps
        try:
            self._post(url, payload)
            if self._steps:
                self._wake.set()  # more steps than one report carries: the rest go next
            return sent_provenance
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500 and exc.code not in ASK_LATER:
                if not self._refused_warned:
                    log.warning("the service refused this server's connector counters (%s); a run's "
                                "counters are sent again only once they change", exc)
                    self._refused_warned = True
                return sent_provenance
            self._resend(runs, steps, url, exc)
            return False
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            self._resend(runs, steps, url, exc)
            return False

    def _take_steps(self) -> dict[str, list[list[float]]]:
        """Up to ``MAX_STEPS_PER_REPORT`` oldest step rows, runs in the order they came,
        taken off (under the lock)."""
        taken: dict[str, list[list[float]]] = {}
        room = MAX_STEPS_PER_REPORT
        for run_id, rows in list(self._steps.items()):
            if not rows:
                continue
            if room <= 0:
                self._dirty.add(run_id)  # the next flush sends them
                continue
            taken[run_id], rest = rows[:room], rows[room:]
            room -= len(taken[run_id])
            self._steps[run_id] = rest
            self._pending_steps -= len(taken[run_id])
            if rest:
                self._dirty.add(run_id)  # the next flush sends the rest
        for run_id in [r for r, rows in self._steps.items() if not rows]:
            self._steps.pop(run_id)
        return taken

    def _resend(self, runs: dict[str, dict[str, Any]], steps: dict[str, list[list[float]]],
                url: str, exc: Exception) -> None:
        """The service did not take a report: its runs, and their steps ahead of any timed
        since, go again at the next flush."""
        if not self._warned:
            log.warning("could not report connector counters to %s: %s", url, exc)
            self._warned = True
        with self._lock:
            self._dirty.update(r for r in runs if r in self._counters)
            for run_id, rows in steps.items():
                if run_id in self._counters:
                    self._steps[run_id] = rows + self._steps.get(run_id, [])
                    self._pending_steps += len(rows)

    def close(self) -> None:
        """Send what is left and stop the thread."""
        self._stop.set()
        self._wake.set()
        self.flush()
