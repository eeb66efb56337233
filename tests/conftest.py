"""Shared fixtures: a temp-dir service built by the factory, with a stub or real vLLM."""

from __future__ import annotations

import contextlib
import shlex
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
from tests.ports import free_port, service_server_ports

TESTS = Path(__file__).resolve().parent
STUB_COMMAND = f"{shlex.quote(sys.executable)} {shlex.quote(str(TESTS / 'stub_vllm.py'))}"
FINISHED = {"succeeded", "failed", "cancelled"}
API_TOKEN = "test-api-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


# On pytest-xdist workers (`make test TEST_WORKERS=4`, `make test-quick`) tests are handed out
# by group, and a group runs whole on one worker (on one process the groups set the order):
# - "vllm": the modules that start real vLLM servers (`test_e2e_*.py`, on Ray too), one after
#   the other, so no two of their servers share the machine's memory at once (vLLM on a CPU
#   refuses to start when its share is not free) and a server a module (or
#   `real_tiny_service`) holds is started once;
# - "ray": the other Ray modules (`test_ray_*.py`, stub servers): a cluster is several
#   raylets, one of these at a time (Ray picks free ports: two clusters can run at once);
# - otherwise its own file, so a module's fixtures (a shared service, a browser) are built once.
# The groups go out heaviest first (the collection order below; the scheduler keeps it), so the
# longest one does not start last: the "vllm" and "ray" groups, then the slow files, then the
# others longest first by what each took in the last run on workers (pytest's cache; without
# one, as a fresh clone, in file order). xdist's own `xdist_group` marks are not used: with
# pytest 9.2 they no longer reach its scheduler (it renames a node id pytest no longer reads).
def _group_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    if module.startswith("test_ray_"):
        return "ray"
    if module.startswith("test_e2e_"):
        return "vllm"
    return module


# Where the seconds each group took in the last run on workers are kept (pytest's cache).
DURATIONS_KEY = "decodebench/group_seconds"


def _rank(item: pytest.Item, took: dict[str, float]) -> tuple[int, float]:
    group = _group_of(item.nodeid)
    if item.get_closest_marker("e2e") is not None and group != "vllm":
        raise pytest.UsageError(f"{item.nodeid} starts a real vLLM server (e2e): its module's "
                                "name must start with test_e2e_ to run with the other such tests")
    if group == "vllm":
        # Real-shaped models first: their module's service is stopped before
        # `real_tiny_service`, which the other e2e modules share, starts its tiny server.
        # The families too large for two servers at once last: by then the other workers'
        # groups have mostly ended (a CI run saw the kernel kill a Qwen3-Next server of
        # 11 GB beside them).
        if item.path.name == "test_e2e_shapes_large.py":
            return 0, 2
        return 0, 0 if item.path.name == "test_e2e_shapes.py" else 1
    if group == "ray":
        return 1, 0
    return (2 if item.get_closest_marker("slow") is not None else 3), -took.get(group, 0.0)


def _on_workers(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) or hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every worker sorts alike (xdist checks that they all collected one order): they read
    # one cache, written only once the run is over. One process keeps the file order.
    cache = getattr(config, "cache", None)
    took = cache.get(DURATIONS_KEY, {}) if cache is not None and _on_workers(config) else {}
    items.sort(key=lambda item: _rank(item, took))  # stable: file order within a rank


_GROUP_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # On the controller too: each worker's reports reach it.
    _GROUP_SECONDS[_group_of(report.nodeid)] = _GROUP_SECONDS.get(_group_of(report.nodeid), 0.0) \
        + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    cache = getattr(config, "cache", None)
    if cache is None or hasattr(config, "workerinput") or not _on_workers(config) or not _GROUP_SECONDS:
        return
    took = {**cache.get(DURATIONS_KEY, {}), **{g: round(s, 1) for g, s in _GROUP_SECONDS.items()}}
    cache.set(DURATIONS_KEY, took)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """Whole groups to a worker, in collection order (``_group_of``)."""

        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    config.option.loadscopereorder = False  # the order above, not the groups' sizes
    return GroupScheduling(config, log)


_TINY_SERVICE = contextlib.ExitStack()


@pytest.fixture(scope="session")
def real_tiny_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """The service as a real process that starts real vLLM servers, shared by the e2e modules
    whose runs are on the bundled tiny model: its tiny server starts once for all of them.
    Stopped after the last test of the "vllm" group (``pytest_runtest_teardown``), not at
    the session's end: its server's memory is then free for the tests after it."""
    from tests.vllm_process import real_service  # imports this module

    yield _TINY_SERVICE.enter_context(real_service(tmp_path_factory.mktemp("e2e-tiny") / "var"))
    _TINY_SERVICE.close()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or _group_of(nextitem.nodeid) != "vllm":
        _TINY_SERVICE.close()  # nothing to do unless the shared tiny service runs


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
    if "server_ports" not in overrides:
        # Its servers' ports from a block of this worker's share, below the ephemeral range
        # (tests/ports.py): a port the system chose can be taken by another process's outgoing
        # connection before the server binds it.
        values["server_ports"] = service_server_ports()
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
        wait_answering(f"{url}/health", timeout=30, every=0.1, what="the stub server")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def wait_answering(url: str, timeout: float, every: float, what: str,
                   ended: Callable[[], str | None] = lambda: None,
                   detail: Callable[[], str] = lambda: "") -> None:
    """Poll ``url`` until it answers 200; fail the test at ``timeout`` (saying ``detail()``,
    a log's tail), or as soon as ``ended()`` says why the process behind it is gone. One
    client for all the polls: a new one builds a TLS context from the CA file (16 ms of CPU)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=min(every * 10, 2)) as http:
        while True:
            gone = ended()
            assert gone is None, gone
            try:
                if http.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{what} did not answer {url} in {timeout:.0f} s{detail()}"
            time.sleep(every)


def wait_until(done: Callable[[], bool], what: str, timeout: float = 60, every: float = 0.05) -> None:
    """Poll ``done()`` until it holds, in place of a sleep that hopes it does by then; fail
    the test at ``timeout``, saying ``what`` it waited for."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(every)


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
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} did not get there in {timeout} s; last seen: {run}")


def wait_finished(client: Any, run_id: str, timeout: float = 120) -> dict[str, Any]:
    """Poll a run until it reaches an end state."""
    return wait_for(client, run_id, lambda r: r["status"] in FINISHED, timeout)


@pytest.fixture
def no_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated capacity searches without the look's per-stream decode rate (a bootstrap
    for the P / D answer, not the verdict, and most of a look's time)."""
    from service.analysis import capacity_runs

    monkeypatch.setattr(capacity_runs, "per_user_rate", lambda *_: None)
