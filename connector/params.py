"""Per-run fill parameters, pulled from the decodebench service by the scheduler side.

The engine thread never waits here and never guesses. ``lookup`` answers at once
with one of three things: the run's own parameters (pulled once, then cached);
``None`` while the pull is in flight, so the scheduler side tells vLLM to ask
again later and the request waits in vLLM's queue; or, once the run's values
cannot be had, a verdict with ``mode == "unresolved"`` and the reason. A pull is
retried with a growing pause until ``deadline_s`` after the run's first request;
an answer that says the run is not this worker's (401, 403, 404, 409, 410, 422)
ends it at once, since asking again would not change it. Untagged requests
(not sent by the service) use the values in the connector's extra config.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)

# One HTTP attempt may take this long.
DEFAULT_ATTEMPT_TIMEOUT_S = 5.0
# After this long since a run's first request without its values, its requests are
# not filled and the run is reported as unresolved (the service fails it).
DEFAULT_DEADLINE_S = 30.0
# Pauses between attempts grow from the first to the last.
FIRST_RETRY_S = 0.1
LAST_RETRY_S = 1.0
MAX_CACHED_RUNS = 4096
# Answers that another attempt would not change.
FINAL_STATUSES = frozenset({400, 401, 403, 404, 409, 410, 422})


@dataclass(frozen=True)
class FillParams:
    """How to treat one run's requests: fill with (mean, std), real prefill, or neither
    (``unresolved``: the run's values could not be had; ``error`` says why)."""

    mode: str
    mean: float
    std: float
    # "service" when pulled, "default" for untagged requests, "failed" when unresolved.
    source: str
    error: str = ""


class PullError(Exception):
    """The service did not give usable parameters."""

    def __init__(self, message: str, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


@dataclass
class _Pending:
    """A run whose values are not here yet."""

    first_seen: float
    attempts: int = 0
    retry_at: float = 0.0
    last_error: str = ""
    future: Future[FillParams] | None = None


class ParamsClient:
    """Fetches and caches fill parameters per run id, never blocking the caller."""

    def __init__(
        self,
        control_url: str | None,
        token: str | None,
        default_mean: float,
        default_std: float,
        attempt_timeout_s: float = DEFAULT_ATTEMPT_TIMEOUT_S,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        self.control_url = control_url.rstrip("/") if control_url else None
        self.token = token
        self.default = FillParams("fill", default_mean, default_std, "default")
        self.attempt_timeout_s = attempt_timeout_s
        self.deadline_s = deadline_s
        self._cache: dict[str, FillParams] = {}
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="decodebench-pull")
        self.pulls = 0
        self.failures = 0

    def lookup(self, run_id: str | None) -> FillParams | None:
        """The run's parameters, ``None`` while they are on their way, or an
        ``unresolved`` verdict. Untagged requests get the extra-config values."""
        if run_id is None:
            return self.default
        now = time.monotonic()
        with self._lock:
            known = self._cache.get(run_id)
            if known is not None:
                return known
            if self.control_url is None:
                return self._settle(run_id, FillParams(
                    "unresolved", 0.0, 0.0, "failed",
                    "the connector has no control_url, so it cannot ask for this run's values"))
            pending = self._pending.get(run_id)
            if pending is None:
                pending = self._pending[run_id] = _Pending(first_seen=now)
            if pending.future is not None or now < pending.retry_at:
                return None
            if now - pending.first_seen >= self.deadline_s and pending.attempts:
                return self._settle(run_id, FillParams(
                    "unresolved", 0.0, 0.0, "failed",
                    f"no values from the service after {pending.attempts} attempts in "
                    f"{now - pending.first_seen:.1f} s; last error: {pending.last_error}"))
            pending.attempts += 1
            future = pending.future = self._pool.submit(self._pull, run_id)
        # Outside the lock: a pull that already finished runs the callback right here.
        future.add_done_callback(functools.partial(self._landed, run_id))
        return None

    def wait(self, run_id: str | None, timeout_s: float) -> FillParams | None:
        """``lookup`` until it answers or ``timeout_s`` passes (for tests and tools; the
        engine never calls this)."""
        end = time.monotonic() + timeout_s
        while True:
            answer = self.lookup(run_id)
            if answer is not None or time.monotonic() >= end:
                return answer
            time.sleep(0.005)

    def _settle(self, run_id: str, params: FillParams) -> FillParams:
        """Cache a final answer for a run (lock held)."""
        self._pending.pop(run_id, None)
        self._cache[run_id] = params
        # Runs are few, but a server can live long: keep the newest ones.
        while len(self._cache) > MAX_CACHED_RUNS:
            self._cache.pop(next(iter(self._cache)))
        if params.mode == "unresolved":
            log.error("decodebench run %s: its requests will not be filled: %s", run_id, params.error)
        return params

    def _landed(self, run_id: str, future: Future[FillParams]) -> None:
        with self._lock:
            pending = self._pending.get(run_id)
            if pending is None:
                return
            pending.future = None
            error = future.exception()
            if error is None:
                self._settle(run_id, future.result())
                return
            self.failures += 1
            pending.last_error = str(error)
            if isinstance(error, PullError) and error.final:
                self._settle(run_id, FillParams("unresolved", 0.0, 0.0, "failed",
                                                f"the service refused: {error}"))
                return
            pause = min(LAST_RETRY_S, FIRST_RETRY_S * 2 ** (pending.attempts - 1))
            pending.retry_at = time.monotonic() + pause
        log.warning("pull of fill parameters for run %s failed (%s); trying again in %.1f s",
                    run_id, error, pause)

    def _pull(self, run_id: str) -> FillParams:
        self.pulls += 1
        query = urllib.parse.urlencode({"run_id": run_id})
        request = urllib.request.Request(
            f"{self.control_url}/api/connector/fill?{query}",
            headers={"Authorization": f"Bearer {self.token or ''}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.attempt_timeout_s) as resp:
                body = resp.read(64 * 1024)
        except urllib.error.HTTPError as exc:
            detail = exc.read(300).decode("utf-8", "replace").strip()
            exc.close()
            raise PullError(f"HTTP {exc.code} {detail}".strip(),
                            final=exc.code in FINAL_STATUSES) from exc
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            raise PullError(str(exc) or type(exc).__name__) from exc
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
    if mode not in ("fill", "prefill", "seeded"):
        raise PullError(f"bad mode {mode!r}")
    for name, value in (("mean", mean), ("std", std)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PullError(f"bad {name} {value!r}")
    assert isinstance(mean, (int, float)) and isinstance(std, (int, float))
    if std < 0:
        raise PullError(f"negative std {std!r}")
    return FillParams(str(mode), float(mean), float(std), "service")
