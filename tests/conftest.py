"""Shared fixtures: a temp-dir service built by the factory, with a stub or real vLLM."""

from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings

TESTS = Path(__file__).resolve().parent
STUB_COMMAND = f"{shlex.quote(sys.executable)} {shlex.quote(str(TESTS / 'stub_vllm.py'))}"
FINISHED = {"succeeded", "failed", "cancelled"}
API_TOKEN = "test-api-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Settings for a test service in ``tmp_path``, with the stub vLLM by default."""
    values: dict[str, Any] = {
        "control_url": f"http://127.0.0.1:{free_port()}",
        "data_dir": tmp_path / "var",
        "vllm_command": STUB_COMMAND,
        "gpus": "",
        "worker_start_timeout_s": 60,
        "worker_stop_grace_s": 5,
        "scheduler_poll_s": 0.1,
        "api_token": API_TOKEN,
        # Tests never reach the Hugging Face hub: a repo id must be in the (test's) cache.
        "hub_check": "cache",
    }
    values.update(overrides)
    return Settings(**values)


class ServedTestClient(TestClient):
    """A TestClient whose app is also served over real HTTP at the settings' ``control_url``,
    while it is entered: the workers' connectors (and the stub's stand-in for one) pull
    fill values from the service and report back, as they do from a real deployment."""

    def __init__(self, settings: Settings, **kwargs: Any) -> None:
        super().__init__(create_app(settings), **kwargs)
        self.control_url = settings.control_base_url()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ServedTestClient:
        super().__enter__()  # the app's lifespan runs here, once; the HTTP side shares its state
        host, port = self.control_url.removeprefix("http://").split(":")
        config = uvicorn.Config(self.app, host=host, port=int(port), lifespan="off",
                                log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *args: Any) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        super().__exit__(*args)


def make_client(tmp_path: Path, **overrides: Any) -> ServedTestClient:
    """A TestClient (not yet entered) that sends the API token, on a fresh service."""
    return ServedTestClient(make_settings(tmp_path, **overrides), headers=AUTH)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    """A TestClient on a fresh service (lifespan running) whose workers are stubs."""
    with make_client(tmp_path) as c:
        yield c


@pytest.fixture(scope="module")
def shared_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedTestClient]:
    """One service for the tests of a module that leave no state on it (refusals,
    validation, sessions held by the client): built once, not once a test."""
    with make_client(tmp_path_factory.mktemp("shared")) as served:
        yield served


@pytest.fixture
def shared_client(shared_service: ServedTestClient) -> Iterator[TestClient]:
    """A client of its own (headers, cookies) on the module's ``shared_service``; its
    requests run on that service's event loop, as the service's own client's do."""
    client = TestClient(shared_service.app, headers=AUTH)
    client.portal = shared_service.portal
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def stub_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., TestClient]]:
    """Start a service (``env``: the stub knobs its next workers start with, for a worker
    that misbehaves on purpose; ``settings``: the service's); stopped at the end."""
    clients: list[TestClient] = []

    def start(env: dict[str, str] | None = None, **settings: Any) -> TestClient:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        client = make_client(tmp_path, **settings)
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def stub() -> Iterator[str]:
    """The URL of a stub vLLM server process (a token every 5 ms), stopped at the end."""
    with stub_server() as url:
        yield url


@contextlib.contextmanager
def stub_server() -> Iterator[str]:
    """A stub vLLM server process (a token every 5 ms) while in the block: its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(TESTS / "stub_vllm.py"), "--port", str(port),
                             "--served-model-name", "stub"], env={"STUB_TOKEN_INTERVAL_S": "0.005",
                                                                  "PATH": "/usr/bin:/bin"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "stub did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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
