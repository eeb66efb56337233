"""The connector's pull of fill parameters against a real HTTP server that misbehaves on purpose.

The fake control service is the point here: it is down, slow, failing or answers
garbage. The engine thread must never wait on it and never guess: ``lookup``
answers at once, ``None`` while the values are on their way, and after a bounded
time an ``unresolved`` verdict with the reason, never other values.
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
                if control.behaviour in ("error", "refused"):
                    self.send_response(500 if control.behaviour == "error" else 404)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"no")
                    return
                run_id = self.path.split("run_id=")[1]
                if control.behaviour == "garbage":
                    body = b"<html>not json"
                elif control.behaviour == "bad-values":
                    body = json.dumps({"mode": "fill", "mean": "x", "std": -1}).encode()
                else:
                    mode = {"p": "prefill", "s": "seeded"}.get(run_id[0], "fill")
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


def _client(url: str | None, deadline: float = 10.0) -> ParamsClient:
    return ParamsClient(url, "secret", default_mean=0.015, default_std=0.0,
                        attempt_timeout_s=2.0, deadline_s=deadline)


def test_pull_returns_the_runs_values_and_sends_the_token(control: Control) -> None:
    params = _client(control.url).wait("r-1", 5.0)
    assert params is not None
    assert (params.mode, params.mean, params.std, params.source) == ("fill", 0.25, 0.5, "service")
    assert control.auth == ["Bearer secret"]


def test_the_first_look_never_waits_and_says_ask_again(control: Control) -> None:
    control.delay = 0.3
    client = _client(control.url)
    started = time.perf_counter()
    assert client.lookup("r-1") is None
    assert client.lookup("r-1") is None
    assert time.perf_counter() - started < 0.05
    params = client.wait("r-1", 5.0)
    assert params is not None and params.source == "service"
    assert control.hits == 1  # many looks, one pull


def test_pull_happens_once_per_run(control: Control) -> None:
    client = _client(control.url)
    assert client.wait("r-1", 5.0) is not None
    for _ in range(50):
        params = client.lookup("r-1")
        assert params is not None and params.source == "service"
    assert client.wait("p-2", 5.0) is not None
    assert control.hits == 2


def test_prefill_mode_comes_through(control: Control) -> None:
    params = _client(control.url).wait("p-1", 5.0)
    assert params is not None and params.mode == "prefill"


def test_untagged_request_uses_the_extra_config_values(control: Control) -> None:
    params = _client(control.url).lookup(None)
    assert params is not None
    assert (params.mode, params.mean, params.std, params.source) == ("fill", 0.015, 0.0, "default")
    assert control.hits == 0


def test_no_control_url_leaves_tagged_runs_unresolved_never_on_defaults() -> None:
    params = _client(None).lookup("r-1")
    assert params is not None and params.mode == "unresolved"
    assert "control_url" in params.error


def test_service_down_is_retried_until_the_deadline_then_unresolved() -> None:
    client = _client("http://127.0.0.1:9", deadline=0.6)  # nothing listens on the discard port
    started = time.perf_counter()
    params = client.wait("r-1", 5.0)
    waited = time.perf_counter() - started
    assert params is not None and params.mode == "unresolved"
    assert 0.6 <= waited < 2.5, waited
    assert client.pulls >= 3, "a service that is down is asked again, not given up at once"
    assert "attempts" in params.error and "refused" in params.error.lower()


@pytest.mark.parametrize("behaviour", ["error", "garbage", "bad-values"])
def test_bad_answers_never_become_values(control: Control, behaviour: str) -> None:
    control.behaviour = behaviour
    client = _client(control.url, deadline=0.5)
    params = client.wait("r-1", 5.0)
    assert params is not None and params.mode == "unresolved" and params.source == "failed"
    assert client.failures >= 2
    # The verdict is kept: later looks answer at once without asking the service again.
    hits = control.hits
    again = client.lookup("r-1")
    assert again is not None and again.mode == "unresolved"
    assert control.hits == hits


def test_a_refusal_is_final_at_once(control: Control) -> None:
    control.behaviour = "refused"
    client = _client(control.url, deadline=30.0)
    started = time.perf_counter()
    params = client.wait("r-1", 5.0)
    assert params is not None and params.mode == "unresolved"
    assert time.perf_counter() - started < 1.0
    assert "HTTP 404" in params.error
    assert control.hits == 1


def test_a_failure_then_success_within_the_deadline_gives_the_values(control: Control) -> None:
    control.behaviour = "error"
    client = _client(control.url, deadline=10.0)
    assert client.lookup("r-1") is None
    time.sleep(0.05)
    control.behaviour = "ok"
    params = client.wait("r-1", 5.0)
    assert params is not None and params.source == "service"


def test_a_pull_that_finishes_at_once_does_not_deadlock() -> None:
    from concurrent.futures import Future

    from connector.params import FillParams

    client = _client("http://127.0.0.1:9")
    done: Future[FillParams] = Future()
    done.set_result(FillParams("fill", 0.5, 0.0, "service"))
    client._pool.submit = lambda *args, **kwargs: done  # type: ignore[method-assign]
    result: list[FillParams | None] = []
    thread = threading.Thread(target=lambda: result.append(client.lookup("r-1")), daemon=True)
    thread.start()
    thread.join(timeout=2)
    assert result == [None], "lookup() hung"
    assert client.lookup("r-1") == FillParams("fill", 0.5, 0.0, "service")  # landed and cached
