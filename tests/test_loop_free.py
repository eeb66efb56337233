"""The control plane answers while a run ends: the CPU work of ending a big run (its
summary over every sample, its warnings) and the reads of a log never run on the event
loop that serves the API."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from service.analysis import metrics
from tests.conftest import make_client, wait_finished

SMALL = {"input_len": 16, "output_len": 8, "num_prompts": 6, "max_concurrency": 3}
# What summarising a run of thousands of long requests costs, stood in for by a pause
# that holds the thread it runs on. A loop it blocked answers /healthz after the whole
# pause; the bound below is a quarter of it, room for a busy machine (0.98 s was seen
# with a 2 s pause, on 4 pytest-xdist workers, with the loop free).
SLOW_SUMMARY_S = 4.0


def test_health_answers_at_once_while_a_run_is_summarised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
        done = wait_finished(client, run["id"], timeout=60)
        assert done["status"] == "succeeded", done["error"]
        assert slowest < SLOW_SUMMARY_S / 4, f"/healthz took {slowest:.2f} s while the run was summarised"
