"""deploy/kuberay/ against the code and against what users rely on: every YAML document
read with PyYAML, no cluster needed. A renamed setting, a head Service name that no longer
follows the RayCluster's, or a dashboard opened beyond its pod fails here.
"""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from service.settings import Settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "deploy" / "kuberay"
PREFIX = Settings.model_config["env_prefix"]
LOOPBACK = {"127.0.0.1", "localhost"}
GCS_PORT, CLIENT_PORT = 6379, 10001  # `ray start --head`'s defaults, what KubeRay's head Service exposes

Docs = list[dict[str, Any]]


def _load(folder: Path = KUBERAY) -> Docs:
    """Every YAML document of every file in ``folder``."""
    files = sorted(folder.glob("*.yaml"))
    assert files, folder
    return [doc for path in files for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _one(docs: Docs, kind: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, (kind, len(found))
    return found[0]


def _service_container(docs: Docs) -> dict[str, Any]:
    containers = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, containers
    return dict(containers[0])


def _env(docs: Docs) -> dict[str, Any]:
    """The service container's environment: plain values as strings, the rest as given."""
    env = _service_container(docs)["env"]
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in env}


def _settings(docs: Docs) -> Settings:
    """The service's settings in its pod (unknown names fail: Settings forbids extra fields)."""
    plain = {k.removeprefix(PREFIX).lower(): v for k, v in _env(docs).items()
             if k.startswith(PREFIX) and isinstance(v, str)}
    return Settings(**plain, api_token="from-the-secret")


def _ray_pod_specs(docs: Docs) -> list[dict[str, Any]]:
    spec = _one(docs, "RayCluster")["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [group["template"]["spec"] for group in groups]


# What users rely on, one function each, so a broken copy can be run through the same check.


def check_kinds(docs: Docs) -> None:
    assert {doc["kind"] for doc in docs} == {"RayCluster", "PersistentVolumeClaim", "Deployment", "Service"}
    assert _one(docs, "RayCluster")["apiVersion"] == "ray.io/v1"


def check_dashboard_stays_in_its_pod(docs: Docs) -> None:
    head = _one(docs, "RayCluster")["spec"]["headGroupSpec"]
    params = {k: str(v) for k, v in head["rayStartParams"].items()}
    # KubeRay binds the dashboard to 0.0.0.0 when dashboard-host is not given.
    assert params.get("include-dashboard") == "false" or params.get("dashboard-host") in LOOPBACK, params
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"


def check_workers_ask_for_gpus(docs: Docs) -> None:
    groups = _one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    assert groups
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"].get("nvidia.com/gpu", 0)) >= 1, group["groupName"]


def check_env_names_are_settings(docs: Docs) -> None:
    names = [k.removeprefix(PREFIX).lower() for k in _env(docs) if k.startswith(PREFIX)]
    assert names and set(names) <= set(Settings.model_fields), sorted(set(names) - set(Settings.model_fields))
    _settings(docs)  # and their values are valid


def check_ray_address_is_the_head_service(docs: Docs) -> None:
    address = _settings(docs).ray_address
    assert address, "DECODEBENCH_RAY_ADDRESS is not set"
    head_service = f"{_one(docs, 'RayCluster')['metadata']['name']}-head-svc"  # KubeRay's name for it
    client = address.startswith("ray://")
    parts = urlsplit(address if client else f"//{address}")
    assert parts.hostname == head_service, (address, head_service)
    assert parts.port == (CLIENT_PORT if client else GCS_PORT), address
    ports = _one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    assert parts.port in {port["containerPort"] for port in ports}, ports
    if not client:  # a GCS address needs a raylet in the service's own pod, started before it
        args = " ".join(_service_container(docs)["args"])
        joins = r'ray start --address="\$DECODEBENCH_RAY_ADDRESS" .*&& exec python3 -m service$'
        assert re.match(joins, args), args


def check_control_url_is_the_services_own_service(docs: Docs) -> None:
    settings, service = _settings(docs), _one(docs, "Service")
    url = urlsplit(settings.control_base_url())
    host = url.hostname or ""
    assert host == service["metadata"]["name"] or host.startswith(service["metadata"]["name"] + "."), host
    (port,) = service["spec"]["ports"]
    assert url.port == port["port"], (url.port, port)
    # ... and the Service sends that port to the one the service listens on.
    (container_port,) = [p for p in _service_container(docs)["ports"] if p["name"] == port["targetPort"]]
    assert container_port["containerPort"] == settings.port
    labels = _one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def check_api_token_comes_from_a_secret(docs: Docs) -> None:
    token = _env(docs)[f"{PREFIX}API_TOKEN"]
    assert isinstance(token, dict) and set(token["secretKeyRef"]) >= {"name", "key"}, token
    assert not token["secretKeyRef"].get("optional", False)  # no token, no start: never a generated one


def check_service_is_cluster_ip(docs: Docs) -> None:
    for doc in docs:
        if doc["kind"] == "Service":
            assert doc["spec"].get("type") == "ClusterIP", doc["metadata"]["name"]


def check_one_image_everywhere(docs: Docs) -> None:
    images = {_service_container(docs)["image"]}
    images |= {container["image"] for spec in _ray_pod_specs(docs) for container in spec["containers"]}
    assert len(images) == 1, images


def check_data_dir_on_the_claim(docs: Docs) -> None:
    deployment = _one(docs, "Deployment")["spec"]
    claim = _one(docs, "PersistentVolumeClaim")["metadata"]["name"]
    volumes = {v["name"] for v in deployment["template"]["spec"]["volumes"]
               if v.get("persistentVolumeClaim", {}).get("claimName") == claim}
    mounts = [Path(m["mountPath"]) for m in _service_container(docs)["volumeMounts"] if m["name"] in volumes]
    assert any(_settings(docs).data_dir.is_relative_to(mount) for mount in mounts), mounts
    # One process owns the SQLite file: never two pods, not even for a rolling update.
    assert deployment["replicas"] == 1 and deployment["strategy"]["type"] == "Recreate"


def check_service_links_cannot_shadow_settings(docs: Docs) -> None:
    # Kubernetes gives every pod <NAME>_SERVICE_HOST, <NAME>_PORT, ... for each Service of
    # its namespace; a Service named `decodebench` would set DECODEBENCH_PORT=tcp://...
    shadowing = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"
                 and (d["metadata"]["name"].upper().replace("-", "_") + "_").startswith(PREFIX)]
    if shadowing:
        specs = [_one(docs, "Deployment")["spec"]["template"]["spec"], *_ray_pod_specs(docs)]
        assert all(spec.get("enableServiceLinks") is False for spec in specs), shadowing


CHECKS: list[Callable[[Docs], None]] = [
    check_kinds,
    check_dashboard_stays_in_its_pod,
    check_workers_ask_for_gpus,
    check_env_names_are_settings,
    check_ray_address_is_the_head_service,
    check_control_url_is_the_services_own_service,
    check_api_token_comes_from_a_secret,
    check_service_is_cluster_ip,
    check_one_image_everywhere,
    check_data_dir_on_the_claim,
    check_service_links_cannot_shadow_settings,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_manifests(check: Callable[[Docs], None]) -> None:
    check(_load())


@pytest.mark.parametrize("good, bad, check", [
    ('dashboard-host: "127.0.0.1"', 'dashboard-host: "0.0.0.0"', check_dashboard_stays_in_its_pod),
    ("limits: {nvidia.com/gpu: 8,", "limits: {", check_workers_ask_for_gpus),
    ("name: DECODEBENCH_RAY_ADDRESS,", "name: DECODEBENCH_RAY_ADRESS,", check_env_names_are_settings),
    ("name: decodebench-ray\n", "name: decodebench-cluster\n", check_ray_address_is_the_head_service),
    ('"http://decodebench:8000"', '"http://decodebench-svc:8000"',
     check_control_url_is_the_services_own_service),
    ("type: ClusterIP", "type: LoadBalancer", check_service_is_cluster_ip),
    ("image: decodebench:ray  # the Ray pods'", "image: decodebench:gpu  #", check_one_image_everywhere),
    ("enableServiceLinks: false\n      # On", "\n      # On", check_service_links_cannot_shadow_settings),
], ids=["dashboard", "gpus", "setting", "head-svc", "control-url", "cluster-ip", "image", "service-links"])
def test_a_broken_copy_is_caught(good: str, bad: str, check: Callable[[Docs], None], tmp_path: Path) -> None:
    changed = 0
    for path in KUBERAY.glob("*.yaml"):
        text = path.read_text()
        changed += text.count(good)
        (tmp_path / path.name).write_text(text.replace(good, bad))
    assert changed == 1, (good, changed)
    check(_load(KUBERAY))
    with pytest.raises(AssertionError):
        check(_load(tmp_path))


def test_readme_creates_the_secret_the_service_reads() -> None:
    ref = _env(_load())[f"{PREFIX}API_TOKEN"]["secretKeyRef"]
    readme = (KUBERAY / "README.md").read_text()
    command = rf"kubectl (-n \S+ )?create secret generic {ref['name']} --from-literal={ref['key']}="
    assert re.search(command, readme), command
