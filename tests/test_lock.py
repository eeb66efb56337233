"""constraints-cpu.txt, the versions a CPU machine installs (the Makefile's ``LOCK``), agrees
with pyproject.toml: every package the project asks for on a CPU is pinned there, at a
version the project's range takes. A range raised or a dependency added without ``make lock``
fails here, with the fix, instead of at ``pip install`` or, worse, unpinned in CI."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints-cpu.txt"
# What `make setup-dev` installs on a CPU: the project and these extras.
CPU_EXTRAS = ("cpu", "dev", "ray")
# pyproject.toml pins it and the machine's wheel folder supplies the CPU build.
UNLOCKED = {"torch"}


def _pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints-cpu.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = version
    return pins


def _asked() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    lines = [*project["dependencies"], *(r for extra in CPU_EXTRAS for r in extras[extra])]
    return [Requirement(line) for line in lines]


def test_every_package_the_project_asks_for_on_a_cpu_is_pinned_where_its_range_takes_it() -> None:
    pins = _pins()
    wrong = []
    for req in _asked():
        name = canonicalize_name(req.name)
        if name in UNLOCKED:
            assert name not in pins, f"{name} is pinned by pyproject.toml alone: not in constraints-cpu.txt"
        elif name not in pins:
            wrong.append(f"{req.name}: not in constraints-cpu.txt")
        elif not req.specifier.contains(pins[name], prereleases=True):
            wrong.append(f"{req.name}: constraints-cpu.txt has {pins[name]}, pyproject.toml {req.specifier}")
    assert not wrong, "run `make lock` once the suite passes on the new versions: " + "; ".join(wrong)


def test_the_lock_names_each_package_once() -> None:
    names = [canonicalize_name(line.partition("==")[0])
             for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert len(names) == len(set(names)) > 100
