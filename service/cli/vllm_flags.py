"""``vllm bench serve``'s flags as decodebench takes them: which it honours (same names,
meanings and defaults), which it refuses and why, and the run spec a command line makes.

A flag of vLLM's that decodebench does not support is refused by name with the reason,
never ignored (``refusal``); ``tests/test_cli.py`` checks that every flag of the installed
vLLM's parser is either honoured or refused here."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

_DATASET = ("decodebench sends random token prompts only (--dataset-name random): a fill run's "
            "KV cache holds dummy values, so no prompt content reaches decode")
_SERVER = ("decodebench starts and addresses its own vLLM servers, with its KV connector; --url "
           "names the decodebench service. To measure a server you started, register it "
           "(POST /api/workers) and run with its model")
_SAMPLING = ("decodebench sends greedy requests that ignore EOS, so every request decodes exactly "
             "its output length; other sampling would change what is measured")
_ENGINE = "an engine flag: give it to the server with --engine-arg={flag}"
_PLOTS = ("not supported: the run page (/runs/ID) draws the run's timeline and distributions, "
          "and `decodebench export` writes vLLM's sweep layout for its plots")

# vLLM's flags decodebench does not take, with the reason shown when one is given.
REFUSED: dict[str, str] = {
    **{flag: _DATASET for flag in (
        "--dataset-path", "--no-oversample", "--skip-chat-template", "--enable-multimodal-chat",
        "--disable-shuffle", "--custom-output-len", "--custom-ensure-client-side-data",
        "--spec-bench-output-len", "--spec-bench-category", "--sharegpt-output-len",
        "--timed-trace-chunk-hash-size", "--timed-trace-sec-multiplier",
        "--timed-trace-label-timestamp", "--timed-trace-label-input-length",
        "--timed-trace-label-output-length", "--timed-trace-label-hash-ids",
        "--blazedit-min-distance", "--blazedit-max-distance", "--asr-max-audio-len-sec",
        "--asr-min-audio-len-sec", "--random-batch-size", "--no-reranker",
        "--random-mm-base-items-per-request", "--random-mm-num-mm-items-range-ratio",
        "--random-mm-limit-mm-per-prompt", "--random-mm-bucket-config", "--hf-subset", "--hf-split",
        "--hf-name", "--hf-output-len", "--bfcl-categories", "--prefix-repetition-prefix-len",
        "--prefix-repetition-suffix-len", "--prefix-repetition-num-prefixes",
        "--prefix-repetition-output-len", "--speed-bench-dataset-subset", "--speed-bench-output-len",
        "--speed-bench-category")},
    **{flag: _SERVER for flag in (
        "--base-url", "--host", "--port", "--header", "--insecure", "--ready-check-timeout-sec")},
    **{flag: _SAMPLING for flag in (
        "--top-p", "--top-k", "--min-p", "--temperature", "--frequency-penalty",
        "--presence-penalty", "--repetition-penalty", "--logprobs", "--use-beam-search",
        "--extra-body", "--chat-template-kwargs")},
    **{flag: _PLOTS for flag in ("--plot-timeline", "--timeline-itl-thresholds", "--plot-dataset-stats")},
    "--trust-remote-code": _ENGINE.format(flag="--trust-remote-code"),
    "--tokenizer-mode": _ENGINE.format(flag="--tokenizer-mode"),
    "--skip-tokenizer-init": _ENGINE.format(flag="--skip-tokenizer-init"),
    "--no-stream": "decode is timed from streamed tokens; a run without streaming has no ITL",
    "--served-model-name": "the service serves each model under its own name (--model)",
    "--lora-modules": "LoRA adapters are not supported: decode of the base model is measured",
    "--lora-assignment": "LoRA adapters are not supported: decode of the base model is measured",
    "--profile": "not supported: start the server's profiler with its own flags (--engine-arg)",
    "--probe-request-rate": "not supported: decodebench sends no probe requests beside the load",
    "--self-timed": "not supported: decodebench's drivers time every request on their own clock",
    "--no-self-timed": "not supported: decodebench's drivers time every request on their own clock",
    "--request-id-prefix": "decodebench tags each request with its run (its connector reads the tag)",
}

# Values of honoured flags that only one choice of is supported.
ONLY: dict[str, tuple[tuple[str, ...], str]] = {
    "dataset_name": (("random",), _DATASET),
    "backend": (("openai", "vllm"), "decodebench drives the completions API (/v1/completions) with "
                "streamed tokens; chat, embeddings and other backends are not supported"),
    "endpoint": (("/v1/completions",), "decodebench drives the completions API (/v1/completions)"),
}

# Flags taking several values in vLLM (``--goodput ttft:100 tpot:50``); click wants the flag
# before each, so ``spread_nargs`` rewrites them first.
NARGS_PLUS = ("--goodput", "--metadata")


def spread_nargs(argv: Sequence[str]) -> list[str]:
    """``--goodput a b`` as ``--goodput a --goodput b``: vLLM's argparse takes several values
    after these flags, click one per flag (the values are never flags themselves)."""
    out: list[str] = []
    current: str | None = None
    for arg in argv:
        if arg.startswith("-"):
            current = arg if arg in NARGS_PLUS else None
            out.append(arg)
        elif current is not None and out[-1] != current:
            out += [current, arg]
        else:
            out.append(arg)
    return out


def refusal(extra: Sequence[str]) -> str | None:
    """Why the first of the command line's leftover words cannot be taken, or None."""
    for word in extra:
        flag = word.split("=", 1)[0]
        if flag in REFUSED:
            return f"{flag} is not supported: {REFUSED[flag]}"
        if word.startswith("-"):
            return f"no such option: {flag} (see `decodebench bench serve --help`)"
        return f"unexpected argument {word!r}"
    return None


def check_choices(values: Mapping[str, Any]) -> str | None:
    """Why an honoured flag's value cannot be taken, or None."""
    for key, (allowed, why) in ONLY.items():
        if values.get(key) is not None and values[key] not in allowed:
            return f"--{key.replace('_', '-')} {values[key]} is not supported: {why}"
    if values.get("random_prefix_len"):
        return "--random-prefix-len is not supported: every prompt is random, with no shared prefix"
    tokenizer = values.get("tokenizer")
    if tokenizer is not None and tokenizer != values.get("model"):
        return ("--tokenizer is not supported apart from the model's own: the server's tokenizer "
                "is its model's")
    return None


def goodput(items: Sequence[str]) -> dict[str, float]:
    """vLLM's ``--goodput KEY:VALUE`` items (ms) as the spec's ``goodput`` (``ttft_ms``, ...)."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"--goodput {item!r}: give KEY:VALUE, e.g. ttft:200")
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {item!r}: KEY is one of ttft, tpot, e2el")
        try:
            out[f"{key}_ms"] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: VALUE is milliseconds, a number") from None
    return out


# The bundled shapes a run can name (``service.core.shapes``: the command line imports none of
# the service, so they are listed here too; tests/test_cli.py holds the two lists together).
BUNDLED_SHAPES = ("smollm2-135m", "llama-3.2-1b", "qwen2.5-0.5b", "gemma-3-1b", "granite-4.0-h-350m",
                  "qwen3-30b-a3b", "llama-3.1-8b", "llama-3.1-70b", "qwen3-32b", "deepseek-v2-lite",
                  "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b", "qwen3-next-80b-a3b", "llama-4-scout-17b-16e")


def run_spec(v: Mapping[str, Any]) -> dict[str, Any]:
    """The ``RunSpec`` body of a command line's values (click's names); the service checks it."""
    rate = v.get("request_rate")
    spec: dict[str, Any] = {
        "model": v["model"],
        "input_len": v["input_len"],
        "output_len": v["output_len"],
        "range_ratio": v["random_range_ratio"],
        "num_prompts": v["num_prompts"],
        # vLLM's defaults: no concurrency limit, every request at once (an infinite rate).
        "max_concurrency": v.get("max_concurrency"),
        "request_rate": None if rate is None or math.isinf(rate) else rate,
        "burstiness": v["burstiness"],
        "warmup_prompts": v["num_warmups"],
        "seed": v["seed"],
        "mode": v["mode"],
        "fill": {"mean": v["fill_mean"], "std": v["fill_std"],
                 **({"startup": True} if v.get("fill_at_start") else {})},
        "repeats": v["repeats"],
        "goodput": goodput(v.get("goodput") or ()),
    }
    if v.get("ramp_up_strategy"):
        spec["ramp_up"] = {"strategy": v["ramp_up_strategy"], "start_rps": v.get("ramp_up_start_rps"),
                           "end_rps": v.get("ramp_up_end_rps")}
    engine = {key: v[key] for key in ("tensor_parallel_size", "max_model_len", "dtype",
                                      "gpu_memory_utilization", "kv_cache_gib", "load_format", "num_layers")
              if v.get(key) is not None}
    if v.get("engine_arg"):
        engine["extra_args"] = list(v["engine_arg"])
    if engine:
        spec["engine"] = engine
    stop = {key: v[f"stop_{key}"] for key in ("itl_ci_pct", "min_prompts", "max_prompts", "duration_s")
            if v.get(f"stop_{key}") is not None}
    if stop:
        spec["stop"] = stop
    if v.get("driver_nodes") is not None:
        spec["driver_nodes"] = v["driver_nodes"]
    return spec


# The steady-window decode figures a capacity search may put its limit on
# (``service.core.capacity.SLA_METRICS``; tests/test_cli.py holds the two lists together).
SLA_METRICS = ("decode_median_itl_ms", "decode_p99_itl_ms", "decode_median_tpot_ms",
               "decode_p99_tpot_ms")


def capacity_body(v: Mapping[str, Any]) -> dict[str, Any]:
    """The ``POST /api/capacity`` body of ``decodebench capacity``'s values; a ValueError for
    input lengths that are no list of numbers. Fields left unset keep the service's defaults."""
    try:
        lens = [int(w) for w in str(v["input_len"]).split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--input-len {v['input_len']!r}: give comma-separated numbers, "
                         "e.g. 8192,32768") from None
    base: dict[str, Any] = {"model": v["model"]}
    for key, field in (("output_len", "output_len"), ("random_range_ratio", "range_ratio"),
                       ("seed", "seed"), ("burstiness", "burstiness")):
        if v.get(key) is not None:
            base[field] = v[key]
    fill = {k: v[f"fill_{k}"] for k in ("mean", "std") if v.get(f"fill_{k}") is not None}
    if v.get("fill_at_start"):
        fill["startup"] = True
    if fill:
        base["fill"] = fill
    engine = {key: v[key] for key in ("tensor_parallel_size", "max_model_len", "dtype",
                                      "gpu_memory_utilization", "kv_cache_gib", "load_format", "num_layers")
              if v.get(key) is not None}
    if v.get("engine_arg"):
        engine["extra_args"] = list(v["engine_arg"])
    if engine:
        base["engine"] = engine
    body: dict[str, Any] = {"base": base, "input_lens": lens,
                            "sla": {"metric": v["sla_metric"], "max_ms": v["sla_max_ms"]}}
    for key in ("max_concurrency", "max_runs", "prefill_tokens_per_s"):
        if v.get(key) is not None:
            body[key] = v[key]
    prefill = {field: v[f"prefill_{field}"] for field in ("ttft_p99_max_ms", "start_rate", "max_rate",
                                                           "duration_s", "min_prompts")
               if v.get(f"prefill_{field}") is not None}
    if prefill:
        body["prefill"] = prefill  # the service names what is missing (ttft_p99_max_ms)
    return body


def result_filename(v: Mapping[str, Any], model: str, date: str) -> str:
    """The result file's name as ``vllm bench serve`` makes it (``--result-filename`` wins)."""
    if v.get("result_filename"):
        return str(v["result_filename"])
    label = v.get("label") or v.get("backend") or "openai"
    concurrency = f"-concurrency{v['max_concurrency']}" if v.get("max_concurrency") is not None else ""
    base_model = model.split("/")[-1]
    if v.get("ramp_up_strategy"):
        return (f"{label}-ramp-up-{v['ramp_up_strategy']}-{v.get('ramp_up_start_rps')}qps-"
                f"{v.get('ramp_up_end_rps')}qps{concurrency}-{base_model}-{date}.json")
    rate = v.get("request_rate")
    rate = float("inf") if rate is None else float(rate)
    return f"{label}-{rate}qps{concurrency}-{base_model}-{date}.json"
