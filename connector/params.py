"""Per-run fill parameters, pulled from the decodebench service by the scheduler side.

The pull runs on a small thread pool and the engine waits for it at most
``timeout_s``: a service that is down, slow, failing or answering garbage costs
each run at most one bounded wait, is logged, and falls back to the values in
the connector's extra config. A pull that finishes after the wait still lands in
the cache, so later requests of the run get the real values; a failed pull is
retried after ``retry_after_s``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 0.05
DEFAULT_RETRY_AFTER_S = 5.0
MAX_CACHED_RUNS = 4096


@dataclass(frozen=True)
class FillParams:
    """How to treat one run's requests: fill with (mean, std), or real prefill."""

    mode: str
    mean: float
    std: float
    # "service" when pulled, "default" for untagged requests, "fallback" after a failed pull.
    source: str


class PullError(Exception):
    """The service did not give usable parameters."""


class ParamsClient:
    """Fetches and caches fill parameters per run id."""

    def __init__(
        self,
        control_url: str | None,
        token: str | None,
        default_mean: float,
        default_std: float,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
    ) -> None:
        self.control_url = control_url.rstrip("/") if control_url else None
        self.token = token
        self.default = FillParams("fill", default_mean, default_std, "default")
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._cache: dict[str, FillParams] = {}
        self._inflight: dict[str, Future[FillParams]] = {}
        self._failed_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="decodebench-pull")
        self.pulls = 0
        self.failures = 0

    def get(self, run_id: str | None) -> FillParams:
        """Parameters for ``run_id``; never blocks longer than the timeout."""
        if run_id is None or self.control_url is None:
            return self.default
        with self._lock:
            cached = self._cache.get(run_id)
            if cached is not None:
                return cached
            failed_at = self._failed_at.get(run_id)
            if failed_at is not None and time.monotonic() - failed_at < self.retry_after_s:
                return self._fallback()
            future = self._inflight.get(run_id)
            started = future is None
            if future is None:
                future = self._pool.submit(self._pull, run_id)
                self._inflight[run_id] = future
        if started:
            # Outside the lock: a pull that already finished runs the callback right here.
            future.add_done_callback(functools.partial(self._landed, run_id))
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            log.warning("fill parameters for run %s not here within %.0f ms; using defaults",
                        run_id, self.timeout_s * 1000)
            return self._fallback()
        except PullError as exc:
            log.warning("pull of fill parameters for run %s failed (%s); using defaults",
                        run_id, exc)
            return self._fallback()

    def _fallback(self) -> FillParams:
        return FillParams("fill", self.default.mean, self.default.std, "fallback")

    def _landed(self, run_id: str, future: Future[FillParams]) -> None:
        with self._lock:
            self._inflight.pop(run_id, None)
            if future.exception() is None:
                self._cache[run_id] = future.result()
                # Runs are few, but a server can live long: keep the newest ones.
                while len(self._cache) > MAX_CACHED_RUNS:
                    self._cache.pop(next(iter(self._cache)))
                self._failed_at.pop(run_id, None)
            else:
                self.failures += 1
                self._failed_at[run_id] = time.monotonic()

    def _pull(self, run_id: str) -> FillParams:
        self.pulls += 1
        query = urllib.parse.urlencode({"run_id": run_id})
        request = urllib.request.Request(
            f"{self.control_url}/api/connector/fill?{query}",
            headers={"Authorization": f"Bearer {self.token or ''}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=max(1.0, self.timeout_s * 20)) as resp:
                body = resp.read(64 * 1024)
        except urllib.error.HTTPError as exc:
            exc.close()
            raise PullError(f"HTTP {exc.code}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PullError(str(exc)) from exc
        return parse_answer(body)

    def close(self) -> None:
        """Stop the pull threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def parse_answer(body: bytes) -> FillParams:
    """Validate the service's answer; anything malformed is a PullError."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise PullError(f"answer is not JSON: {body[:80]!r}") from exc
    if not isinstance(data, dict):
        raise PullError("answer is not a JSON object")
    mode = data.get("mode")
    mean = data.get("mean")
    std = data.get("std")
    if mode not in ("fill", "prefill"):
        raise PullError(f"bad mode {mode!r}")
    for name, value in (("mean", mean), ("std", std)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PullError(f"bad {name} {value!r}")
    assert isinstance(mean, (int, float)) and isinstance(std, (int, float))
    if std < 0:
        raise PullError(f"negative std {std!r}")
    return FillParams(str(mode), float(mean), float(std), "service")
