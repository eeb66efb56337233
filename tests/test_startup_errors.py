"""Why a vLLM server could not start, as its run's error says it: the root cause from the
server's log (not the wrappers at its end) and what to change.

The files in ``tests/data/vllm_start_failures`` are the logs of real vLLM 0.32 CPU servers
(the bundled tiny model) that failed to start, from the line after vLLM's banner on;
``engine_failed_server_hangs.log`` stops where the engine had failed and its API server
had not yet given up (it can wait minutes, or for ever). The one-line cases are messages
of the same vLLM source with the figures of a user's trial."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.control.startup_errors import (
    ENGINE_FAILED,
    engine_failed,
    failure_message,
    root_cause,
)

pytestmark = pytest.mark.unit

LOGS = Path(__file__).resolve().parent / "data" / "vllm_start_failures"
ENGINE = "(EngineCore pid=4242) ERROR 11-20 09:12:03 [core.py:1510] "
WORKER = "(Worker pid=4300) ERROR 11-20 09:12:03 [multiproc_executor.py:1063] "
WRAPPED = ("RuntimeError: Engine core initialization failed. See root cause above. "
           "Failed core proc(s): {'EngineCore': 1}")


@pytest.mark.parametrize(("name", "line", "advice"), [
    ("max_model_len.log",
     "ValueError: To serve at least one request with the model's max seq len (131072), (0.12 GiB KV "
     "cache is needed, which is larger than the available KV cache memory (0.09 GiB). Based on the "
     "available memory, the estimated maximum model length is 97408. Try increasing",
     "set engine.max_model_len to at most 97408, or raise engine.gpu_memory_utilization"),
    ("no_kv_cache_memory.log",
     "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
     "raise engine.gpu_memory_utilization: at this fraction the model leaves no memory for the KV "
     "cache (on a CPU it is the fraction of the host's memory vLLM takes)"),
    ("kv_cache_space.log",
     "ValueError: Available memory on node 0 (9.46/12.71 GiB) on kv cache allocation is less than "
     "requested memory for kv (93132.26 GiB). Decrease --kv-cache-memory-bytes",
     "lower VLLM_CPU_KVCACHE_SPACE in the service's environment below 9.46 GiB (the memory free on "
     "the node), or stop what else uses the host's memory"),
    ("engine_failed_server_hangs.log",
     "ValueError: Available memory on node 0 (9.46/12.71 GiB) on kv cache allocation is less than "
     "requested memory for kv (93132.26 GiB).",
     "lower VLLM_CPU_KVCACHE_SPACE in the service's environment below 9.46 GiB (the memory free on "
     "the node), or stop what else uses the host's memory"),
    ("cpu_memory_at_start.log",
     "ValueError: Available memory on node 0 (10.07/12.71 GiB) on startup is less than desired CPU "
     "memory utilization (0.99, 12.59 GiB).",
     "set engine.gpu_memory_utilization to at most 0.79 (10.07 of the node's 12.71 GiB are free), "
     "or stop what else uses the host's memory"),
])
def test_the_root_cause_of_a_real_failed_start_is_found_above_the_wrappers(
        name: str, line: str, advice: str) -> None:
    text = (LOGS / name).read_text()
    # What a log tail of 40 lines showed: only vLLM's wrappers of the cause.
    tail = "\n".join(text.splitlines()[-40:])
    assert line not in tail or name == "engine_failed_server_hangs.log"
    assert engine_failed(text)
    cause = root_cause(text)
    assert cause is not None
    assert cause.line.startswith(line), cause.line
    assert "pid=" not in cause.line and "[core.py" not in cause.line  # vLLM's prefix is gone
    assert cause.advice == advice


@pytest.mark.parametrize(("line", "advice"), [
    # The user's trial: a max model len that does not fit.
    ("ValueError: To serve at least one request with the model's max seq len (131072), (5.62 GiB KV "
     "cache is needed, which is larger than the available KV cache memory (5.25 GiB). Based on the "
     "available memory, the estimated maximum model length is 122368. Try increasing "
     "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing "
     "`max_model_len` when initializing the engine. See "
     "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
     "set engine.max_model_len to at most 122368, or raise engine.gpu_memory_utilization"),
    # vLLM estimates 0 when not even one block fits: no "Based on ..." then.
    ("ValueError: To serve at least one request with the model's max seq len (131072), (5.62 GiB KV "
     "cache is needed, which is larger than the available KV cache memory (0.01 GiB). Try increasing "
     "`gpu_memory_utilization`.",
     "lower engine.max_model_len (the model's 131072 tokens do not fit), or raise "
     "engine.gpu_memory_utilization"),
    # The user's trial: the host's memory taken by others between start and KV allocation.
    ("ValueError: Available memory on node 0 (7.46/23.54 GiB) on kv cache allocation is less than "
     "requested memory for kv (8.94/10.59 GiB). Reduce CPU memory used by other processes.",
     "set engine.gpu_memory_utilization to at most 0.38 (7.46 of the node's 23.54 GiB are free and "
     "the model holds 1.65 GiB), or stop what else uses the host's memory"),
    # The model alone holds more than the fraction grants: nothing is left for the KV cache.
    ("ValueError: Available memory on node 0 (20.10/23.54 GiB) on kv cache allocation is less than "
     "requested memory for kv (-0.42/3.53 GiB). Reduce CPU memory used by other processes.",
     "set engine.kv_cache_gib to the KV cache the runs need, at most 20.10 GiB (free beside the "
     "model, which alone holds 3.95 GiB of the 3.53 GiB the fraction grants); or set "
     "engine.gpu_memory_utilization to the model's 3.95 GiB plus that cache, over the node's 23.54 "
     "GiB, at most 1.00"),
    ("ValueError: Available memory on node 0 (2.82/23.54 GiB) on kv cache allocation is less than "
     "requested memory for kv (-0.03/9.42 GiB). Reduce CPU memory used by other processes.",
     "set engine.kv_cache_gib to the KV cache the runs need, at most 2.82 GiB (free beside the "
     "model, which alone holds 9.45 GiB of the 9.42 GiB the fraction grants); or set "
     "engine.gpu_memory_utilization to the model's 9.45 GiB plus that cache, over the node's 23.54 "
     "GiB, at most 0.52"),
    ("ValueError: Free memory on device cuda:0 (20.1/79.19 GiB) on startup is less than desired GPU "
     "memory utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU memory "
     "used by other processes.",
     "set engine.gpu_memory_utilization to at most 0.25 (20.1 of the GPU's 79.19 GiB are free), or "
     "stop what else uses the GPU"),
    # No advice for what decodebench knows no remedy for; the cause still comes first.
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", None),
])
def test_advice_is_computed_from_the_figures_in_the_message(line: str, advice: str | None) -> None:
    log = f"{ENGINE}EngineCore failed to start.\n{ENGINE}Traceback (most recent call last):\n" \
          f"{ENGINE}    raise ValueError(\n{ENGINE}{line}\n{WRAPPED}\n"
    assert root_cause(log) == (line, advice)


def test_a_cause_in_a_worker_comes_before_the_engines_wrapper_of_it() -> None:
    cause = ("ValueError: Available memory on node 0 (7.46/23.54 GiB) on kv cache allocation is less "
             "than requested memory for kv (8.94/10.59 GiB). Reduce CPU memory used by other processes.")
    log = "\n".join([
        f"{WORKER}WorkerProc hit an exception.", f"{WORKER}{cause}",
        f"{ENGINE}EngineCore failed to start.",
        f"{ENGINE}RuntimeError: Worker failed with error '{cause.split(': ', 1)[1]}', please check "
        "the stack trace above for the root cause", WRAPPED])
    found = root_cause(log)
    assert found is not None and found.line == cause


def test_only_a_wrapper_is_the_cause_when_nothing_else_is_logged() -> None:
    # A worker killed from outside (the OOM killer) leaves no traceback of its own.
    log = f"{ENGINE}Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.\n" \
          f"{WRAPPED}\n"
    assert root_cause(log) == (WRAPPED, None)


def test_exceptions_logged_before_the_failure_were_survived() -> None:
    log = "\n".join([
        "(APIServer pid=11) WARNING 11-20 09:12:01 [interface.py:200] Failed to import from amdsmi:",
        "(APIServer pid=11) WARNING 11-20 09:12:01 [interface.py:200] ModuleNotFoundError: No module "
        "named 'amdsmi'",
        f"{ENGINE}EngineCore failed to start.",
        f"{ENGINE}ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization`.",
    ])
    found = root_cause(log)
    assert found is not None and found.line.startswith("ValueError: No available memory")


def test_an_api_server_that_raised_before_its_engine_started_is_read_whole() -> None:
    # A plain traceback (no vLLM prefix), no engine failure logged.
    log = "Traceback (most recent call last):\n  File \"<frozen runpy>\", line 198\n" \
          "OSError: /models/m does not appear to have a file named config.json.\n"
    assert not engine_failed(log)
    assert root_cause(log) == ("OSError: /models/m does not appear to have a file named config.json.", None)


def test_colored_log_lines_are_read_too() -> None:
    # vLLM colors its prefix when its output is a terminal (or VLLM_LOGGING_COLOR says so).
    line = "ValueError: No available memory for the cache blocks."
    log = (f"\x1b[0;36m(EngineCore pid=8) \x1b[0;0m\x1b[31mERROR\x1b[0m \x1b[90m11-20 09:12:03\x1b[0m "
           f"\x1b[90m[core.py:1510]\x1b[0m EngineCore failed to start.\r\n"
           f"\x1b[0;36m(EngineCore pid=8) \x1b[0;0m\x1b[31mERROR\x1b[0m \x1b[90m11-20 09:12:03\x1b[0m "
           f"\x1b[90m[core.py:1510]\x1b[0m {line}\r\n")
    found = root_cause(log)
    assert found is not None and found.line == line


def test_a_log_without_an_exception_has_no_root_cause() -> None:
    text = (LOGS / "max_model_len.log").read_text()
    starting = text[:text.index("EngineCore failed to start")]
    assert starting.count("\n") > 20  # a real start's lines, up to its failure
    assert not engine_failed(starting)
    assert root_cause(starting) is None


@pytest.mark.parametrize("marker", ENGINE_FAILED)
def test_each_sign_of_a_failed_engine_is_seen(marker: str) -> None:
    assert engine_failed(f"{ENGINE}{marker} ...\n")


def test_the_message_begins_with_the_cause_and_the_fix_then_the_log_tail() -> None:
    text = (LOGS / "max_model_len.log").read_text()
    tail = "\n".join(text.splitlines()[-40:])
    message = failure_message("vLLM server exited with code 1 before it became healthy", text, tail)
    lines = message.splitlines()
    assert lines[0].startswith("ValueError: To serve at least one request with the model's max seq len")
    assert lines[1] == ("Fix: set engine.max_model_len to at most 97408, "
                        "or raise engine.gpu_memory_utilization.")
    assert lines[2] == "vLLM server exited with code 1 before it became healthy; last log lines:"
    assert message.endswith(tail)
    # Without a cause, it reads as before: what happened, then the tail.
    assert failure_message("vLLM server not healthy after 3 s", "starting\n", "starting") == \
        "vLLM server not healthy after 3 s; last log lines:\nstarting"
