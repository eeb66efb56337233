"""The connector's reports of its counters against a real HTTP server that answers as a test
sets: a refusal (4xx) is not sent again, a failure (5xx, no answer) is."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from connector.report import Reporter


class Control:
    """A control service that answers every report with ``status`` and counts them."""

    def __init__(self) -> None:
        self.status = 403
        # Answer with bytes that are not HTTP instead (a gRPC server's first frame), as a
        # program that took the service's old port does.
        self.garbage = False
        self.posts = 0
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        control = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                control.posts += 1
                if control.garbage:
                    self.wfile.write(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x05\x00\x00@\x00\r\n")
                    self.close_connection = True
                    return
                control.paths.append(self.path)
                if control.status < 300:
                    control.bodies.append(json.loads(body))
                self.send_response(control.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

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


@pytest.fixture
def reporter(control: Control) -> Iterator[Reporter]:
    r = Reporter(control.url, "revoked-token", "scheduler", 0, interval_s=0.02)
    yield r
    r.close()


def _posts_settle(control: Control, seconds: float = 0.5) -> int:
    time.sleep(seconds)
    return control.posts


def test_a_refused_report_is_not_sent_again(control: Control, reporter: Reporter) -> None:
    reporter.add("r-1", requests_seen=1)
    # 25 intervals: once refused, the same counters are not posted again.
    assert _posts_settle(control) == 1
    # New counters are a new report.
    reporter.add("r-1", requests_seen=1)
    assert _posts_settle(control) == 2


@pytest.mark.parametrize("status", [500, 429])
def test_a_report_the_service_could_not_take_is_sent_again(control: Control, reporter: Reporter,
                                                           status: int) -> None:
    control.status = status
    reporter.add("r-1", requests_seen=1)
    assert _posts_settle(control) >= 5
    control.status = 204
    taken = _posts_settle(control)
    assert _posts_settle(control) == taken


def test_timed_steps_reach_the_service_once_each_in_order_after_a_failure(control: Control) -> None:
    from connector import report

    control.status = 503
    reporter = Reporter(control.url, "token", "worker", 0, interval_s=0.02)
    try:
        total = report.MAX_STEPS_PER_REPORT * 2 + 10
        for n in range(total):
            reporter.add_step("r-a", [n, 4, 0, 4000 + n, 0, 1.5])
        time.sleep(0.3)
        assert control.posts > 0 and control.bodies == []  # the service failed: nothing taken
        control.status = 204
        deadline = time.monotonic() + 10
        while sum(len(b.get("steps", {}).get("r-a", [])) for b in control.bodies) < total:
            assert time.monotonic() < deadline, len(control.bodies)
            time.sleep(0.02)
        sent = [row[0] for b in control.bodies for row in b.get("steps", {}).get("r-a", [])]
        assert sent == list(range(total))  # each once, oldest first
        # No report carried more than its share, and the counters say how many were timed.
        largest = max(len(b.get("steps", {}).get("r-a", [])) for b in control.bodies)
        assert largest <= report.MAX_STEPS_PER_REPORT
        assert control.bodies[-1]["runs"]["r-a"]["steps_timed"] == total
    finally:
        reporter.close()


def test_an_answer_that_is_not_http_is_sent_again_and_the_report_thread_lives_on(
        control: Control) -> None:
    # A fresh-clone CI run: the service a server reported to had stopped and a Ray process
    # took its port; the report thread died on the bad status line, and a vLLM server's
    # connector would have reported nothing more for its life.
    control.garbage = True
    reporter = Reporter(control.url, "token", "worker", 0, interval_s=0.02)
    try:
        reporter.provenance({"connector": "decodebench"})
        reporter.add("r-1", requests_seen=1)
        deadline = time.monotonic() + 10
        while control.posts < 5:
            assert time.monotonic() < deadline, control.posts
            time.sleep(0.02)
        assert reporter._thread is not None and reporter._thread.is_alive()
        assert control.bodies == []
        control.status, control.garbage = 204, False
        while "/api/connector/report" not in control.paths:
            assert time.monotonic() < deadline, control.paths
            time.sleep(0.02)
        assert "/api/connector/provenance" in control.paths
        (report,) = [b for b in control.bodies if "runs" in b]
        assert report["runs"]["r-1"]["requests_seen"] == 1
    finally:
        reporter.close()
