"""Why a vLLM server could not start, read from its log: the exception its engine raised,
and what to change in the run's spec.

vLLM prints the root cause once, in the traceback of the process that failed (a worker or
the EngineCore), and then wraps it as the failure climbs to the API server: the EngineCore's
``RuntimeError: Worker failed with error '...'``, the API server's ``RuntimeError: Engine
core initialization failed. See root cause above.``. The last lines of the log hold only
the wrappers; the root cause is the first exception after the first sign of failure.

The messages matched here are vLLM 0.32's (``vllm/v1/core/kv_cache_utils.py``,
``vllm/v1/worker/cpu_worker.py``, ``vllm/v1/worker/utils.py``, ``vllm/v1/engine/``,
``vllm/v1/executor/multiproc_executor.py``); ``tests/test_startup_errors.py`` holds real
excerpts. Pure functions: no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

# What a vLLM server logs once its engine has failed to start: the server will never
# become healthy, whether or not its API server exits (it can hang on a dead engine).
ENGINE_FAILED = (
    "EngineCore failed to start",  # the EngineCore's logger.exception
    "WorkerProc failed to start",  # a worker's logger.exception
    "WorkerProc hit an exception",  # a worker's, for a call that failed (while starting: fatal)
    "Worker failed with error",  # the EngineCore's RuntimeError for a failed worker call
    "Engine core initialization failed",  # the API server's RuntimeError
    "Frontend process failed during engine core initialization",
    "died unexpectedly (exit code",  # "Worker proc %s died unexpectedly (exit code: %s)"
)

# Exceptions that only carry another's failure along: never the root cause while another is found.
_WRAPPERS = ("Engine core initialization failed", "Worker failed with error",
             "Frontend process failed during engine core initialization",
             "WorkerProc initialization failed due to an exception in a background process")
_NOT_CAUSES = ("KeyboardInterrupt", "SystemExit", "EngineDeadError")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# vLLM's log prefix: "(EngineCore pid=8331) ERROR 11-26 13:44:37 [core.py:1510] ", the
# process part on every line (a multi-line message, a traceback, repeats it on each).
_PROCESS = re.compile(r"^\S*\([^()\s]+ pid=\d+\) ?")
_LEVEL = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] ?")
# A traceback's last line: "ValueError: ...", "torch.OutOfMemoryError: ...".
_EXCEPTION = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit))"
                        r"(?::\s(?P<message>.*))?$")


class RootCause(NamedTuple):
    """The exception that stopped a server's start, and what to change (None: no advice)."""

    line: str
    advice: str | None


def engine_failed(log_text: str) -> bool:
    """True if the log says the server's engine failed to start."""
    return any(marker in log_text for marker in ENGINE_FAILED)


def root_cause(log_text: str) -> RootCause | None:
    """The root cause of a failed start in a vLLM server's log, with decodebench's advice
    where it knows one; None if the log shows no exception."""
    lines = [_message(line) for line in log_text.splitlines()]
    # Exceptions before the first sign of failure were survived (an optional import's); a
    # log without one (the API server raised before its engine started) is read whole.
    start = next((i for i, line in enumerate(lines) if engine_failed(line)), 0)
    found = [line for line in lines[start:] if _EXCEPTION.match(line)]
    causes = [line for line in found if not is_wrapper(line)]
    for line in causes:
        advice = _advice(line)
        if advice is not None:
            return RootCause(line, advice)
    if causes:
        return RootCause(causes[0], None)
    if found:
        return RootCause(found[0], _advice(found[0]))
    return None


def _message(line: str) -> str:
    line = _ANSI.sub("", line).strip("\r\n ")
    return _LEVEL.sub("", _PROCESS.sub("", line)).strip()


def is_wrapper(line: str) -> bool:
    """True for an exception line that only carries another's failure along (or is none)."""
    match = _EXCEPTION.match(line)
    if match is None:
        return True
    message = match["message"] or ""
    return match["type"].rsplit(".", 1)[-1] in _NOT_CAUSES or message.startswith(_WRAPPERS)


def failure_message(what: str, log_text: str, tail: str) -> str:
    """A failed start as the user reads it: the root cause and what to change first, then
    what happened to the server and the last lines of its log."""
    cause = root_cause(log_text)
    head = [] if cause is None else [cause.line] + ([f"Fix: {cause.advice}."] if cause.advice else [])
    return "\n".join([*head, f"{what}; last log lines:", tail])


def _floor2(x: float) -> str:
    return f"{math.floor(x * 100) / 100:.2f}"


def _ceil2(x: float) -> str:
    return f"{math.ceil(x * 100) / 100:.2f}"


def _max_len(m: re.Match[str]) -> str:
    if m["estimate"]:
        return (f"set engine.max_model_len to at most {m['estimate']}, "
                "or raise engine.gpu_memory_utilization")
    return (f"lower engine.max_model_len (the model's {m['asked']} tokens do not fit), "
            "or raise engine.gpu_memory_utilization")


def _no_room(_: re.Match[str]) -> str:
    return ("raise engine.gpu_memory_utilization: at this fraction the model leaves no memory "
            "for the KV cache (on a CPU it is the fraction of the host's memory vLLM takes)")


def _cpu_startup(m: re.Match[str]) -> str:
    free, total = float(m["free"]), float(m["total"])
    return (f"set engine.gpu_memory_utilization to at most {_floor2(free / total)} "
            f"({m['free']} of the node's {m['total']} GiB are free), "
            "or stop what else uses the host's memory")


def _cpu_kv(m: re.Match[str]) -> str:
    # vLLM grants the KV cache the fraction's share of the node (``granted``) less what
    # the worker already holds (the model): what is left is ``kv``.
    free, total = float(m["free"]), float(m["total"])
    kv, granted = float(m["kv"]), float(m["granted"])
    held = granted - kv
    if kv <= 0:
        # A share just above the model's would leave the KV cache empty: name the cache's
        # own size instead, which vLLM then takes from the memory free beside the model.
        return (f"set engine.kv_cache_gib to the KV cache the runs need, at most {m['free']} GiB "
                f"(free beside the model, which alone holds {held:.2f} GiB of the {m['granted']} "
                f"GiB the fraction grants); or set engine.gpu_memory_utilization to the model's "
                f"{held:.2f} GiB plus that cache, over the node's {m['total']} GiB, at most "
                f"{_floor2(min(1.0, (free + held) / total))}")
    return (f"set engine.gpu_memory_utilization to at most {_floor2((free + held) / total)} "
            f"({m['free']} of the node's {m['total']} GiB are free and the model holds "
            f"{held:.2f} GiB), or stop what else uses the host's memory")


def _cpu_kv_space(m: re.Match[str]) -> str:
    return (f"lower VLLM_CPU_KVCACHE_SPACE in the service's environment below {m['free']} GiB "
            "(the memory free on the node), or stop what else uses the host's memory")


def _gpu_startup(m: re.Match[str]) -> str:
    free, total = float(m["free"]), float(m["total"])
    return (f"set engine.gpu_memory_utilization to at most {_floor2(free / total)} "
            f"({m['free']} of the GPU's {m['total']} GiB are free), "
            "or stop what else uses the GPU")


_GIB = r"(?P<free>[\d.]+)/(?P<total>[\d.]+) GiB"
# (message pattern, advice), first match wins.
_ADVICE: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    (re.compile(r"the model's max seq len \((?P<asked>\d+)\).*?"
                r"(?:estimated maximum model length is (?P<estimate>\d+))?\. Try"), _max_len),
    (re.compile(r"No available memory for the cache blocks"), _no_room),
    (re.compile(rf"Available memory on node \d+ \({_GIB}\) on startup is less than desired CPU"),
     _cpu_startup),
    (re.compile(rf"Available memory on node \d+ \({_GIB}\) on kv cache allocation is less than "
                r"requested memory for kv \((?P<kv>-?[\d.]+)/(?P<granted>[\d.]+) GiB\)"), _cpu_kv),
    (re.compile(rf"Available memory on node \d+ \({_GIB}\) on kv cache allocation is less than "
                r"requested memory for kv \([\d.]+ GiB\)"), _cpu_kv_space),
    (re.compile(rf"Free memory on device \S+ \({_GIB}\) on startup is less than desired GPU"), _gpu_startup),
)


def _advice(line: str) -> str | None:
    for pattern, advise in _ADVICE:
        m = pattern.search(line)
        if m is not None:
            return advise(m)
    return None


# What a starting vLLM server is doing, from the lines its log writes at each step (vLLM
# 0.32), in the order they come: the furthest phase a line has named is where it is.
PHASES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"non-default args|Resolved architecture"), "reading its model's config"),
    (re.compile(r"Initializing a V1 LLM engine"), "starting its engine"),
    (re.compile(r"Starting to load model|Loading weights|Loading safetensors|Loading model weights"),
     "loading weights"),
    (re.compile(r"Available KV cache memory|for KV cache|KV cache size|Memory profiling"),
     "sizing its KV cache"),
    (re.compile(r"Capturing CUDA graph|Compiling a graph|Dynamo bytecode transform"),
     "compiling and capturing graphs"),
    (re.compile(r"init engine \(.*\) took|Supported tasks"), "engine ready, starting its API server"),
    (re.compile(r"Starting vLLM (API )?server on|Application startup complete"), "starting its API server"),
)


def startup_phase(lines: Iterable[str], current: str | None = None) -> str | None:
    """The furthest phase (``PHASES``) a starting server's log lines name, or ``current``
    when they name none further."""
    names = [name for _, name in PHASES]
    reached = names.index(current) if current in names else -1
    for line in lines:
        for rank in range(len(PHASES) - 1, reached, -1):
            if PHASES[rank][0].search(line):
                reached = rank
                break
    return names[reached] if reached >= 0 else current


def clock(seconds: float) -> str:
    """A start's elapsed time as people say it: ``45s``, ``1m20s``, ``1h02m``."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole // 60 % 60:02d}m"
