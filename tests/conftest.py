"""Shared fixtures: a temp-dir service built by the factory, with a stub or real vLLM."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings

TESTS = Path(__file__).resolve().parent
STUB_COMMAND = f"{shlex.quote(sys.executable)} {shlex.quote(str(TESTS / 'stub_vllm.py'))}"
FINISHED = {"succeeded", "failed", "cancelled"}
API_TOKEN = "test-api-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Settings for a test service in ``tmp_path``, with the stub vLLM by default."""
    values: dict[str, Any] = {
        "data_dir": tmp_path / "var",
        "vllm_command": STUB_COMMAND,
        "gpus": "",
        "worker_start_timeout_s": 60,
        "worker_stop_grace_s": 5,
        "scheduler_poll_s": 0.1,
        "api_token": API_TOKEN,
    }
    values.update(overrides)
    return Settings(**values)


def make_client(tmp_path: Path, **overrides: Any) -> TestClient:
    """A TestClient (not yet entered) that sends the API token, on a fresh service."""
    return TestClient(create_app(make_settings(tmp_path, **overrides)), headers=AUTH)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    """A TestClient on a fresh service (lifespan running) whose workers are stubs."""
    with make_client(tmp_path) as c:
        yield c


def wait_for(
    client: Any, run_id: str, done: Callable[[dict[str, Any]], bool], timeout: float = 120
) -> dict[str, Any]:
    """Poll a run until ``done(run)`` holds; fail the test on timeout."""
    deadline = time.monotonic() + timeout
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        run = client.get(f"/api/runs/{run_id}").json()
        if done(run):
            return run
        time.sleep(0.1)
    raise AssertionError(f"run {run_id} did not get there in {timeout} s; last seen: {run}")


def wait_finished(client: Any, run_id: str, timeout: float = 120) -> dict[str, Any]:
    """Poll a run until it reaches an end state."""
    return wait_for(client, run_id, lambda r: r["status"] in FINISHED, timeout)
