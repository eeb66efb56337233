"""Bundled shapes: the configs written, the layer reductions, how a run names one, and where
the service lists them. The servers themselves run in test_e2e_shapes.py."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service.cli import vllm_flags
from service.cli.commands import cli
from service.control.vllm_cli import engine_flags, kv_transfer_config, worker_argv
from service.core import shapes
from service.core.spec import EngineSpec, RunSpec, point_key, worker_key
from service.core.tinymodel import TINY_MODEL_NAME
from tests.conftest import make_client, make_settings

GEMMA = "decodebench-shapes/gemma-3-1b"
GRANITE = "decodebench-shapes/granite-4.0-h-350m"


def test_every_shape_is_one_of_the_families_people_serve() -> None:
    families = {s.family for s in shapes.SHAPES.values()}
    assert families == {"gqa", "sliding-window", "mamba-hybrid", "moe", "mla", "sinks-sliding",
                        "gated-deltanet-hybrid", "chunked-local"}
    assert len(shapes.SHAPES) >= 12
    assert shapes.shape_of("decodebench-shapes/qwen3-30b-a3b").mixture_of_experts()
    assert shapes.shape_of("decodebench-shapes/deepseek-v3").mixture_of_experts()  # n_routed_experts
    assert not shapes.shape_of("decodebench-shapes/qwen2.5-0.5b").mixture_of_experts()


def test_a_full_depth_shape_keeps_its_published_dimensions(tmp_path: Path) -> None:
    path = shapes.ensure_shape(tmp_path, GEMMA)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 26 and config["sliding_window"] == 512
    assert config["layer_types"].count("full_attention") == 4  # every 6th layer of 26
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (1152, 1, 256)


def test_the_tokenizer_covers_the_whole_vocabulary(tmp_path: Path) -> None:
    path = shapes.ensure_shape(tmp_path, "decodebench-shapes/smollm2-135m", 2)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 49152 and vocab["w49151"] == 49151


@pytest.mark.parametrize(("model", "layers", "kinds"), [
    (GEMMA, 6, {"sliding_attention": 5, "full_attention": 1}),
    (GEMMA, 2, {"sliding_attention": 1, "full_attention": 1}),
    (GRANITE, 4, {"mamba": 3, "attention": 1}),
    (GRANITE, 11, {"mamba": 10, "attention": 1}),
    ("decodebench-shapes/qwen3-30b-a3b", 1, {"decoder": 1}),
    ("decodebench-shapes/deepseek-v3", 2, {"dense": 1, "moe": 1}),
    ("decodebench-shapes/deepseek-v3", 4, {"dense": 3, "moe": 1}),
    ("decodebench-shapes/gpt-oss-20b", 2, {"sliding_attention": 1, "full_attention": 1}),
    ("decodebench-shapes/qwen3-next-80b-a3b", 2, {"linear_attention": 1, "full_attention": 1}),
    ("decodebench-shapes/llama-4-scout-17b-16e", 2, {"chunked_attention": 1, "full_attention": 1}),
])
def test_a_reduced_shape_keeps_every_kind_of_layer(model: str, layers: int, kinds: dict[str, int]) -> None:
    plan = shapes.layer_plan(shapes.shape_of(model), layers)
    assert len(plan) == layers
    assert {k: plan.count(k) for k in set(plan)} == kinds


@pytest.mark.parametrize(("model", "layers", "written"), [
    # DeepSeek's dense layers come first: the reduced config counts the ones it keeps.
    ("decodebench-shapes/deepseek-v3", 2, {"first_k_dense_replace": 1}),
    ("decodebench-shapes/deepseek-v2-lite", 3, {"first_k_dense_replace": 1}),
    # Llama 4 writes its kinds as codes: 1 a chunked RoPE layer, 0 a global NoPE one.
    ("decodebench-shapes/llama-4-scout-17b-16e", 2, {"no_rope_layers": [1, 0]}),
    ("decodebench-shapes/qwen3-next-80b-a3b", 2, {"layer_types": ["linear_attention", "full_attention"]}),
])
def test_a_reduced_shape_writes_its_kinds_as_the_config_reads_them(
    model: str, layers: int, written: dict[str, Any]
) -> None:
    config = shapes.shape_config(shapes.shape_of(model), layers)
    assert config["num_hidden_layers"] == layers
    assert {k: config[k] for k in written} == written


GIB = 2**30


@pytest.mark.parametrize(("memory_gib", "refused"), [
    # This project's 2-core machines have 23.5 GiB: Llama-4-Scout's 2 layers peaked at 23.2 GB
    # of them on a plain vLLM CPU server here, with nothing else running.
    (23.5, {"deepseek-v3", "gpt-oss-120b", "llama-4-scout-17b-16e"}),
    (40, {"deepseek-v3"}),
    (64, set()),
])
def test_the_api_says_which_shapes_fit_this_services_cpu_machine_and_why_not(
        tmp_path: Path, memory_gib: float, refused: set[str]) -> None:
    with make_client(tmp_path, cpu_memory_gib=memory_gib) as client:
        shown = client.get("/api/models").json()["shapes"]
    listed = {s["model"].removeprefix(shapes.PREFIX): s for s in shown}
    assert len(listed) >= 12
    assert {name for name, s in listed.items() if not s["runs_on_cpu"]} == refused
    for name in refused:
        why = listed[name]["why_not"]
        fewest = shapes.SHAPES[name].fewest_layers()
        params = shapes.plan_params(shapes.SHAPES[name], fewest)
        assert f"at {fewest} of its" in why and f"{params / 1e9:.2f} B parameters" in why, why
        assert f"a machine of {memory_gib:.1f} GiB" in why, why
    assert listed["deepseek-v2-lite"]["why_not"] is None


@pytest.mark.parametrize(("name", "published_b"), [
    ("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.6), ("qwen3-32b", 32.8), ("qwen3-30b-a3b", 30.5),
    ("deepseek-v2-lite", 15.7), ("deepseek-v3", 671), ("gpt-oss-20b", 20.9), ("gpt-oss-120b", 116.8),
    ("qwen3-next-80b-a3b", 80), ("llama-4-scout-17b-16e", 107.8),
])
def test_a_shapes_parameters_at_full_depth_are_its_published_size(name: str, published_b: float) -> None:
    # Sizes as their publishers give them: Llama 4 Scout's 109 B less its vision encoder,
    # DeepSeek-V3's 685 B less its multi-token prediction module (14 B).
    params = shapes.plan_params(shapes.SHAPES[name], None)
    assert abs(params / 1e9 - published_b) / published_b < 0.02, params


def test_a_service_with_gpus_lists_every_shape_as_its_family_runs_on_a_cpu(tmp_path: Path) -> None:
    # Servers with GPUs: no CPU machine's memory to hold a shape to.
    catalogue = shapes.catalogue(None)
    assert all(s["runs_on_cpu"] and s["why_not"] is None for s in catalogue)


def test_a_shape_too_large_for_the_cpu_machine_is_refused_at_submit_with_the_arithmetic(
        tmp_path: Path) -> None:
    body = {"model": "decodebench-shapes/gpt-oss-120b", "input_len": 64, "output_len": 4,
            "engine": {"num_layers": 2, "dtype": "bfloat16"}}
    with make_client(tmp_path, cpu_memory_gib=23.5) as client:
        response = client.post("/api/runs", json=body)
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        assert "does not fit this CPU machine" in detail and "7.58 B parameters" in detail, detail
        assert "DECODEBENCH_CPU_MEMORY_GIB" in detail
        assert client.get("/api/runs").json()["total"] == 0  # nothing queued


def test_a_queued_run_that_does_not_fit_fails_at_placement_with_its_arithmetic() -> None:
    v3 = RunSpec(model="decodebench-shapes/deepseek-v3", engine=EngineSpec(num_layers=2, dtype="bfloat16"))
    problem = v3.cpu_problem(int(23.5 * GIB))
    assert problem is not None
    assert problem.startswith("decodebench-shapes/deepseek-v3 does not fit this CPU machine"), problem
    assert "13.94 B parameters" in problem
    assert v3.cpu_problem(None) is None  # servers with GPUs, or nodes of unknown memory
    assert v3.cpu_problem(int(64 * GIB)) is None
    lite = RunSpec(model="decodebench-shapes/deepseek-v2-lite", engine=EngineSpec(num_layers=2))
    assert lite.cpu_problem(int(23.5 * GIB)) is None


def test_a_runs_kv_cache_and_depth_count_against_the_machine() -> None:
    memory = int(23.5 * GIB)
    small = RunSpec(model="decodebench-shapes/gpt-oss-20b", engine=EngineSpec(num_layers=2, dtype="bfloat16"))
    assert small.cpu_problem(memory) is None
    # In float32, a CPU server's default here, the weights are twice as large.
    scout = EngineSpec(num_layers=2, dtype="bfloat16")
    wide = RunSpec(model="decodebench-shapes/llama-4-scout-17b-16e", engine=EngineSpec(num_layers=2))
    problem = wide.cpu_problem(int(40 * GIB))
    assert problem is not None and "GiB in float32" in problem and "engine.dtype bfloat16 halves" in problem
    assert RunSpec(model=wide.model, engine=scout).cpu_problem(int(40 * GIB)) is None
    big_cache = RunSpec(model="decodebench-shapes/gpt-oss-20b",
                        engine=EngineSpec(num_layers=2, dtype="bfloat16", kv_cache_gib=12))
    problem = big_cache.cpu_problem(memory)
    assert problem is not None and "its 12.0 GiB KV cache" in problem, problem
    # The whole 70B on a CPU: refused, with what its fewest layers would take.
    whole = RunSpec(model="decodebench-shapes/llama-3.1-70b")
    problem = whole.cpu_problem(memory)
    assert problem is not None and "at 80 of its 80 layers" in problem
    assert "at engine.num_layers 1, its fewest, it peaks near" in problem, problem


def test_a_rewritten_shape_replaces_a_stale_config(tmp_path: Path) -> None:
    path = shapes.ensure_shape(tmp_path, GEMMA, 6)
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 99}))
    assert json.loads((shapes.ensure_shape(tmp_path, GEMMA, 6) / "config.json").read_text())[
        "num_hidden_layers"] == 6


def test_threads_writing_one_shape_at_once_each_get_a_whole_model(tmp_path: Path) -> None:
    # Two runs of one new shape placed at once write its files from two threads of one process:
    # each file goes to a temporary name of its own (a name by process id alone was shared,
    # and one thread's rename then found the other's file gone).
    def write(k: int) -> dict[str, Any]:
        path = shapes.ensure_shape(tmp_path / f"round{k // 8}", "decodebench-shapes/smollm2-135m", 2)
        return dict(json.loads((path / "config.json").read_text()))

    with ThreadPoolExecutor(max_workers=8) as pool:
        configs = list(pool.map(write, range(8 * 5)))
    assert all(c["num_hidden_layers"] == 2 for c in configs)
    assert not list(tmp_path.rglob("*.tmp"))


def _refusal(**spec: Any) -> str:
    with pytest.raises(ValidationError) as info:
        RunSpec(**spec)
    return str(info.value)


def test_an_unknown_shape_is_refused_with_the_known_ones() -> None:
    message = _refusal(model="decodebench-shapes/llama-9000")
    assert "no bundled shape" in message and GEMMA in message


def test_num_layers_is_refused_for_a_model_that_is_not_a_shape_and_beyond_the_shapes_depth() -> None:
    assert "not one" in _refusal(model=TINY_MODEL_NAME, engine={"num_layers": 2})
    assert "more than" in _refusal(model=GEMMA, engine={"num_layers": 27})
    assert "at least 2" in _refusal(model=GRANITE, engine={"num_layers": 1})


def test_a_run_longer_than_the_shapes_context_is_refused() -> None:
    assert "8192" in _refusal(model="decodebench-shapes/smollm2-135m", input_len=8192, output_len=8)


def test_a_shape_is_served_with_dummy_weights_from_its_own_directory(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    spec = RunSpec(model=GEMMA, engine=EngineSpec(num_layers=6))
    argv, model_path = worker_argv(settings, spec, 8000, "t" * 32, [])
    assert model_path == str(settings.models_dir / "decodebench-shapes" / "gemma-3-1b-6l")
    assert argv[argv.index("--load-format") + 1] == "dummy"
    assert argv[argv.index("--served-model-name") + 1] == GEMMA


def test_a_mamba_hybrid_on_a_cpu_runs_without_prefix_caching_unless_the_run_says() -> None:
    assert "--no-enable-prefix-caching" in engine_flags(GRANITE, EngineSpec(), on_cpu=True)
    assert "--no-enable-prefix-caching" not in engine_flags(GRANITE, EngineSpec(), on_cpu=False)
    chosen = engine_flags(GRANITE, EngineSpec(extra_args=["--enable-prefix-caching"]), on_cpu=True)
    assert "--no-enable-prefix-caching" not in chosen and "--enable-prefix-caching" in chosen


def test_startup_fill_goes_to_the_connector_and_apart_in_the_server_key() -> None:
    extra = kv_transfer_config("http://x", "t", 0.5, 0.0, startup_fill=True)["kv_connector_extra_config"]
    assert extra["startup_fill"] is True and extra["fill_mean"] == 0.5
    per_request = RunSpec(fill={"mean": 0.5})
    at_start = RunSpec(fill={"mean": 0.5, "startup": True})
    other_values = RunSpec(fill={"mean": 0.7, "startup": True})
    assert per_request.worker_key() == RunSpec(fill={"mean": 0.7}).worker_key()  # values pulled per run
    assert len({per_request.worker_key(), at_start.worker_key(), other_values.worker_key()}) == 3


def test_server_keys_stored_before_the_new_engine_fields_still_match() -> None:
    stored = json.dumps({"model": "m", "engine": {"dtype": None, "extra_args": [],
                                                  "gpu_memory_utilization": None, "max_model_len": None,
                                                  "tensor_parallel_size": 1}}, sort_keys=True)
    assert worker_key("m", EngineSpec()) == stored


def test_the_api_and_the_index_page_list_the_shapes(client: TestClient) -> None:
    listed = client.get("/api/models").json()
    assert [s["model"] for s in listed["shapes"]] == [s.model for s in shapes.SHAPES.values()]
    page = client.get("/").text
    for shape in shapes.SHAPES.values():
        assert shape.model in page


def test_the_command_line_names_the_same_shapes_and_builds_their_runs() -> None:
    assert set(vllm_flags.BUNDLED_SHAPES) == set(shapes.SHAPES)
    help_text = CliRunner().invoke(cli, ["bench", "serve", "--help"], terminal_width=400).output
    assert all(f"decodebench-shapes/{name}" in help_text for name in shapes.SHAPES)
    values = {"model": GEMMA, "input_len": 10, "output_len": 2, "random_range_ratio": 0.0,
              "num_prompts": 1, "burstiness": 1.0, "num_warmups": 0, "seed": 0, "mode": "fill",
              "fill_mean": 0.1, "fill_std": 0.0, "repeats": 1, "num_layers": 6, "fill_at_start": True}
    spec = vllm_flags.run_spec(values)
    assert spec["engine"]["num_layers"] == 6 and spec["fill"]["startup"] is True
    RunSpec(**spec)  # the service takes it


def test_a_points_key_stored_before_the_new_fields_matches_a_new_run_of_that_point() -> None:
    old = {"model": TINY_MODEL_NAME, "input_len": 64, "output_len": 4, "mode": "fill", "range_ratio": 0.0,
           "max_concurrency": 8, "request_rate": None, "burstiness": 1.0, "ramp_up": None,
           "fill": {"mean": 0.015, "std": 0.0},
           "engine": {"tensor_parallel_size": 1, "max_model_len": None, "dtype": None,
                      "gpu_memory_utilization": None, "extra_args": [], "load_format": "auto"}}
    new = RunSpec(input_len=64, output_len=4).model_dump()
    assert point_key(old) == point_key(new)
    at_start = RunSpec(input_len=64, output_len=4, fill={"startup": True})
    assert point_key(at_start.model_dump()) != point_key(new)
