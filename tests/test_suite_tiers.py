"""The suite's tiers held to what they promise. A module marked ``unit`` (run alone by
``make test-unit``, a tier CI runs first) starts nothing: no service, no stub or real vLLM
server, no process, no Ray cluster, no browser. These tests fail when one of its tests
asks for a fixture that starts one, or the module imports what starts one."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The line a unit module says it with: `make test-unit` collects the modules holding it.
UNIT_LINE = "pytestmark = pytest.mark.unit"

# tests/conftest.py's fixtures that start a service or a server: all of them, so far. A new
# fixture there is one of these or one of PURE_CONFTEST_FIXTURES, said so below.
STARTING_FIXTURES = {"real_tiny_service", "client", "shared_service", "shared_client", "stub_service",
                     "stub"}
PURE_CONFTEST_FIXTURES = {"no_rate"}
# Fixtures of other modules that start a service process or a browser.
STARTING_ELSEWHERE = {"browser", "page", "pages", "service"}
# What starts a process or a server, or comes with one: never imported by a unit module.
STARTING_MODULES = {
    "subprocess", "multiprocessing", "concurrent.futures.process", "http.server", "socketserver",
    "uvicorn", "ray", "playwright", "fastapi.testclient", "starlette.testclient",
    "service.load.shards", "service.control.local", "service.control.ray_servers",
    "tests.conftest", "tests.service_process", "tests.vllm_process", "tests.stub_vllm",
}


@dataclass(frozen=True)
class Collected:
    nodeid: str
    path: Path
    fixtures: frozenset[str]
    unit: bool


class _Recorder:
    """A plugin of the nested collection: what each test item is and asks for."""

    def __init__(self) -> None:
        self.items: list[Collected] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = [Collected(item.nodeid, item.path, _fixtures_of(item),
                                item.get_closest_marker("unit") is not None) for item in session.items]


def _fixtures_of(item: pytest.Item) -> frozenset[str]:
    """The fixtures ``item`` gets, its own and theirs; not the names it is parametrized over
    (``page`` may be one), which shadow a fixture of that name, unless given ``indirect``."""
    names = set(getattr(item, "fixturenames", ()))
    for mark in item.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs["argnames"]
        if isinstance(argnames, str):
            argnames = [name.strip() for name in argnames.split(",")]
        indirect = mark.kwargs.get("indirect", False)
        names -= {name for name in argnames
                  if not (indirect is True or (isinstance(indirect, list | tuple) and name in indirect))}
    return frozenset(names)


@pytest.fixture(scope="module")
def collected() -> list[Collected]:
    """Every test of the suite as pytest collects it (in this process: nothing runs)."""
    recorder = _Recorder()
    code = pytest.main([str(TESTS), "--collect-only", "-qq", "-p", "no:cacheprovider"], plugins=[recorder])
    assert code == pytest.ExitCode.OK, f"collecting the suite failed ({code!r})"
    assert recorder.items, "the nested collection found no tests"
    return recorder.items


def _unit_modules() -> list[Path]:
    return sorted(p for p in TESTS.glob("test_*.py") if UNIT_LINE in p.read_text().splitlines())


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports, anywhere in it (a test may import inside its body)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from tests import vllm_process` names the module in its alias.
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _fixtures_defined(path: Path) -> set[str]:
    """The names of the fixtures ``path`` defines (functions decorated ``pytest.fixture``)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if isinstance(target, ast.Attribute) and target.attr == "fixture":
                    found.add(node.name)
    return found


def test_no_unit_test_asks_for_a_fixture_that_starts_a_server(collected: list[Collected]) -> None:
    starting = STARTING_FIXTURES | STARTING_ELSEWHERE
    wrong = {c.nodeid: sorted(c.fixtures & starting) for c in collected if c.unit and c.fixtures & starting}
    assert not wrong, f"tests marked unit that start a service, server or browser through a fixture: {wrong}"


def test_every_conftest_fixture_is_said_to_start_something_or_not() -> None:
    defined = _fixtures_defined(TESTS / "conftest.py")
    unsorted = defined - STARTING_FIXTURES - PURE_CONFTEST_FIXTURES
    assert not unsorted, (f"tests/conftest.py fixtures {sorted(unsorted)}: add each to STARTING_FIXTURES "
                          "or PURE_CONFTEST_FIXTURES in tests/test_suite_tiers.py")
    gone = (STARTING_FIXTURES | PURE_CONFTEST_FIXTURES) - defined
    assert not gone, f"fixtures named here but gone from tests/conftest.py: {sorted(gone)}"


def test_unit_modules_import_nothing_that_starts_a_process_or_server() -> None:
    units = _unit_modules()
    assert units, f"no test module says `{UNIT_LINE}`"
    unit_names = {f"tests.{p.stem}" for p in units}
    wrong: dict[str, list[str]] = {}
    for path in units:
        imported = _imports(path)
        bad = {name for name in imported
               if name in STARTING_MODULES or name.split(".")[0] in STARTING_MODULES}
        # Another test module's helpers are fine only from a unit module (its fixtures and
        # servers come with it otherwise).
        bad |= {name for name in imported
                if name.startswith("tests.test_") and ".".join(name.split(".")[:2]) not in unit_names}
        if bad:
            wrong[path.name] = sorted(bad)
    assert not wrong, f"unit modules importing what starts a process or a server: {wrong}"


def test_unit_tests_are_in_the_modules_make_test_unit_collects(collected: list[Collected]) -> None:
    units = set(_unit_modules())
    elsewhere = sorted(c.nodeid for c in collected if c.unit and c.path not in units)
    assert not elsewhere, (f"tests marked unit outside a module saying `{UNIT_LINE}` (make test-unit "
                           f"collects only those; mark the whole module): {elsewhere}")
    assert any(c.unit for c in collected)
    makefile = (TESTS.parent / "Makefile").read_text()
    assert f"grep -l '^{UNIT_LINE}$$'" in makefile, "make test-unit no longer finds unit modules by this line"
