"""The connector's pull of fill parameters against a real HTTP server that misbehaves on purpose.

The fake control service is the point here: it is down, slow, failing or answers
garbage, and the pull must stay bounded, fall back, and count it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from connector.params import ParamsClient


class Control:
    """A control service whose behaviour a test sets: ok, slow, error, garbage."""

    def __init__(self) -> None:
        self.behaviour = "ok"
        self.delay = 0.0
        self.hits = 0
        self.auth: list[str] = []
        control = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                control.hits += 1
                control.auth.append(self.headers.get("Authorization", ""))
                if control.delay:
                    time.sleep(control.delay)
                if control.behaviour == "error":
                    self.send_response(500)
                    self.end_headers()
                    return
                run_id = self.path.split("run_id=")[1]
                if control.behaviour == "garbage":
                    body = b"<html>not json"
                elif control.behaviour == "bad-values":
                    body = json.dumps({"mode": "fill", "mean": "x", "std": -1}).encode()
                else:
                    mode = "prefill" if run_id.startswith("p") else "fill"
                    body = json.dumps({"run_id": run_id, "mode": mode, "mean": 0.25,
                                       "std": 0.5}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def control() -> Iterator[Control]:
    c = Control()
    yield c
    c.server.shutdown()
    c.server.server_close()


def _client(url: str | None, timeout: float = 0.05, retry: float = 5.0) -> ParamsClient:
    return ParamsClient(url, "secret", default_mean=0.015, default_std=0.0,
                        timeout_s=timeout, retry_after_s=retry)


def test_pull_returns_the_runs_values_and_sends_the_token(control: Control) -> None:
    params = _client(control.url, timeout=2.0).get("r-1")
    assert (params.mode, params.mean, params.std, params.source) == ("fill", 0.25, 0.5, "service")
    assert control.auth == ["Bearer secret"]


def test_pull_happens_once_per_run(control: Control) -> None:
    client = _client(control.url, timeout=2.0)
    for _ in range(50):
        assert client.get("r-1").source == "service"
    client.get("p-2")
    assert control.hits == 2


def test_prefill_mode_comes_through(control: Control) -> None:
    assert _client(control.url, timeout=2.0).get("p-1").mode == "prefill"


def test_untagged_request_uses_the_extra_config_values(control: Control) -> None:
    params = _client(control.url).get(None)
    assert (params.mean, params.std, params.source) == (0.015, 0.0, "default")
    assert control.hits == 0


def test_service_down_falls_back_at_once() -> None:
    client = _client("http://127.0.0.1:9")  # nothing listens on the discard port
    started = time.perf_counter()
    params = client.get("r-1")
    assert time.perf_counter() - started < 0.2
    assert (params.mean, params.source) == (0.015, "fallback")


def test_slow_service_costs_at_most_the_timeout_then_its_answer_is_used(control: Control) -> None:
    control.delay = 0.3
    client = _client(control.url, timeout=0.05)
    started = time.perf_counter()
    assert client.get("r-1").source == "fallback"
    waited = time.perf_counter() - started
    assert waited < 0.15, waited
    time.sleep(0.5)  # the late answer lands in the cache
    assert client.get("r-1").source == "service"
    assert control.hits == 1


@pytest.mark.parametrize("behaviour", ["error", "garbage", "bad-values"])
def test_bad_answers_fall_back_and_are_counted(control: Control, behaviour: str) -> None:
    control.behaviour = behaviour
    client = _client(control.url, timeout=2.0, retry=60.0)
    assert client.get("r-1").source == "fallback"
    time.sleep(0.05)
    assert client.failures == 1
    # Within the retry window the engine does not wait again.
    started = time.perf_counter()
    assert client.get("r-1").source == "fallback"
    assert time.perf_counter() - started < 0.01
    assert control.hits == 1


def test_failed_pull_is_retried_after_the_window(control: Control) -> None:
    control.behaviour = "error"
    client = _client(control.url, timeout=2.0, retry=0.1)
    assert client.get("r-1").source == "fallback"
    control.behaviour = "ok"
    time.sleep(0.2)
    assert client.get("r-1").source == "service"


def test_a_pull_that_finishes_at_once_does_not_deadlock() -> None:
    from concurrent.futures import Future

    from connector.params import FillParams

    client = _client("http://127.0.0.1:9", timeout=1.0)
    done: Future[FillParams] = Future()
    done.set_result(FillParams("fill", 0.5, 0.0, "service"))
    client._pool.submit = lambda *args, **kwargs: done  # type: ignore[method-assign]
    result: list[FillParams] = []
    thread = threading.Thread(target=lambda: result.append(client.get("r-1")), daemon=True)
    thread.start()
    thread.join(timeout=2)
    assert result == [FillParams("fill", 0.5, 0.0, "service")], "get() hung"
    assert client.get("r-1").mean == 0.5  # cached
