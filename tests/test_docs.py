"""The docs held to the code: every setting and every route is in docs/reference.md and
everything listed there exists, every relative link in README.md and docs/ leads somewhere,
every `decodebench` command the docs show takes the flags they give it, and the README
stays short enough to read in five minutes.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from starlette.routing import Route

from service.app import create_app
from service.cli.commands import cli
from service.settings import Settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "reference.md"
DOCS = [README, ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIX = Settings.model_config["env_prefix"]
README_MAX_LINES = 220
# Variables with the prefix that are no setting of the service: the terminal client's.
CLIENT_VARIABLES = {"DECODEBENCH_URL"}
METHODS = "GET|POST|PUT|PATCH|DELETE"
# A row of a settings table: | `DECODEBENCH_X` | default | meaning |
SETTING_ROW = re.compile(r"^\|\s*`(DECODEBENCH_[A-Z0-9_]+)`\s*\|([^|]*)\|")
# A row of a routes table: | `GET /api/runs/{id}` | what |
ROUTE_ROW = re.compile(rf"^\|\s*`({METHODS}) (/[^`?\s]*)[^`]*`\s*\|")
# A route named anywhere in the docs: `POST /api/...`
API_MENTION = re.compile(rf"`({METHODS}) (/api/[^`?\s]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _doc(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _normal(path: str) -> str:
    """A route's path with its parameters unnamed: /api/runs/{run_id} (or <id>) is /api/runs/{}."""
    return re.sub(r"\{[^}]*\}|<[^>]*>", "{}", path.rstrip("/") or "/")


def _env_name(field: str) -> str:
    return (PREFIX + field).upper()


def _default_text(field: str) -> str | None:
    """The default as the reference writes it first in its cell; None when unset."""
    default = Settings.model_fields[field].default
    if default is None:
        return None
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, Path):
        return f"./{default}"
    return str(default)


def _documented_settings() -> dict[str, str]:
    """The settings table of docs/reference.md: variable -> its default cell."""
    rows = [SETTING_ROW.match(line) for line in _doc(REFERENCE).splitlines()]
    return {m.group(1): m.group(2).strip() for m in rows if m}


def test_every_setting_is_in_the_reference_and_every_listed_one_exists() -> None:
    documented = _documented_settings()
    fields = {_env_name(name): name for name in Settings.model_fields}
    problems = [f"{v}: a setting of service/settings.py, missing"
                for v in sorted(set(fields) - set(documented))]
    problems += [f"{v}: listed, but service/settings.py has no such setting"
                 for v in sorted(set(documented) - set(fields))]
    for variable, field in sorted(fields.items()):
        default = _default_text(field)
        first = re.match(r"`([^`]*)`", documented.get(variable, ""))
        if variable in documented and default is not None and (first is None or first.group(1) != default):
            problems.append(
                f"{variable}: default written {documented[variable]!r}, the code's is `{default}`")
    assert not problems, "docs/reference.md, settings:\n" + "\n".join(problems)


def test_every_decodebench_variable_named_in_the_docs_is_a_setting() -> None:
    settings = {_env_name(name) for name in Settings.model_fields} | CLIENT_VARIABLES
    named = {(path.relative_to(ROOT).as_posix(), name) for path in DOCS
             for name in re.findall(r"DECODEBENCH_[A-Z0-9_]*[A-Z0-9]", _doc(path))}
    unknown = sorted((where, name) for where, name in named if name not in settings)
    assert not unknown, f"variables the docs name that are no setting: {unknown}"


def _app_routes(tmp_path: Path) -> set[tuple[str, str]]:
    app = create_app(Settings(data_dir=tmp_path, api_token="docs"))
    internal = {app.swagger_ui_oauth2_redirect_url}  # the Swagger page's own helper
    return {(method, _normal(route.path)) for route in app.routes
            if isinstance(route, Route) and route.path not in internal
            for method in (route.methods or set()) - {"HEAD"}}


def test_every_route_is_in_the_reference_and_every_listed_one_exists(tmp_path: Path) -> None:
    routes = _app_routes(tmp_path)
    rows = [ROUTE_ROW.match(line) for line in _doc(REFERENCE).splitlines()]
    documented = {(m.group(1), _normal(m.group(2))) for m in rows if m}
    problems = [f"{m} {p}: a route of the app, missing" for m, p in sorted(routes - documented)]
    problems += [f"{m} {p}: listed, but the app has no such route" for m, p in sorted(documented - routes)]
    assert not problems, "docs/reference.md, routes:\n" + "\n".join(problems)


def test_every_api_route_named_in_the_docs_exists(tmp_path: Path) -> None:
    routes = _app_routes(tmp_path)
    named = {(path.relative_to(ROOT).as_posix(), m.group(1), m.group(2)) for path in DOCS
             for m in API_MENTION.finditer(_doc(path))}
    unknown = sorted(n for n in named if (n[1], _normal(n[2])) not in routes)
    assert not unknown, f"routes the docs name that the app lacks (file, method, path): {unknown}"


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings, and its explicit ``<a id>``s."""
    text = _doc(path)
    found = set(re.findall(r'<a id="([^"]+)">', text))
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.*)", line)
        if heading and not fenced:
            title = heading.group(1).strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_every_relative_link_leads_to_a_file_and_heading_that_exist() -> None:
    broken = []
    for path in DOCS:
        for target in LINK.findall(_doc(path)):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT).as_posix()} -> {target}"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{where}: no heading or anchor #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(_doc(README))}
    unlinked = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name not in linked)
    assert not unlinked, f"pages of docs/ the README does not link: {unlinked}"


def test_the_readme_reads_in_five_minutes() -> None:
    lines = len(_doc(README).splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into docs/")


def _commands(path: Path) -> list[str]:
    """Each ``decodebench ...`` command line of the page's code blocks, continuations joined,
    comments dropped."""
    commands, fenced, pending = [], False, ""
    for line in _doc(path).splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        code = line.split(" #", 1)[0].strip()
        text = f"{pending} {code}" if pending else code
        if text.endswith("\\"):
            pending = text[:-1]
            continue
        pending = ""
        if text.startswith("decodebench "):
            commands.append(text)
    return commands


@pytest.mark.parametrize("page", ["README.md", "docs/cli.md"])
def test_the_decodebench_commands_shown_take_the_flags_they_are_given(page: str) -> None:
    shown = _commands(ROOT / page)
    assert shown, f"{page} shows no decodebench command"
    wrong = []
    for line in shown:
        words = shlex.split(line)[1:]
        command: click.Command = cli
        while isinstance(command, click.Group) and words and words[0] in command.commands:
            command = command.commands[words.pop(0)]
        if command is cli:
            wrong.append(f"{line}: no such command")
            continue
        if command.name == "vllm":
            continue  # vLLM's own command line: every argument is vLLM's
        flags = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        flags |= {"-h", "--help"}
        for word in words:
            if word.startswith("--") and word.split("=", 1)[0] not in flags:
                wrong.append(f"{line}: {command.name} has no {word.split('=', 1)[0]}")
    assert not wrong, f"commands in {page} that do not work as written:\n" + "\n".join(wrong)
