"""Energy and clocks of a run's server while it is measured.

``EnergyMeter.for_server`` picks what can be read for a server: on a local GPU server its
GPUs through NVML (``pynvml``, as ``service.settings`` finds GPUs; never torch), on a local
CPU server the package counters of Linux powercap (``intel-rapl:N/energy_uj``). The meter
reads in a thread of its own, ``SAMPLE_EVERY_S`` apart, from ``start`` to ``stop`` (the
run's measurement), and ``result`` turns the readings into the run's ``energy`` block:

- GPU: ``energy_j`` from each GPU's total energy counter (the difference between the last
  and the first reading), or, where a GPU has no counter, the trapezoid integral of its
  power readings; ``j_per_output_token``, ``avg_power_w`` (energy over the time read),
  median SM and memory clocks (MHz), the hottest temperature, and every clock throttle
  reason seen. A reason other than "GPU idle" gives the run the warning ``gpu_throttled``
  (``energy_warnings``).
- CPU: ``energy_j`` from the counters' differences, counting a wrap past
  ``max_energy_range_uj`` (readings are far closer together than a wrap takes).

What cannot be read is ``{"available": false, "why": ...}``: no NVML or powercap, a counter
only root may read, a registered server (its GPUs are on another host), or a server on a Ray
node (the sampling would have to run beside it on that node; not done).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from service.control.handles import WorkerHandle

log = logging.getLogger(__name__)

# 20 readings a second: NVML's power reading is itself an average over a short window, and
# a throttle episode of a tenth of a second is still seen.
SAMPLE_EVERY_S = 0.05
POWERCAP_ROOT = Path("/sys/class/powercap")
# A package zone (``intel-rapl:0``); its subzones (``intel-rapl:0:0``, cores, uncore, dram)
# are inside the package's count and are left out.
PACKAGE_ZONE = re.compile(r"^intel-rapl:\d+$")

# NVML's clock throttle (clock event) reason bits and our names for them.
GPU_IDLE = 0x1
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

Reading = tuple[float, list[dict[str, Any]]]


class Unavailable(Exception):
    """Energy cannot be read for this server; the message says why."""


class Source(Protocol):
    """Something the meter reads: opened and closed in the meter's thread."""

    kind: str

    def open(self) -> None: ...

    def read(self) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...

    def summarize(self, readings: Sequence[Reading], output_tokens: int) -> dict[str, Any]: ...


def reason_names(mask: int) -> list[str]:
    """The names of the throttle reason bits set in ``mask`` (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASONS)
    if unknown:
        names.append(f"0x{unknown:x}")
    return names


class NvmlSource:
    """The server's GPUs through NVML; ``nvml`` is the pynvml module (a fake in tests)."""

    kind = "gpu"

    def __init__(self, gpu_ids: Sequence[str], nvml: ModuleType | None = None) -> None:
        self.gpu_ids = list(gpu_ids)
        self.nvml = nvml
        self.handles: list[Any] = []
        # Readings a GPU does not support (NVML raises NotSupported) are not asked again.
        self.unsupported: set[tuple[str, str]] = set()

    def open(self) -> None:
        if self.nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise Unavailable("nvidia-ml-py (pynvml) is not installed") from exc
            self.nvml = pynvml
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise Unavailable(f"NVML did not start: {exc}") from exc
        try:
            for gpu in self.gpu_ids:
                if gpu.isdigit():
                    self.handles.append(nvml.nvmlDeviceGetHandleByIndex(int(gpu)))
                else:  # CUDA_VISIBLE_DEVICES may name GPUs by UUID
                    self.handles.append(nvml.nvmlDeviceGetHandleByUUID(gpu))
        except nvml.NVMLError as exc:
            self.close()
            raise Unavailable(f"NVML has no GPU {gpu}: {exc}") from exc

    def _ask(self, gpu: str, what: str, call: Any, *args: Any) -> Any:
        if (gpu, what) in self.unsupported:
            return None
        assert self.nvml is not None
        try:
            return call(*args)
        except self.nvml.NVMLError:
            self.unsupported.add((gpu, what))
            return None

    def read(self) -> list[dict[str, Any]]:
        nvml = self.nvml
        assert nvml is not None
        # The newer name of the call; older nvidia-ml-py has only the throttle one.
        reasons_call = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                        or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        out = []
        for gpu, h in zip(self.gpu_ids, self.handles, strict=True):
            power_mw = self._ask(gpu, "power", nvml.nvmlDeviceGetPowerUsage, h)
            energy_mj = self._ask(gpu, "energy", nvml.nvmlDeviceGetTotalEnergyConsumption, h)
            out.append({
                "gpu": gpu,
                "power_w": power_mw / 1000 if power_mw is not None else None,
                "energy_j": energy_mj / 1000 if energy_mj is not None else None,
                "sm_mhz": self._ask(gpu, "sm", nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM),
                "mem_mhz": self._ask(gpu, "mem", nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_MEM),
                "temp_c": self._ask(gpu, "temp", nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU),
                "reasons": self._ask(gpu, "reasons", reasons_call, h),
            })
        return out

    def close(self) -> None:
        if self.nvml is None:
            return
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:
            log.debug("NVML shutdown failed: %s", exc)

    def summarize(self, readings: Sequence[Reading], output_tokens: int) -> dict[str, Any]:
        return summarize_gpu(readings, output_tokens)


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def summarize_gpu(readings: Sequence[Reading], output_tokens: int) -> dict[str, Any]:
    """The ``energy`` block of a run from NVML readings (see the module docstring)."""
    if len(readings) < 2:
        return {"available": False, "why": f"{len(readings)} reading(s) of the GPUs: the run was too short"}
    elapsed = readings[-1][0] - readings[0][0]
    by_gpu: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for t, values in readings:
        for v in values:
            by_gpu.setdefault(str(v["gpu"]), []).append((t, v))
    energy = 0.0
    how: set[str] = set()
    per_gpu: dict[str, float | None] = {}
    for gpu, rows in by_gpu.items():
        counter = [(t, v["energy_j"]) for t, v in rows if v["energy_j"] is not None]
        power = [(t, v["power_w"]) for t, v in rows if v["power_w"] is not None]
        if len(counter) >= 2:
            joules: float | None = counter[-1][1] - counter[0][1]
            how.add("energy counter")
        elif len(power) >= 2:
            ts = np.array([t for t, _ in power])
            ws = np.array([w for _, w in power])
            joules = float(np.sum((ws[1:] + ws[:-1]) / 2 * np.diff(ts)))
            how.add("power integrated")
        else:
            joules = None
        per_gpu[gpu] = joules
        energy += joules or 0.0
    if all(j is None for j in per_gpu.values()):
        return {"available": False, "why": "NVML gave neither an energy counter nor power readings"}
    rows_all = [v for _, values in readings for v in values]
    mask = 0
    for v in rows_all:
        mask |= int(v["reasons"] or 0)
    seen = reason_names(mask)
    return {
        "available": True,
        "source": "nvml",
        "how": " and ".join(sorted(how)),
        "gpus": list(by_gpu),
        "seconds": elapsed,
        "readings": len(readings),
        "energy_j": energy,
        "energy_j_per_gpu": per_gpu,
        "j_per_output_token": energy / output_tokens if output_tokens > 0 else None,
        "avg_power_w": energy / elapsed if elapsed > 0 else None,
        "median_sm_clock_mhz": _median([float(v["sm_mhz"]) for v in rows_all if v["sm_mhz"] is not None]),
        "median_mem_clock_mhz": _median([float(v["mem_mhz"]) for v in rows_all if v["mem_mhz"] is not None]),
        "max_temp_c": max((float(v["temp_c"]) for v in rows_all if v["temp_c"] is not None), default=None),
        "throttle_reasons": seen,
        "throttled": [name for name in seen if name != THROTTLE_REASONS[GPU_IDLE]],
    }


class PowercapSource:
    """The CPU packages' energy counters of Linux powercap under ``root``."""

    kind = "cpu"

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else POWERCAP_ROOT
        self.zones: list[Path] = []
        self.ranges: dict[str, int] = {}

    def open(self) -> None:
        if not self.root.is_dir():
            raise Unavailable(f"no Linux powercap here ({self.root} does not exist)")
        self.zones = sorted(p for p in self.root.iterdir() if PACKAGE_ZONE.match(p.name))
        if not self.zones:
            raise Unavailable(f"no RAPL package zone under {self.root}")
        for zone in self.zones:
            try:
                int((zone / "energy_uj").read_text())
                self.ranges[zone.name] = int((zone / "max_energy_range_uj").read_text())
            except PermissionError as exc:
                raise Unavailable(f"{zone / 'energy_uj'} is readable by root only") from exc
            except (OSError, ValueError) as exc:
                raise Unavailable(f"{zone / 'energy_uj'} could not be read: {exc}") from exc

    def read(self) -> list[dict[str, Any]]:
        out = []
        for zone in self.zones:
            try:
                out.append({"zone": zone.name, "energy_uj": int((zone / "energy_uj").read_text())})
            except (OSError, ValueError):
                continue  # one missed reading; the next difference spans it
        return out

    def close(self) -> None:
        return None

    def summarize(self, readings: Sequence[Reading], output_tokens: int) -> dict[str, Any]:
        return summarize_powercap(readings, self.ranges, output_tokens)


def summarize_powercap(readings: Sequence[Reading], ranges: dict[str, int],
                       output_tokens: int) -> dict[str, Any]:
    """The ``energy`` block of a run from powercap readings; ``ranges``: each zone's
    ``max_energy_range_uj``, where its counter wraps to 0."""
    if len(readings) < 2:
        return {"available": False, "why": f"{len(readings)} reading(s) of powercap: the run was too short"}
    last: dict[str, int] = {}
    total_uj = 0
    for _, values in readings:
        for v in values:
            zone, now = str(v["zone"]), int(v["energy_uj"])
            before = last.get(zone)
            if before is not None:
                step = now - before
                if step < 0:  # wrapped past its range
                    step += ranges.get(zone, 0) + 1
                total_uj += max(step, 0)
            last[zone] = now
    elapsed = readings[-1][0] - readings[0][0]
    energy = total_uj / 1e6
    return {
        "available": True,
        "source": "powercap",
        "how": "RAPL package energy counters (the whole CPU package, not the server alone)",
        "zones": sorted(last),
        "seconds": elapsed,
        "readings": len(readings),
        "energy_j": energy,
        "j_per_output_token": energy / output_tokens if output_tokens > 0 else None,
        "avg_power_w": energy / elapsed if elapsed > 0 else None,
    }


class EnergyMeter:
    """Reads one source in a thread from ``start`` to ``stop``; ``result`` is the run's
    ``energy`` block. A meter with no source only says why (``unavailable``)."""

    def __init__(self, source: Source | None, unavailable: str | None = None,
                 every_s: float = SAMPLE_EVERY_S) -> None:
        self.source = source
        self.why = unavailable
        self.every_s = every_s
        self.readings: list[Reading] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_server(cls, handle: WorkerHandle, powercap_root: Path | None = None) -> EnergyMeter:
        """What can be read of ``handle``'s server: here, or for a server on a Ray node,
        beside it on its node (the backend's meter, ``service.control.ray_servers``)."""
        if handle.backend == "ray":
            remote = getattr(handle.process, "energy_meter", None)
            if callable(remote):
                meter: EnergyMeter = remote()
                return meter
            return cls(None, "server on a Ray node that cannot be read beside it")
        if handle.external:
            return cls(None, "registered server: started elsewhere, its hardware is not this "
                       "machine's to read")
        return cls.on_this_host(handle.gpus, powercap_root)

    @classmethod
    def on_this_host(cls, gpu_ids: Sequence[str], powercap_root: Path | None = None) -> EnergyMeter:
        """A meter of this host's ``gpu_ids`` (NVML), or of its CPU packages without GPUs."""
        if gpu_ids:
            return cls(NvmlSource(gpu_ids))
        return cls(PowercapSource(powercap_root))

    def state(self) -> dict[str, Any]:
        """What was read, as plain data (to send from the node that read it): ``result_of``
        turns it into the run's ``energy`` block there or here."""
        return {"kind": getattr(self.source, "kind", None), "started": self._thread is not None,
                "why": self.why, "readings": list(self.readings),
                "ranges": dict(getattr(self.source, "ranges", {}) or {})}

    def start(self) -> None:
        """Start reading (a thread; returns at once)."""
        if self.source is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="energy-meter", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        source = self.source
        assert source is not None
        try:
            source.open()
        except Unavailable as exc:
            self.why = str(exc)
            return
        except Exception as exc:  # a reading is a record, never a reason to fail a run
            log.exception("energy meter could not start")
            self.why = f"could not start: {type(exc).__name__}: {exc}"
            return
        try:
            next_at = time.perf_counter()
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    self.readings.append((t, source.read()))
                except Exception as exc:
                    log.exception("energy reading failed")
                    self.why = f"reading failed: {type(exc).__name__}: {exc}"
                    return
                next_at += self.every_s
                self._stop.wait(max(0.0, next_at - time.perf_counter()))
            # One last reading at the stop, so the run's end is inside the readings.
            self.readings.append((time.perf_counter(), source.read()))
        except Exception as exc:
            log.exception("energy reading failed")
            self.why = f"reading failed: {type(exc).__name__}: {exc}"
        finally:
            source.close()

    def stop(self) -> None:
        """Stop reading and wait for the thread (at most one reading's time). Blocking: call
        it in a thread from the event loop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def result(self, output_tokens: int) -> dict[str, Any]:
        """The run's ``energy`` block (after ``stop``). CPU work: called in a thread."""
        return result_of(self.state(), output_tokens)


def result_of(state: dict[str, Any], output_tokens: int) -> dict[str, Any]:
    """The run's ``energy`` block from a meter's ``state`` (see ``EnergyMeter.result``)."""
    readings: list[Reading] = [(float(t), list(values)) for t, values in state.get("readings") or []]
    why = state.get("why")
    if state.get("kind") is None or (why is not None and len(readings) < 2):
        return {"available": False, "why": why or "nothing was read"}
    if not state.get("started"):
        return {"available": False, "why": "the meter was never started"}
    if state["kind"] == "gpu":
        return summarize_gpu(readings, output_tokens)
    return summarize_powercap(readings, {str(k): int(v) for k, v in (state.get("ranges") or {}).items()},
                              output_tokens)


def energy_warnings(energy: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``gpu_throttled`` when the GPUs' clocks were held back for a reason other than idling,
    as ``{code, message, figure}`` (``service.analysis.checks``'s shape)."""
    if not energy or not energy.get("throttled"):
        return []
    reasons = ", ".join(energy["throttled"])
    clock = energy.get("median_sm_clock_mhz")
    message = (f"the GPUs' clocks were throttled during the run ({reasons})"
               + (f"; median SM clock {clock:.0f} MHz" if isinstance(clock, float) else "")
               + ": decode speed may be below what the hardware gives when it is not held back")
    return [{"code": "gpu_throttled", "message": message, "figure": len(energy["throttled"])}]
