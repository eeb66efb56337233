"""Which GPUs the service may hand out, and how a worker is told which ones it got.

NVML is faked: a small module put in ``sys.modules["pynvml"]`` where the settings import
it. The worker is the stub server, started through a wrapper that writes down its env.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import types
from pathlib import Path

import pytest

from service.settings import Settings
from tests.conftest import STUB_COMMAND, make_client, wait_finished


class NVMLError(Exception):
    """Stands in for ``pynvml.NVMLError``."""


class LibraryNotFound(NVMLError):
    """What nvmlInit raises when libnvidia-ml.so.1 is not there (a CPU machine)."""


class FakeNVML(types.ModuleType):
    """A pynvml that sees ``count`` GPUs, or fails where told to; it records its calls."""

    NVMLError = NVMLError

    def __init__(
        self, count: int = 0, init_error: NVMLError | None = None,
        count_error: NVMLError | None = None,
    ) -> None:
        super().__init__("pynvml")
        self.count = count
        self.init_error = init_error
        self.count_error = count_error
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise self.init_error

    def nvmlDeviceGetCount(self) -> int:
        self.calls.append("count")
        if self.count_error is not None:
            raise self.count_error
        return self.count

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture(autouse=True)
def _no_gpu_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DECODEBENCH_GPUS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)


def _nvml(monkeypatch: pytest.MonkeyPatch, fake: FakeNVML) -> FakeNVML:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def _settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "var")


def test_with_nothing_set_the_ids_are_nvml_indices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = _nvml(monkeypatch, FakeNVML(count=3))
    assert _settings(tmp_path).gpu_ids() == ["0", "1", "2"]
    assert nvml.calls == ["init", "count", "shutdown"]


def test_nvml_is_asked_once_per_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = _nvml(monkeypatch, FakeNVML(count=2))
    settings = _settings(tmp_path)
    first = settings.gpu_ids()
    first.clear()  # a caller's copy: the settings keep theirs
    assert settings.gpu_ids() == ["0", "1"]
    assert nvml.calls.count("init") == 1


def test_decodebench_gpus_wins_over_cuda_visible_devices_and_nvml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = _nvml(monkeypatch, FakeNVML(count=4))
    monkeypatch.setenv("DECODEBENCH_GPUS", " 1, 3 ")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert _settings(tmp_path).gpu_ids() == ["1", "3"]
    assert nvml.calls == []


def test_empty_decodebench_gpus_means_no_gpus_on_a_gpu_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = _nvml(monkeypatch, FakeNVML(count=4))
    monkeypatch.setenv("DECODEBENCH_GPUS", "")
    assert _settings(tmp_path).gpu_ids() == []
    assert nvml.calls == []


def test_the_services_cuda_visible_devices_entries_are_handed_out_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = _nvml(monkeypatch, FakeNVML(count=8))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5e1f0c2a,6")
    assert _settings(tmp_path).gpu_ids() == ["GPU-5e1f0c2a", "6"]
    assert nvml.calls == []


def test_no_nvidia_library_means_no_gpus_said_once_at_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _nvml(monkeypatch, FakeNVML(init_error=LibraryNotFound("NVML Shared Library Not Found")))
    caplog.set_level(logging.DEBUG, logger="service.settings")
    settings = _settings(tmp_path)
    assert settings.gpu_ids() == []
    assert settings.gpu_ids() == []
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [(logging.INFO, "no GPUs: NVML did not start (NVML Shared Library Not Found)")]


def test_a_failed_count_means_no_gpus_and_nvml_is_shut_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = _nvml(monkeypatch, FakeNVML(count=2, count_error=NVMLError("GPU is lost")))
    assert _settings(tmp_path).gpu_ids() == []
    assert nvml.calls == ["init", "count", "shutdown"]


def test_no_nvidia_ml_py_means_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert _settings(tmp_path).gpu_ids() == []


# Writes the env the worker starts with, then becomes the stub server (same pid).
RECORD_ENV = """
import json, os, sys
with open(sys.argv[1], "w") as f:
    json.dump({k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}, f)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


@pytest.mark.parametrize(
    ("service_order", "worker_order"),
    [(None, "PCI_BUS_ID"), ("FASTEST_FIRST", "FASTEST_FIRST")],
)
def test_a_worker_numbers_its_gpus_in_nvml_order_unless_the_site_chose_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    service_order: str | None, worker_order: str,
) -> None:
    if service_order is not None:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", service_order)
    wrapper, seen = tmp_path / "record_env.py", tmp_path / "worker-env.json"
    wrapper.write_text(RECORD_ENV)
    stub = shlex.split(STUB_COMMAND)[1]
    command = shlex.join([sys.executable, str(wrapper), str(seen), stub])
    with make_client(tmp_path, gpus="1", vllm_command=command) as client:
        run = client.post("/api/runs", json={"input_len": 8, "output_len": 4, "num_prompts": 1})
        done = wait_finished(client, run.json()["id"], timeout=60)
        assert done["status"] == "succeeded", done["error"]
    assert json.loads(seen.read_text()) == {
        "CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": worker_order,
    }
