"""The control plane answers while a run ends: the CPU work of ending a big run (its
summary over every sample, its warnings) and the reads of a log never run on the event
loop that serves the API."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.analysis import metrics
from tests.conftest import make_client, wait_finished

SMALL = {"input_len": 16, "output_len": 8, "num_prompts": 6, "max_concurrency": 3}
# What summarising a run of thousands of long requests costs, stood in for by a pause
# that holds the thread it runs on. A loop it blocked answers /healthz after the whole
# pause; the bound below is a quarter of it, room for a busy machine.
SLOW_SUMMARY_S = 4.0


@pytest.fixture
def heap_of_this_test_only() -> Iterator[None]:
    """The service under test shares its process with the test runner, whose heap holds
    what every earlier test on this worker left (450,000 objects after 650 tests on 4
    pytest-xdist workers). A full collection of that heap held the GIL for 0.68 s while
    /healthz was timed (gc.callbacks), and twice pushed it over the bound (0.98 s, 1.41 s)
    with the loop free. A service process owns only its own heap: collect and freeze the
    runner's, so the collector still runs but scans only what this test makes."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_health_answers_at_once_while_a_run_is_summarised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heap_of_this_test_only: None
) -> None:
    real = metrics.summarize
    summarising = threading.Event()

    def slow_summarize(*args: Any, **kwargs: Any) -> Any:
        summarising.set()
        time.sleep(SLOW_SUMMARY_S)
        return real(*args, **kwargs)

    monkeypatch.setattr("service.control.runner.summarize", slow_summarize)
    with make_client(tmp_path) as client:
        run = client.post("/api/runs", json=SMALL).json()
        assert summarising.wait(timeout=60), "the run never got to its summary"
        slowest = 0.0
        deadline = time.monotonic() + SLOW_SUMMARY_S
        while time.monotonic() < deadline:
            began = time.monotonic()
            assert client.get("/healthz").status_code == 200
            slowest = max(slowest, time.monotonic() - began)
            time.sleep(0.02)  # a poll every 20 ms or so, not a core spent polling
        done = wait_finished(client, run["id"], timeout=60)
        assert done["status"] == "succeeded", done["error"]
        assert slowest < SLOW_SUMMARY_S / 4, f"/healthz took {slowest:.2f} s while the run was summarised"
