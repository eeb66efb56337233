"""What to measure: ``RunSpec`` and its parts (engine, fill, goodput, ramp-up, stop rule),
validated as a user sends them and as they come back from the database.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from service.core import shapes
from service.core.mode import Mode
from service.core.modelconfig import MaxLen, RequestLen, long_max_len_allowed, max_len_of, model_dir_max_len
from service.core.tinymodel import MAX_MODEL_LEN, TINY_MODEL_NAME

MAX_INPUT_LEN = 1 << 20
MAX_OUTPUT_LEN = 1 << 16
MAX_PROMPTS = 100_000

# Trials of one point; a sweep's runs (points x repeats) stay under MAX_SWEEP_RUNS.
MAX_REPEATS = 32

# org/name with the hub's character rules, or a bare name; no "..", no leading "-".
_REPO_ID = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,95})(?:/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,95}))?$")


def _whole_number(value: Any) -> Any:
    # JSON has one number type: 7.0 is the integer 7. Other floats, strings and booleans
    # still fail the strict integer check.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_whole_number)]


def bounded_int(ge: int, le: int) -> Any:
    """An Int with bounds that show in the JSON schema (bounds before the validator)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_whole_number)]


class Strict(BaseModel):
    """Unknown fields are a 422, not silently dropped; no coercion ("5" or true is not 5)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class FillSpec(Strict):
    """Values the connector writes into the pretended-prefilled KV cache."""

    mean: float = Field(default=0.015, ge=-1e4, le=1e4, allow_inf_nan=False)
    std: float = Field(default=0.0, ge=0.0, le=1e4, allow_inf_nan=False)
    # Fill the whole KV cache once when the server starts (vLLM's ``startup_fill``) instead
    # of each request's blocks in the step that schedules it: no fill work inside the
    # measured steps. Groups the engine zeroes (Mamba hybrids, circular buffers) are still
    # filled per request. A server property: runs share such a server only with runs of
    # the same values.
    startup: bool = False


# Allowed ``engine.extra_args`` options and the type of their value (None: a flag).
EXTRA_ARGS: dict[str, type | tuple[str, ...] | None] = {
    "--max-num-seqs": int,
    "--max-num-batched-tokens": int,
    # A small KV cache on purpose (to see where preemption starts): blocks, not bytes.
    "--num-gpu-blocks-override": int,
    "--block-size": int,
    "--seed": int,
    "--kv-cache-dtype": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"),
    "--enable-prefix-caching": None,
    "--no-enable-prefix-caching": None,
    "--enable-chunked-prefill": None,
    "--no-enable-chunked-prefill": None,
}


def _check_extra_arg(arg: str) -> str:
    name, eq, value = arg.partition("=")
    if name not in EXTRA_ARGS:
        allowed = ", ".join(sorted(EXTRA_ARGS))
        raise ValueError(f"option {name!r} is not allowed in extra_args (allowed: {allowed})")
    kind = EXTRA_ARGS[name]
    if kind is None:
        if eq:
            raise ValueError(f"option {name!r} is a flag and takes no value")
        return name
    if not eq or not value:
        raise ValueError(f"option {name!r} needs a value, written as {name}=VALUE")
    if kind is int:
        if not value.isdigit() or not 0 < int(value) <= 1 << 24:
            raise ValueError(f"option {name!r} needs a positive integer, got {value!r}")
        return f"{name}={int(value)}"
    if isinstance(kind, tuple) and value not in kind:
        raise ValueError(f"option {name!r} must be one of {', '.join(kind)}, got {value!r}")
    return f"{name}={value}"


Rate01 = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class SpeculativeSpec(Strict):
    """Speculative decoding, passed to vLLM as ``--speculative-config`` (vLLM 0.32's
    ``SpeculativeConfig`` names). A dummy KV fill changes what the model predicts and so
    the drafts it accepts; ``rejection_sample_method: "synthetic"`` with an acceptance
    length or per-position rates makes acceptance a set figure instead."""

    method: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")
    model: str | None = Field(default=None, min_length=1, max_length=512)
    num_speculative_tokens: Int = Field(ge=1, le=64)
    # n-gram lookup window (method "ngram"); vLLM's defaults when None.
    prompt_lookup_max: Int | None = Field(default=None, ge=1, le=1024)
    prompt_lookup_min: Int | None = Field(default=None, ge=1, le=1024)
    rejection_sample_method: Literal["standard", "synthetic", "block"] | None = None
    synthetic_acceptance_length: float | None = Field(default=None, ge=1.0, le=65.0, allow_inf_nan=False)
    synthetic_acceptance_rates: list[Rate01] | None = Field(default=None, min_length=1, max_length=64)

    @model_validator(mode="after")
    def _synthetic(self) -> SpeculativeSpec:
        if self.method is None and self.model is None:
            raise ValueError("engine.speculative needs a method (\"ngram\", \"eagle\", \"mtp\", ...) "
                             "or a draft model")
        length, rates = self.synthetic_acceptance_length, self.synthetic_acceptance_rates
        n = self.num_speculative_tokens
        if self.rejection_sample_method != "synthetic":
            if length is not None or rates is not None:
                raise ValueError("engine.speculative.synthetic_acceptance_length and _rates apply only "
                                 "with rejection_sample_method \"synthetic\"")
            return self
        if (length is None) == (rates is None):
            raise ValueError("rejection_sample_method \"synthetic\" needs exactly one of "
                             "synthetic_acceptance_length and synthetic_acceptance_rates")
        if length is not None and length > n + 1:
            raise ValueError(f"engine.speculative.synthetic_acceptance_length {length:g} must be in "
                             f"[1, num_speculative_tokens + 1 = {n + 1}]")
        if rates is not None:
            if len(rates) != n:
                raise ValueError(f"engine.speculative.synthetic_acceptance_rates needs one rate per "
                                 f"speculative token ({n}), got {len(rates)}")
            if any(b > a for a, b in itertools.pairwise(rates)):
                raise ValueError("engine.speculative.synthetic_acceptance_rates must not increase "
                                 "(rate i: the chance the first i+1 drafts are all accepted)")
        return self

    def vllm_config(self) -> dict[str, Any]:
        """The ``--speculative-config`` JSON object."""
        return self.model_dump(exclude_none=True)


class EngineSpec(Strict):
    """How the vLLM server is configured; runs with equal engine specs share a server."""

    tensor_parallel_size: Int = Field(default=1, ge=1, le=64)
    max_model_len: Int | None = Field(default=None, ge=16, le=MAX_INPUT_LEN + MAX_OUTPUT_LEN)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    # The KV cache's size itself (vLLM's --kv-cache-memory-bytes, here in GiB), instead of a
    # share of the device: on a CPU vLLM then takes it from the memory free beside the model,
    # where a share must also hold the model and its peak at start.
    kv_cache_gib: float | None = Field(default=None, gt=0.0, le=65536.0, allow_inf_nan=False)
    extra_args: list[str] = Field(default_factory=list, max_length=16)
    # "dummy": random weights (vLLM's --load-format dummy), the model from its config.json
    # and tokenizer alone; decode speed depends on the architecture, not the weight values.
    load_format: Literal["auto", "dummy"] = "auto"
    # Layers a bundled shape (decodebench-shapes/...) is built with; all when None.
    num_layers: Int | None = Field(default=None, ge=1, le=1024)
    # Speculative decoding (``--speculative-config``); none when None.
    speculative: SpeculativeSpec | None = None

    @field_validator("extra_args")
    @classmethod
    def _allowed(cls, args: list[str]) -> list[str]:
        return [_check_extra_arg(a) for a in args]

    @model_validator(mode="after")
    def _one_memory_size(self) -> EngineSpec:
        if self.kv_cache_gib is not None and self.gpu_memory_utilization is not None:
            raise ValueError("set engine.kv_cache_gib or engine.gpu_memory_utilization, not both: "
                             "vLLM ignores the share when the KV cache's size is given")
        return self

    def kv_cache_bytes(self) -> int | None:
        """``--kv-cache-memory-bytes`` of ``kv_cache_gib`` (None: vLLM sizes it from the share)."""
        return None if self.kv_cache_gib is None else int(self.kv_cache_gib * 2**30)

    def cpu_problem(self) -> str | None:
        """Why a server of this engine cannot serve on a CPU (None: as far as is known, it can)."""
        speculative = self.speculative
        if speculative is not None and speculative.rejection_sample_method == "synthetic":
            return ("engine.speculative.rejection_sample_method \"synthetic\" needs a GPU server: vLLM "
                    "0.32 on a CPU dies at its first request (\"Synthetic acceptance not supported with "
                    "CPU sampling\")")
        return None


# What vLLM's default loader looks for in a local model directory (top level only).
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


def effective_load_format(model: str, load_format: str = "auto") -> str:
    """The weights a server of this model loads: the bundled models (the tiny model and the
    shapes) have none, so it is always "dummy"; any other model loads what
    ``engine.load_format`` asks for."""
    return "dummy" if shapes.is_bundled(model) else load_format


def has_weight_files(model_dir: Path) -> bool:
    """Whether a local model directory holds weight files vLLM can load."""
    return any(next(model_dir.glob(pattern), None) is not None for pattern in WEIGHT_FILES)


class GoodputSpec(Strict):
    """Service-level objectives; a request counts for goodput when it meets all given."""

    ttft_ms: float | None = Field(default=None, gt=0, le=1e9)
    tpot_ms: float | None = Field(default=None, gt=0, le=1e9)
    e2el_ms: float | None = Field(default=None, gt=0, le=1e9)


class RampUpSpec(Strict):
    """A request rate growing from ``start_rps`` (first request) to ``end_rps`` (last), like
    ``vllm bench serve --ramp-up-strategy/--ramp-up-start-rps/--ramp-up-end-rps``."""

    strategy: Literal["linear", "exponential"]
    # vLLM's CLI lets a linear ramp start at 0, then fails on the first request's rate.
    start_rps: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    end_rps: float = Field(gt=0, le=1e6, allow_inf_nan=False)

    @model_validator(mode="after")
    def _rising(self) -> RampUpSpec:
        if self.start_rps > self.end_rps:
            raise ValueError(
                f"ramp_up.start_rps ({self.start_rps:g}) must not be above ramp_up.end_rps "
                f"({self.end_rps:g})"
            )
        return self


class StopSpec(Strict):
    """When a run stops sending: once the interval of its median decode ITL is within
    +-``itl_ci_pct`` percent of the median (looked at from ``min_prompts`` answered
    requests on, each time the count doubles; each look's interval at 1 - 5%/looks, see
    ``service.analysis.stopping``), after ``duration_s`` seconds of measurement, or at
    ``max_prompts`` requests (default: the run's ``num_prompts``), whichever comes first.
    Requests already sent are awaited and measured."""

    itl_ci_pct: float | None = Field(default=None, gt=0, le=100, allow_inf_nan=False)
    min_prompts: Int | None = Field(default=None, ge=2, le=MAX_PROMPTS)
    max_prompts: Int | None = Field(default=None, ge=1, le=MAX_PROMPTS)
    duration_s: float | None = Field(default=None, gt=0, le=7 * 86400, allow_inf_nan=False)

    @model_validator(mode="after")
    def _a_rule(self) -> StopSpec:
        if self.itl_ci_pct is None and self.duration_s is None:
            raise ValueError(
                "stop needs a rule: stop.itl_ci_pct (stop once the median decode ITL is known "
                "to +-this percent) and/or stop.duration_s (a time box); without one, "
                "num_prompts is the fixed count"
            )
        if (self.min_prompts is not None and self.max_prompts is not None
                and self.min_prompts > self.max_prompts):
            raise ValueError(
                f"stop.min_prompts ({self.min_prompts}) must not be above stop.max_prompts "
                f"({self.max_prompts})"
            )
        return self


# Validation context of specs read back from the database (``RunSpec.stored``).
STORED = {"stored": True}


def _is_stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))


def describe(exc: ValidationError) -> str:
    """A validation error in one line: each problem's place and message."""
    return "; ".join(
        ".".join(str(p) for p in e["loc"]) + ": " + str(e["msg"]).removeprefix("Value error, ")
        if e["loc"] else str(e["msg"]).removeprefix("Value error, ")
        for e in exc.errors()
    )


class RunSpec(Strict):
    """What one benchmark run measures; see ARCHITECTURE.md, "RunSpec"."""

    model: str = Field(default=TINY_MODEL_NAME, min_length=1, max_length=512)
    input_len: Int = Field(default=1024, ge=1, le=MAX_INPUT_LEN)
    output_len: Int = Field(default=128, ge=1, le=MAX_OUTPUT_LEN)
    range_ratio: float = Field(default=0.0, ge=0.0, lt=1.0)
    num_prompts: Int = Field(default=64, ge=1, le=MAX_PROMPTS)
    max_concurrency: Int | None = Field(default=8, ge=1, le=100_000)
    request_rate: float | None = Field(default=None, gt=0, le=1e6, allow_inf_nan=False)
    burstiness: float = Field(default=1.0, gt=0, le=1e3, allow_inf_nan=False)
    warmup_prompts: Int = Field(default=0, ge=0, le=MAX_PROMPTS)
    # "fill": the connector fills each prompt's KV cache; "prefill": vLLM prefills every
    # prompt; "seeded": the prompts are prefilled once (unmeasured) and the measured
    # requests find them in vLLM's prefix cache, decoding on real KV (``seed_set_salt``).
    # Not strict: a stored spec says its mode as a string.
    mode: Annotated[Mode, Field(strict=False)] = Mode.fill
    fill: FillSpec = Field(default_factory=FillSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    goodput: GoodputSpec = Field(default_factory=GoodputSpec)
    seed: Int = Field(default=0, ge=0, le=2**32 - 1)
    repeats: Int = Field(default=1, ge=1, le=MAX_REPEATS)
    ramp_up: RampUpSpec | None = None
    stop: StopSpec | None = None
    # Over how many nodes the run's driver shards are spread (Ray backend only; 1: all on
    # the node of the run's server).
    driver_nodes: Int = Field(default=1, ge=1, le=64)

    @classmethod
    def stored(cls, data: dict[str, Any]) -> RunSpec:
        """A spec read back from the database: checked like a submitted one except
        against the filesystem (a model directory that went away fails the run when its
        worker starts, with that reason, instead of failing every read of the spec)."""
        return cls.model_validate(data, context=STORED)

    @field_validator("model")
    @classmethod
    def _model_name(cls, value: str, info: ValidationInfo) -> str:
        if value == TINY_MODEL_NAME:
            return value
        if shapes.is_shape(value):
            try:
                shapes.shape_of(value)
            except KeyError as exc:
                raise ValueError(exc.args[0]) from None
            return value
        if value.startswith("/"):
            path = Path(value)
            if ".." in path.parts or any(c in value for c in "\0\n\r"):
                raise ValueError("a local model path may not contain '..' or control characters")
            if _is_stored(info):
                return value
            if not (path / "config.json").is_file():
                raise ValueError(f"no model directory with a config.json at {value!r}")
            return value
        if "://" in value or ".." in value or not _REPO_ID.match(value):
            raise ValueError(
                "model must be the bundled tiny model, a bundled shape (decodebench-shapes/NAME), "
                "a Hugging Face repo id like 'org/name', or an absolute path to a local model "
                "directory"
            )
        return value

    @model_validator(mode="after")
    def _weights(self, info: ValidationInfo) -> RunSpec:
        if (self.model.startswith("/") and self.engine.load_format == "auto" and not _is_stored(info)
                and not has_weight_files(Path(self.model))):
            raise ValueError(
                f"the model directory {self.model!r} has no weight files "
                f"({', '.join(WEIGHT_FILES)}); engine.load_format \"dummy\" runs it without "
                "them, from its config.json and tokenizer (random weights: decode speed "
                "depends on the architecture, not the weight values)"
            )
        return self

    @model_validator(mode="after")
    def _layers(self) -> RunSpec:
        layers = self.engine.num_layers
        if layers is None:
            return self
        if not shapes.is_shape(self.model):
            raise ValueError("engine.num_layers builds a bundled shape (decodebench-shapes/NAME) with "
                             f"fewer layers; {self.model!r} is not one")
        shape = shapes.shape_of(self.model)
        if layers > shape.layers:
            raise ValueError(f"engine.num_layers {layers} is more than {self.model}'s {shape.layers} layers")
        shapes.layer_plan(shape, layers)  # too few for the kinds of layers it mixes: a ValueError
        return self

    @model_validator(mode="after")
    def _seedable(self) -> RunSpec:
        if not self.mode.seeds:
            return self
        if "--no-enable-prefix-caching" in self.engine.extra_args:
            raise ValueError(
                "mode \"seeded\" replays prompts from vLLM's prefix cache: it cannot run with "
                "--no-enable-prefix-caching in engine.extra_args")
        if self.fill.startup:
            raise ValueError(
                "fill.startup fills the KV cache with dummy values at the server's start; mode "
                "\"seeded\" measures decode on the KV a real prefill wrote: leave fill.startup false")
        return self

    @model_validator(mode="after")
    def _one_rate(self) -> RunSpec:
        if self.ramp_up is not None and self.request_rate is not None:
            raise ValueError(
                "ramp_up sets the request rate: leave request_rate null when ramp_up is given "
                "(vllm bench serve refuses --request-rate with --ramp-up-strategy)"
            )
        return self

    @model_validator(mode="after")
    def _fits(self, info: ValidationInfo) -> RunSpec:
        # A stored spec is not judged again on its engine: one accepted before was kept.
        problem = self.length_problem(self.model_max_len(info), judge_engine=not _is_stored(info))
        if problem is not None:
            raise ValueError(problem)
        return self

    def length_problem(self, own: MaxLen | None, judge_engine: bool = True) -> str | None:
        """Why this run's longest request does not fit its server (``engine.max_model_len``
        when given, else ``own``, the model's own limit), or why vLLM would refuse that
        ``engine.max_model_len`` for the model; None when it fits or nothing is known."""
        asked = self.engine.max_model_len
        if (judge_engine and asked is not None and own is not None and asked > own.tokens
                and not long_max_len_allowed()):
            return (f"engine.max_model_len {asked} is above the model's max length {own.tokens} "
                    f"({own.source}): vLLM would refuse to start (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN "
                    "is set where the service runs)")
        if asked is not None:
            limit, source = asked, "engine.max_model_len"
        elif own is not None:
            limit, source = own.tokens, own.source
        else:
            return None
        needed = self.longest_request_tokens()
        if needed <= limit:
            return None
        return (f"input_len {self.input_len} plus output_len {self.output_len} (with range_ratio "
                f"{self.range_ratio}) needs {needed} tokens, more than the model's max length "
                f"{limit} ({source}): lower input_len or output_len")

    def model_max_len(self, info: ValidationInfo | None = None) -> MaxLen | None:
        """The model's own longest sequence where it can be known here: the bundled tiny
        model's, or a local model directory's config (not for a spec read back from the
        database: its directory may have changed since)."""
        if self.model == TINY_MODEL_NAME:
            return MaxLen(MAX_MODEL_LEN, "the bundled tiny model's max_position_embeddings")
        if shapes.is_shape(self.model):
            return max_len_of(shapes.shape_config(shapes.shape_of(self.model), self.engine.num_layers))
        if self.model.startswith("/") and (info is None or not _is_stored(info)):
            return model_dir_max_len(Path(self.model))
        return None

    @model_validator(mode="after")
    def _stop_bounds(self) -> RunSpec:
        stop = self.stop
        if stop is not None and stop.min_prompts is not None and stop.min_prompts > self.prompt_budget():
            raise ValueError(
                f"stop.min_prompts ({stop.min_prompts}) must not be above the most "
                f"requests the run may send ({self.prompt_budget()}: stop.max_prompts, or "
                "num_prompts when that is not given)"
            )
        return self

    def prompt_budget(self) -> int:
        """The most measured requests this run may send: ``num_prompts``, or with a stop
        rule ``stop.max_prompts`` when given."""
        if self.stop is not None and self.stop.max_prompts is not None:
            return self.stop.max_prompts
        return self.num_prompts

    def stop_min_prompts(self) -> int:
        """Answered requests before the interval rule is first checked: ``stop.min_prompts``,
        or twice the concurrency (at least 8), so the interval is not taken over the first
        batch alone; never above the budget."""
        if self.stop is not None and self.stop.min_prompts is not None:
            return self.stop.min_prompts
        return min(self.prompt_budget(), max(8, 2 * (self.max_concurrency or 0)))

    def shape_cpu_problem(self, memory_bytes: int | None = None) -> str | None:
        """Why a vLLM CPU server cannot serve this run's bundled shape: its family's reason
        (``Shape.cpu``), or, on a machine of ``memory_bytes``, that the shape at this run's
        layers does not fit it (``shapes.cpu_memory_problem``); None for a shape it serves
        and for any other model."""
        if not shapes.is_shape(self.model):
            return None
        shape = shapes.SHAPES.get(self.model.removeprefix(shapes.PREFIX))
        if shape is None:
            return None
        if shape.cpu is not None:
            return f"{self.model} does not run on a CPU server: {shape.cpu}"
        if memory_bytes is None:
            return None
        # On a CPU the service serves float32 unless engine.dtype says otherwise.
        problem = shapes.cpu_memory_problem(shape, self.engine.num_layers, memory_bytes,
                                            self.engine.dtype or "float32", self.engine.kv_cache_bytes())
        return None if problem is None else f"{self.model} does not fit this CPU machine: {problem}"

    def cpu_problem(self, memory_bytes: int | None = None) -> str | None:
        """Why a server started on a CPU machine of ``memory_bytes`` cannot serve this run:
        its engine's reason (``EngineSpec.cpu_problem``) or its shape's; None as far as is known."""
        return self.engine.cpu_problem() or self.shape_cpu_problem(memory_bytes)

    def longest_request(self) -> RequestLen:
        """This run's longest request: its prompt and its output, ``range_ratio`` applied."""
        return RequestLen(math.floor(self.input_len * (1 + self.range_ratio)),
                          math.floor(self.output_len * (1 + self.range_ratio)), self.range_ratio)

    def longest_request_tokens(self) -> int:
        """KV cache tokens the longest request of this run needs (prompt plus output)."""
        return self.longest_request().tokens

    def seed_set_salt(self) -> str | None:
        """The ``cache_salt`` of a seeded run's requests: one per seed set (model, engine,
        input lengths and seed decide the prompts), so later runs of the same point on the
        same server find the prompts an earlier one seeded, and no fill run's dummy blocks;
        None for other modes (each run is salted with its own id)."""
        if not self.mode.seeds:
            return None
        key = json.dumps({"server": self.worker_key(), "input_len": self.input_len,
                          "range_ratio": self.range_ratio, "seed": self.seed}, sort_keys=True)
        return "seedset-" + hashlib.sha256(key.encode()).hexdigest()[:24]

    def seeding_spec(self) -> RunSpec:
        """The unmeasured seeding pass of a seeded run: every prompt the run may send
        (warmups and measured, at the same positions, so the same prompts), one output
        token each, sent as fast as the run's concurrency allows."""
        return self.model_copy(update={
            "output_len": 1, "warmup_prompts": 0, "num_prompts": self.warmup_prompts + self.prompt_budget(),
            "request_rate": None, "ramp_up": None, "stop": None, "repeats": 1})

    def worker_key(self) -> str:
        """Runs with equal keys can share one vLLM server."""
        return worker_key(self.model, self.engine, self.fill)

    def trials(self) -> list[RunSpec]:
        """The spec of each of the ``repeats`` trials: trial ``k`` runs with seed
        ``seed + k`` (so no two trials send the same prompts), the rest unchanged."""
        return [self.model_copy(update={"seed": (self.seed + k) % 2**32}) for k in range(self.repeats)]


# The fields that make runs measurements of the same thing: one model on one engine under
# one load, whatever the seed, the number of requests or the stop rule.
POINT_FIELDS = ("model", "engine", "input_len", "output_len", "range_ratio", "max_concurrency",
                "request_rate", "burstiness", "ramp_up", "mode", "fill")


def point_key(spec: dict[str, Any]) -> str:
    """A stable key for the point a stored spec measures (see ``POINT_FIELDS``): runs
    stored before a field of the engine existed have the same key as runs that leave it
    at its default."""
    engine = spec.get("engine") or {}
    fill = spec.get("fill")
    # A stored spec an older version accepted but this one refuses is keyed as it is.
    with contextlib.suppress(ValueError):
        engine = EngineSpec.model_validate(engine).model_dump()
        # Fields added since keys were first stored count only when set, so a stored key
        # and a new run's key of the same point stay equal.
        if engine.get("num_layers") is None:
            engine.pop("num_layers", None)
        if engine.get("speculative") is None:
            engine.pop("speculative", None)
        if engine.get("kv_cache_gib") is None:
            engine.pop("kv_cache_gib", None)
    if isinstance(fill, dict) and not fill.get("startup"):
        fill = {k: v for k, v in fill.items() if k != "startup"}
    point = {k: spec.get(k) for k in POINT_FIELDS} | {"engine": engine, "fill": fill}
    text = json.dumps(point, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def worker_key(model: str, engine: EngineSpec, fill: FillSpec | None = None) -> str:
    """Runs and servers with equal keys belong together: one model, one engine configuration
    (and, for a server that fills its KV cache at start, one set of fill values)."""
    config = engine.model_dump(exclude={"load_format", "num_layers", "speculative", "kv_cache_gib"})
    # Fields added later are in the key only when set, so keys stored before them still match.
    if engine.kv_cache_gib is not None:
        config["kv_cache_gib"] = engine.kv_cache_gib
    if engine.num_layers is not None:
        config["num_layers"] = engine.num_layers
    if engine.speculative is not None:
        config["speculative"] = engine.speculative.vllm_config()
    if fill is not None and fill.startup:
        config["startup_fill"] = {"mean": fill.mean, "std": fill.std}
    # The load format is in the key only where it changes the server: the tiny model loads
    # dummy weights whatever is asked, and keys stored before the field existed (registered
    # servers) still match runs with real weights.
    if effective_load_format(model, engine.load_format) != effective_load_format(model):
        config["load_format"] = engine.load_format
    return json.dumps({"model": model, "engine": config}, sort_keys=True)
