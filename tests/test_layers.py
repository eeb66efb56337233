"""The import rules ARCHITECTURE.md states, checked on the source as it is.

The service's packages form layers: each imports only from the layers below it
(``core`` < ``storage`` < ``analysis`` < ``load`` < ``control`` < ``web``), and the
process entry points (``app``, ``__main__``) sit on top. ``service`` never imports vLLM
or torch; ``connector`` never imports ``service``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("core", "storage", "analysis", "load", "control", "web")
TOP = ("app", "__main__")


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports (at any depth: function-level imports count too)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)]
    return found


def layer_of(module: str) -> str | None:
    """The layer of a ``service.*`` module name (None: settings, importable by all)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "service":
        return None
    return parts[1] if parts[1] in LAYERS or parts[1] in TOP else None


def rank(layer: str) -> int:
    return LAYERS.index(layer) if layer in LAYERS else len(LAYERS)


def service_files() -> list[Path]:
    return sorted(p for p in (ROOT / "service").rglob("*.py") if "migrations" not in p.parts)


def test_every_package_imports_only_the_layers_below_it() -> None:
    wrong = []
    for path in service_files():
        own = layer_of("service." + ".".join(path.relative_to(ROOT / "service").with_suffix("").parts))
        if own is None:
            continue
        for line, module in imports(path):
            other = layer_of(module)
            if other is not None and other != own and rank(other) > rank(own):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports {module} ({other})")
    assert not wrong, "upward imports:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package, banned", [("service", ("vllm", "torch")), ("connector", ("service",))])
def test_import_boundaries(package: str, banned: tuple[str, ...]) -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((ROOT / package).rglob("*.py"))
             for line, module in imports(path) if module.split(".")[0] in banned]
    assert not wrong, "\n".join(wrong)


def test_route_modules_import_no_route_module_and_web_modules_none_above_them() -> None:
    # What two routes share lives beside them in service/web (admission, cancelling,
    # downloads, vllm_export); a module there imports no route or page module. A package's
    # __init__ gathers its routers; the pages share their renderer.
    wrong = []
    for folder in ("api", "pages"):
        for path in sorted((ROOT / "service" / "web" / folder).glob("*.py")):
            if path.name == "__init__.py":
                continue
            wrong += [f"{path.relative_to(ROOT)}:{line} imports {module}" for line, module in imports(path)
                      if module.startswith(f"service.web.{folder}.") and module != "service.web.pages.render"]
    for path in sorted((ROOT / "service" / "web").glob("*.py")):
        wrong += [f"{path.relative_to(ROOT)}:{line} imports {module}" for line, module in imports(path)
                  if module.startswith(("service.web.api", "service.web.pages"))]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from service.web.errors import shown\n")
    layers = [layer_of(m) for _, m in imports(bad)]
    assert layers == ["web"] and rank("web") > rank("storage")


def test_ray_is_not_imported_without_a_ray_address(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tests.conftest import make_client\n"
        "with make_client(Path(sys.argv[1])) as client:\n"
        "    assert client.get('/api/cluster').json()['backend'] == 'local'\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_command_line_is_a_client_of_the_api_only() -> None:
    """``service/cli`` talks to the service over HTTP: it imports nothing of the service but
    itself (and ``service.__main__``, which ``decodebench serve`` starts); nothing imports it."""
    wrong = []
    for path in service_files():
        inside = "cli" in path.relative_to(ROOT / "service").parts[:1]
        for line, module in imports(path):
            if not module.startswith("service"):
                continue
            if inside and not module.startswith(("service.cli", "service.__main__")):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if not inside and module.startswith("service.cli"):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the command line ({module})")
    assert not wrong, "\n".join(wrong)
