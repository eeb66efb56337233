"""A run's provenance record: the setup its numbers came from, as stored with the run.

``snapshot`` joins three sources when a run gets its worker: the service's own facts
(``service.control.provenance.service_facts``), the worker as the service started it
(``service.control.provenance.launch``, stored on the worker row) and the worker as its
connector reported it (``connector.provenance``). The run adds its own: mode and fill
values, dummy or real weights, the KV cache capacity. The vLLM export carries the
headline facts as top-level string keys (as ``vllm bench serve --metadata KEY=VALUE``
writes them) and the whole record in its ``decodebench`` block (``export_keys``).
Pure functions of plain records: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.core.mode import Mode

FILLED = ("filled: decodebench's KV connector wrote the prompts' KV cache (fill_mean={mean:g}, "
          "fill_std={std:g}) instead of computing a prefill; TTFT and throughputs include no "
          "real prefill and are not comparable with a vllm bench serve run that prefilled")
PREFILLED = "real: vLLM computed every prompt's prefill (decodebench mode prefill)"
SEEDED = ("real: vLLM prefilled every prompt once in an unmeasured seeding pass and the measured "
          "requests found it in its prefix cache (decodebench mode seeded)")



def snapshot(
    worker: Mapping[str, Any] | None,
    spec: Mapping[str, Any],
    load_format: str,
    kv_tokens: int | None,
    facts: Mapping[str, Any],
) -> dict[str, Any]:
    """A run's provenance: the service's facts, its worker's (``worker``: the worker row's
    ``id``, ``external``, ``gpus``, ``cpu_binding`` and ``provenance``), and its own."""
    worker = worker or {}
    stored = worker.get("provenance") or {}
    reported = stored.get("reported")
    started = stored.get("launch") or {}
    fill = spec.get("fill") or {}
    mode = Mode.of(spec)
    engine = (reported or {}).get("engine") or {}
    kv = (reported or {}).get("kv_cache") or {}
    return {
        "decodebench": dict(facts),
        "mode": mode,
        "fill": ({"mean": fill.get("mean"), "std": fill.get("std"), "startup": bool(fill.get("startup"))}
                 if mode.fills else None),
        "prefill": prefill_note(spec),
        # Speculative decoding as the run asked vLLM for it (synthetic acceptance included).
        "speculative": (spec.get("engine") or {}).get("speculative"),
        "load_format": load_format,
        "weights": "dummy (random values)" if load_format == "dummy" else "real",
        "kv_cache_tokens": kv_tokens if kv_tokens is not None else kv.get("tokens"),
        "worker": {
            "id": worker.get("id"),
            "external": worker.get("external"),
            "gpus": worker.get("gpus") or None,
            # As the service started it; a registered server's as its connector saw it.
            "argv": started.get("argv") or (reported or {}).get("argv"),
            "env": started.get("env") or (reported or {}).get("env"),
            "cpu_binding": worker.get("cpu_binding"),
            # Where it ran: "local", "registered" or "ray", and the Ray node.
            "backend": worker.get("backend"),
            "node": worker.get("node"),
        },
        "reported": reported is not None,
        "versions": (reported or {}).get("versions"),
        "engine": engine or None,
        "kv_cache": kv or None,
        # Each KV cache group and how the connector fills it (at start, per request, zeroed).
        "kv_cache_groups": (reported or {}).get("kv_cache_groups") or None,
        "hardware": (reported or {}).get("hardware"),
        # Model and KV sizes with the device's memory bandwidth (``service.analysis.roofline``).
        "roofline": (reported or {}).get("roofline"),
    }


def hardware_line(hardware: Mapping[str, Any] | None) -> str | None:
    """The hardware in a line: the GPUs when there are any, else the CPU and its cores."""
    if not hardware:
        return None
    gpus = hardware.get("gpus") or []
    if gpus:
        names: dict[str, int] = {}
        for gpu in gpus:
            memory = gpu.get("memory_bytes")
            label = str(gpu.get("name") or "unknown GPU")
            if isinstance(memory, int):
                label += f" ({memory / 2**30:.0f} GiB)"
            names[label] = names.get(label, 0) + 1
        return ", ".join(f"{n}x {label}" for label, n in names.items())
    cores = hardware.get("cpu_cores_usable") or hardware.get("cpu_cores")
    return f"CPU {hardware.get('cpu_model') or 'unknown'} ({cores} cores)"


# Resolved engine settings copied to the export's top level, by vLLM's flag names.
EXPORT_ENGINE_KEYS = ("dtype", "max_model_len", "tensor_parallel_size", "gpu_memory_utilization",
                      "kv_cache_memory_bytes",
                      "kv_cache_dtype", "block_size", "enforce_eager", "enable_prefix_caching",
                      "enable_chunked_prefill", "max_num_seqs", "max_num_batched_tokens",
                      "load_format")


def prefill_note(spec: Mapping[str, Any]) -> str:
    """How the run's prompts got their KV cache, in words a reader of the numbers needs."""
    mode = Mode.of(spec)
    if mode.seeds:
        return SEEDED
    if not mode.fills:
        return PREFILLED
    fill = spec.get("fill") or {}
    return FILLED.format(mean=fill.get("mean", 0.0), std=fill.get("std", 0.0))


def export_keys(provenance: Mapping[str, Any] | None, spec: Mapping[str, Any]) -> dict[str, str]:
    """Top-level keys of the vLLM export, strings like ``--metadata KEY=VALUE`` gives, so
    vLLM's own tools read them as they read their metadata. How the KV cache was made is
    always said, also for runs recorded before provenance was."""
    out: dict[str, str] = {"decodebench_mode": str(spec.get("mode", "fill")),
                           "kv_prefill": prefill_note(spec)}
    if not provenance:
        return out
    facts = provenance.get("decodebench") or {}
    versions = provenance.get("versions") or {}
    for key, value in (("decodebench_version", facts.get("version")),
                       ("decodebench_commit", facts.get("commit")),
                       ("vllm_version", versions.get("vllm")),
                       ("torch_version", versions.get("torch")),
                       ("hardware", hardware_line(provenance.get("hardware"))),
                       ("kv_cache_tokens", provenance.get("kv_cache_tokens")),
                       ("weights", provenance.get("weights"))):
        if value is not None:
            out[key] = str(value)
    engine = provenance.get("engine") or {}
    for key in EXPORT_ENGINE_KEYS:
        if engine.get(key) is not None:
            out[key] = str(engine[key])
    return out
