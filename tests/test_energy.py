"""Energy and clocks of a run's server: NVML faked with recorded values (as
``tests/test_gpu_ids.py`` fakes it), powercap faked with a directory of counters."""

from __future__ import annotations

import json
import time
import types
from pathlib import Path
from typing import Any

import pytest

from service.control.energy import (
    EnergyMeter,
    NvmlSource,
    PowercapSource,
    Unavailable,
    energy_warnings,
    reason_names,
    result_of,
    summarize_gpu,
    summarize_powercap,
)
from service.control.handles import WorkerHandle

pytestmark = pytest.mark.unit


class NVMLError(Exception):
    """Stands in for ``pynvml.NVMLError``."""


class FakeNVML(types.ModuleType):
    """A pynvml whose GPUs give recorded values, one row a read (the last one repeated)."""

    NVMLError = NVMLError
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, rows: dict[int, list[dict[str, Any]]]) -> None:
        super().__init__("pynvml")
        self.rows = rows
        self.reads: dict[int, int] = dict.fromkeys(rows, 0)
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i not in self.rows:
            raise NVMLError("Invalid Argument")
        return i

    def _row(self, h: int) -> dict[str, Any]:
        return self.rows[h][min(self.reads[h], len(self.rows[h]) - 1)]

    def _value(self, h: int, key: str) -> Any:
        value = self._row(h).get(key)
        if value is None:
            raise NVMLError("Not Supported")
        return value

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return int(self._value(h, "power_mw"))

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return int(self._value(h, "energy_mj"))

    def nvmlDeviceGetClockInfo(self, h: int, which: int) -> int:
        return int(self._value(h, "sm" if which == self.NVML_CLOCK_SM else "mem"))

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return int(self._value(h, "temp"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        # Asked last of a GPU's values: its next read gets the next recorded row.
        value = int(self._value(h, "reasons"))
        self.reads[h] += 1
        return value


def row(power_w: float, energy_j: float | None, sm: int = 1980, reasons: int = 0) -> dict[str, Any]:
    return {"power_mw": power_w * 1000, "energy_mj": None if energy_j is None else energy_j * 1000,
            "sm": sm, "mem": 2619, "temp": 60, "reasons": reasons}


def read_all(source: NvmlSource, times: list[float]) -> list[tuple[float, list[dict[str, Any]]]]:
    source.open()
    readings = [(t, source.read()) for t in times]
    source.close()
    return readings


def test_energy_comes_from_the_counter_and_clocks_are_medians() -> None:
    # GPU 0: counter 1000 J -> 1700 J over 2 s. GPU 1: no counter; power 300, 400, 500 W
    # at 0, 1, 2 s: trapezoids 350 + 450 = 800 J.
    fake = FakeNVML({0: [row(350, 1000), row(350, 1300, sm=1700), row(350, 1700, sm=1800)],
                     1: [row(300, None), row(400, None, sm=1900), row(500, None)]})
    readings = read_all(NvmlSource(["0", "1"], fake), [0.0, 1.0, 2.0])
    out = summarize_gpu(readings, output_tokens=1000)
    assert out["available"] is True
    assert out["energy_j_per_gpu"] == {"0": pytest.approx(700.0), "1": pytest.approx(800.0)}
    assert out["energy_j"] == pytest.approx(1500.0)
    assert out["how"] == "energy counter and power integrated"
    assert out["j_per_output_token"] == pytest.approx(1.5)
    assert out["avg_power_w"] == pytest.approx(750.0)
    # SM clocks 1980, 1700, 1800, 1980, 1900, 1980: median (1900 + 1980) / 2.
    assert out["median_sm_clock_mhz"] == pytest.approx(1940.0)
    assert out["median_mem_clock_mhz"] == 2619.0
    assert out["throttled"] == [] and energy_warnings(out) == []
    assert fake.calls == ["init", "shutdown"]


def test_a_throttle_reason_other_than_idle_warns() -> None:
    fake = FakeNVML({0: [row(700, 0, reasons=0x1), row(700, 700, reasons=0x4 | 0x20), row(700, 1400)]})
    out = summarize_gpu(read_all(NvmlSource(["0"], fake), [0.0, 1.0, 2.0]), output_tokens=0)
    assert out["throttle_reasons"] == ["gpu_idle", "sw_power_cap", "sw_thermal_slowdown"]
    assert out["throttled"] == ["sw_power_cap", "sw_thermal_slowdown"]
    assert out["j_per_output_token"] is None
    [warning] = energy_warnings(out)
    assert warning["code"] == "gpu_throttled" and "sw_power_cap" in warning["message"]
    assert warning["figure"] == 2
    # Idle alone is no warning.
    assert energy_warnings({"throttled": []}) == []
    assert reason_names(0x1 | 0x10000) == ["gpu_idle", "0x10000"]


def test_a_gpu_nvml_does_not_know_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="no GPU 7"):
        NvmlSource(["7"], FakeNVML({0: [row(1, 1)]})).open()


def rapl(root: Path, zones: dict[str, int], limit: int = 1000) -> None:
    for name, value in zones.items():
        zone = root / name
        zone.mkdir(parents=True, exist_ok=True)
        (zone / "energy_uj").write_text(f"{value}\n")
        (zone / "max_energy_range_uj").write_text(f"{limit}\n")


def test_powercap_counts_packages_only_and_across_a_wrap(tmp_path: Path) -> None:
    # Two packages and a subzone (inside package 0's count: left out).
    rapl(tmp_path, {"intel-rapl:0": 900, "intel-rapl:1": 100, "intel-rapl:0:0": 5})
    source = PowercapSource(tmp_path)
    source.open()
    first = source.read()
    assert [v["zone"] for v in first] == ["intel-rapl:0", "intel-rapl:1"]
    # Package 0 wraps past 1000: 900 -> 1000 -> 0 -> 50 is 151 uJ; package 1: 100 -> 400.
    rapl(tmp_path, {"intel-rapl:0": 50, "intel-rapl:1": 400})
    second = source.read()
    out = source.summarize([(0.0, first), (0.5, second)], output_tokens=2)
    assert out["energy_j"] == pytest.approx((151 + 300) / 1e6)
    assert out["avg_power_w"] == pytest.approx((151 + 300) / 1e6 / 0.5)
    assert out["j_per_output_token"] == pytest.approx((151 + 300) / 2e6)
    assert summarize_powercap([(0.0, first)], {}, 1)["available"] is False


def test_powercap_missing_or_root_only_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(Unavailable, match="does not exist"):
        PowercapSource(tmp_path / "nothing").open()
    rapl(tmp_path, {"intel-rapl:0": 1})
    read = Path.read_text

    def root_only(path: Path, *args: Any, **kwargs: Any) -> str:
        # As Linux has it since 5.10 for a user other than root (tests may run as root).
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return read(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", root_only)
    with pytest.raises(Unavailable, match="readable by root only"):
        PowercapSource(tmp_path).open()


def test_the_meter_reads_in_a_thread_at_ten_hertz_or_more(tmp_path: Path) -> None:
    rapl(tmp_path, {"intel-rapl:0": 10})
    meter = EnergyMeter(PowercapSource(tmp_path))
    meter.start()
    time.sleep(0.5)
    meter.stop()
    out = meter.result(10)
    assert out["available"] is True
    assert out["readings"] / out["seconds"] >= 10


def test_the_meter_without_a_source_says_why(tmp_path: Path) -> None:
    meter = EnergyMeter(PowercapSource(tmp_path / "none"))
    meter.start()
    meter.stop()
    assert meter.result(1) == {"available": False,
                               "why": f"no Linux powercap here ({tmp_path / 'none'} does not exist)"}


def handle(**fields: Any) -> WorkerHandle:
    return WorkerHandle(id="w-1", key="k", url="http://127.0.0.1:1", port=1, served_model="m",
                        process=None, log_path=Path("/dev/null"), **fields)


def test_which_source_a_server_gets(tmp_path: Path) -> None:
    # A Ray server's meter is its backend's, reading on its node (tests/test_ray_cluster.py);
    # a handle without one says so.
    ray = EnergyMeter.for_server(handle(backend="ray", node={"address": "10.0.0.2"}))
    assert ray.source is None and ray.result(1)["why"].startswith("server on a Ray node that cannot")
    registered = EnergyMeter.for_server(handle(backend="registered"))
    assert registered.result(1)["available"] is False
    gpu = EnergyMeter.for_server(handle(gpus=["0", "1"]))
    assert isinstance(gpu.source, NvmlSource) and gpu.source.gpu_ids == ["0", "1"]
    cpu = EnergyMeter.for_server(handle(), powercap_root=tmp_path)
    assert isinstance(cpu.source, PowercapSource) and cpu.source.root == tmp_path


def test_what_a_meter_read_travels_as_plain_data(tmp_path: Path) -> None:
    # A node's meter sends its state back; the block made from it here is the node's own.
    rapl(tmp_path, {"intel-rapl:0": 10})
    meter = EnergyMeter(PowercapSource(tmp_path))
    meter.start()
    time.sleep(0.3)
    rapl(tmp_path, {"intel-rapl:0": 5000})
    time.sleep(0.2)
    meter.stop()
    state = json.loads(json.dumps(meter.state()))
    assert result_of(state, 4) == meter.result(4)
    assert result_of(state, 4)["energy_j"] == pytest.approx((5000 - 10) / 1e6)
    never = EnergyMeter(PowercapSource(tmp_path))
    assert result_of(never.state(), 1) == {"available": False, "why": "the meter was never started"}
