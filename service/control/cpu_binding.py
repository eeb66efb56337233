"""Where a vLLM CPU worker's threads run: the same layout for every worker this service starts.

vLLM CPU binds each worker rank's OpenMP threads to a list of cores and leaves
some cores "reserved" for everything else (the EngineCore's busy loop, the API
server, and here also the load driver). How many it reserves depends on what the
server loads (vLLM 0.32, ``vllm/utils/ompmultiprocessing.py``,
``OMPProcessManager.__init__``): one core per local rank on x86, ARM and RISC-V,
and one more per local rank whenever *any* ``--kv-transfer-config`` is given
(meant for NIXL's transfer threads). Left alone, a server with our connector is
therefore a different engine from the real-prefill reference without one:

- on a 2-core machine vLLM then has nothing left to reserve
  (``_get_autobind_cpu_ids``: "Selected CPU core number (2) should be greater than
  reserved CPU core number (2)") and binds the worker's OpenMP threads to both
  cores, one of them shared with the EngineCore and the client; every parallel
  region waits for a thread that must win time on an oversubscribed core, and
  decode measured 2-3x slower (``benchmarks/README.md``, fidelity);
- on a bigger machine the connector run silently gets one OpenMP core per rank
  fewer than the reference.

So the service sets ``VLLM_CPU_NUM_OF_RESERVED_CPU`` to what vLLM reserves for a
server *without* a connector, and ``VLLM_CPU_OMP_THREADS_BIND`` to vLLM's own
automatic binding, explicitly, for fill and prefill runs alike; the benchmarks
start their reference servers with the same values. An operator who sets either
variable in the service's environment keeps theirs (for example an explicit core
list on a shared host); the worker records what it ran with either way.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Mapping

RESERVED_VAR = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"
BINDING_VARS = (RESERVED_VAR, BIND_VAR)
# Architectures on which vLLM reserves one core per local rank (others: one in all).
_PER_RANK_ARCHES = ("x86_64", "amd64", "i386", "i686", "aarch64", "arm64", "riscv64")

_RANK_CORES = re.compile(r"local_rank=(\d+), core ids=\[([\d, ]*)\]")
_RESERVED_CORES = re.compile(r"reserved_cpus=\[([\d, ]*)\]")


def reserved_without_connector(local_world_size: int, machine: str | None = None) -> int:
    """Cores vLLM CPU reserves for a server that loads no KV connector."""
    arch = (machine or platform.machine()).lower()
    return local_world_size if arch in _PER_RANK_ARCHES else 1


def binding_env(
    tensor_parallel_size: int, environ: Mapping[str, str], machine: str | None = None
) -> dict[str, str]:
    """The binding variables a CPU worker is started with: the operator's where set,
    else the layout vLLM gives a server without a connector."""
    chosen = {
        RESERVED_VAR: str(reserved_without_connector(tensor_parallel_size, machine)),
        BIND_VAR: "auto",
    }
    for name in BINDING_VARS:
        if environ.get(name):
            chosen[name] = environ[name]
    return chosen


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def parse_binding_log(text: str) -> dict[str, list[int] | dict[str, list[int]]] | None:
    """The cores vLLM says it bound each rank's OpenMP threads to, and those it reserved,
    from its "OpenMP thread binding info" log lines; None if the log does not say."""
    ranks = {rank: _ids(cores) for rank, cores in _RANK_CORES.findall(text)}
    reserved = _RESERVED_CORES.findall(text)
    if not ranks and not reserved:
        return None
    return {"omp_cores": ranks, "reserved_cores": _ids(reserved[-1]) if reserved else []}
