"""Mode ``seeded`` without a server: the fit arithmetic, the proof from the prefix-cache
counters, the seed set's salt and prompts, what the API refuses, fill neutrality per model,
speculative decoding options and fill/seeded pairs in a sweep."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.analysis import seeding
from service.analysis.neutrality import fill_neutrality, fill_not_neutral
from service.control.vllm_cli import engine_flags
from service.core import shapes
from service.core.capacity import CapacityCreate, probe_spec
from service.core.spec import EngineSpec, RunSpec
from service.core.status import RunStatus
from service.core.sweep import SweepCreate
from service.core.tinymodel import VOCAB_SIZE
from service.load.plan import make_plan
from service.storage import store, sweeps
from service.storage.db import make_engine
from service.web.sweep_view import sweep_public
from tests.conftest import wait_finished

# ------------------------------------------------------------------ the arithmetic


def test_a_request_hits_every_whole_block_but_the_one_holding_its_last_token() -> None:
    assert seeding.most_hit(4096, 16) == 4080  # 4096 is a whole number of blocks: one recomputed
    assert seeding.most_hit(4100, 16) == 4096
    assert seeding.most_hit(16, 16) == 0
    assert seeding.most_hit(17, 16) == 16


def test_the_fit_counts_the_seed_set_and_every_measured_requests_fresh_blocks() -> None:
    fit = seeding.fit(kv_tokens=10_000, block=16, input_lens=[100, 200], output_lens=[10, 20])
    # The seed set: the prompts' whole blocks (96 + 192).
    assert fit.seed_set == 288
    # Fresh blocks: ceil((L + O) / 16) less the blocks hit. 100+10 -> 7 blocks, 96 hit (6):
    # 1 block; 200+20 -> 14 blocks, 192 hit (12): 2 blocks.
    assert fit.fresh == (1 + 2) * 16
    assert fit.needed == 288 + 48 and fit.problem() is None


def test_a_seed_set_that_does_not_fit_is_refused_with_the_arithmetic() -> None:
    fit = seeding.fit(kv_tokens=8_000, block=16, input_lens=[4096, 4096], output_lens=[16, 16])
    problem = fit.problem()
    assert problem is not None
    assert problem.startswith("infeasible: the seed set does not fit: the KV cache holds 8,000 "
                              "tokens; the seed set needs 8,192 (2 prompts")
    assert f"another {fit.fresh:,}" in problem and f"{fit.needed:,} in all" in problem


def test_every_request_hitting_its_most_is_proven() -> None:
    lengths = [4096, 4100, 3000]
    most = sum(seeding.most_hit(n, 16) for n in lengths)
    problem, figures = seeding.replay_problem((sum(lengths), most), 16, lengths)
    assert problem is None
    assert figures == {"requests": 3, "prompt_tokens": sum(lengths), "most_hits": most,
                       "queries": sum(lengths), "hits": most}


def test_a_miss_fails_with_the_tokens_computed_again_and_the_fit() -> None:
    lengths = [4096] * 4
    most = 4 * 4080
    fit = seeding.fit(kv_tokens=1 << 20, block=16, input_lens=lengths, output_lens=[16] * 4)
    problem, _ = seeding.replay_problem((sum(lengths), most - 4080), 16, lengths, fit)
    assert problem is not None
    assert problem.startswith("4,080 prompt tokens the seed set held were computed again")
    assert "the seed set was evicted" in problem
    assert f"the KV cache holds {1 << 20:,} tokens, the seed set needs {fit.seed_set:,}" in problem


def test_other_traffic_or_no_counters_leave_the_replay_unproven() -> None:
    lengths = [64, 64]
    problem, _ = seeding.replay_problem((200, 96), 16, lengths)
    assert problem is not None and "queried for 200 prompt tokens while the run sent 128" in problem
    problem, figures = seeding.replay_problem(None, 16, lengths)
    assert problem is not None and "no prefix-cache counters" in problem
    assert "hits" not in figures


def test_counters_are_read_between_two_scrapes_by_vllms_names() -> None:
    before = {"vllm:prefix_cache_queries": 100.0, "vllm:prefix_cache_hits": 10.0}
    after = {"vllm:prefix_cache_queries": 400.0, "vllm:prefix_cache_hits": 250.0}
    assert seeding.counters(before, after) == (300, 240)
    assert seeding.counters(before, {"vllm:prefix_cache_queries": 50.0}) is None  # reset, missing
    assert seeding.counters(None, after) is None


def test_a_seeding_pass_that_hit_every_prompt_reused_the_seed_set() -> None:
    lengths = [64, 80]
    reused = seeding.seeding_record(0.5, 16, lengths, (144, 48 + 64), "seedset-x")
    assert reused["reused"] is True and reused["computed_tokens"] == 144 - 112
    fresh = seeding.seeding_record(2.0, 16, lengths, (144, 0), "seedset-x")
    assert fresh["reused"] is False and fresh["reused_tokens"] == 0
    unknown = seeding.seeding_record(2.0, 16, lengths, None, "seedset-x")
    assert unknown["reused"] is None


# ------------------------------------------------------------------ the seed set


def _seeded(**extra: Any) -> RunSpec:
    return RunSpec(mode="seeded", input_len=256, output_len=8, num_prompts=6, **extra)


def test_the_salt_is_one_per_seed_set_not_per_run() -> None:
    salt = _seeded().seed_set_salt()
    assert salt is not None and salt.startswith("seedset-")
    # Concurrency, output length and prompt count do not change the prompts.
    assert _seeded(max_concurrency=1).seed_set_salt() == salt
    assert RunSpec(mode="seeded", input_len=256, output_len=32, num_prompts=9).seed_set_salt() == salt
    # The seed, the input length and the engine do.
    assert _seeded(seed=1).seed_set_salt() != salt
    assert RunSpec(mode="seeded", input_len=512, output_len=8, num_prompts=6).seed_set_salt() != salt
    assert _seeded(engine={"extra_args": ["--max-num-seqs=4"]}).seed_set_salt() != salt
    # Fill and prefill runs keep their own salt (the run id).
    assert RunSpec(mode="fill").seed_set_salt() is None


def test_the_seeding_pass_sends_the_prompts_the_run_measures() -> None:
    spec = _seeded(warmup_prompts=2, range_ratio=0.5, stop={"duration_s": 5, "max_prompts": 9})
    seeding_plan = make_plan(spec.seeding_spec(), VOCAB_SIZE)
    measured = make_plan(spec.model_copy(update={"num_prompts": spec.prompt_budget()}), VOCAB_SIZE)
    assert seeding_plan.warmups == 0 and len(seeding_plan.input_lens) == 2 + 9
    assert np.array_equal(seeding_plan.input_lens, measured.input_lens)
    assert set(seeding_plan.output_lens.tolist()) == {1}
    for position in (0, 5, 10):
        assert seeding_plan.prompt(position) == measured.prompt(position)


# ------------------------------------------------------------------ the API


@pytest.mark.parametrize(("body", "words"), [
    ({"engine": {"extra_args": ["--no-enable-prefix-caching"]}}, "--no-enable-prefix-caching"),
    ({"fill": {"startup": True}}, "leave fill.startup false"),
])
def test_seeded_with_incompatible_options_is_422(client: TestClient, body: dict[str, Any],
                                                  words: str) -> None:
    response = client.post("/api/runs", json={"mode": "seeded", "input_len": 64, **body})
    assert response.status_code == 422
    assert words in json.dumps(response.json()["detail"])


@pytest.mark.parametrize(("speculative", "words"), [
    ({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"},
     "exactly one of synthetic_acceptance_length and synthetic_acceptance_rates"),
    ({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 5.0}, "must be in [1, num_speculative_tokens + 1 = 4]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5, 0.7]}, "must not increase"),
    ({"method": "ngram", "num_speculative_tokens": 2, "synthetic_acceptance_length": 2.0},
     "apply only with rejection_sample_method"),
    ({"num_speculative_tokens": 2}, "needs a method"),
])
def test_bad_speculative_options_are_422(client: TestClient, speculative: dict[str, Any], words: str) -> None:
    response = client.post("/api/runs", json={"engine": {"speculative": speculative}})
    assert response.status_code == 422
    assert words in json.dumps(response.json()["detail"])


def test_synthetic_acceptance_goes_to_vllm_as_its_speculative_config() -> None:
    engine = EngineSpec(speculative={"method": "ngram", "num_speculative_tokens": 3,
                                     "rejection_sample_method": "synthetic",
                                     "synthetic_acceptance_length": 2.5})
    flags = engine_flags("decodebench-tiny", engine, on_cpu=True)
    config = json.loads(flags[flags.index("--speculative-config") + 1])
    assert config == {"method": "ngram", "num_speculative_tokens": 3,
                      "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}
    # Its own server: another engine configuration.
    assert RunSpec(engine=engine).worker_key() != RunSpec().worker_key()


SYNTHETIC = {"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
             "synthetic_acceptance_length": 2.0}


def test_synthetic_acceptance_on_a_cpu_machine_fails_before_a_server_starts(
        stub_service: Callable[..., TestClient]) -> None:
    client = stub_service()  # no GPUs
    run_id = client.post("/api/runs", json={"input_len": 64, "output_len": 4, "num_prompts": 2,
                                            "engine": {"speculative": SYNTHETIC}}).json()["id"]
    run = wait_finished(client, run_id, timeout=30)
    assert run["status"] == "failed"
    assert run["error"].startswith('engine.speculative.rejection_sample_method "synthetic" needs a GPU '
                                   "server"), run["error"]
    assert "Synthetic acceptance not supported with CPU sampling" in run["error"]
    assert "it has no GPUs" in run["error"]
    assert run["worker_id"] is None and client.get("/api/workers").json() == []
    # Speculative decoding without synthetic acceptance runs on a CPU.
    plain = {**SYNTHETIC, "rejection_sample_method": None, "synthetic_acceptance_length": None}
    ran = wait_finished(client, client.post("/api/runs", json={
        "input_len": 64, "output_len": 4, "num_prompts": 2, "engine": {"speculative": plain}}).json()["id"])
    assert ran["status"] == "succeeded", ran["error"]


def test_models_say_where_a_dummy_fill_is_not_neutral(client: TestClient) -> None:
    listed = client.get("/api/models").json()
    assert listed["tiny_fill_neutral"] is True and "seeded" in listed["remedy"]
    by_name = {s["model"]: s for s in listed["shapes"]}
    moe = [s for s in by_name.values() if s["family"] == "moe"]
    assert moe and all(s["fill_neutral"] is False for s in moe)
    assert all("mixture of experts" in s["fill_not_neutral_because"][0] for s in moe)
    dense = by_name["decodebench-shapes/smollm2-135m"]
    assert dense["fill_neutral"] is True and dense["fill_not_neutral_because"] == []


def test_a_fill_run_of_a_model_where_fill_is_not_neutral_names_seeded() -> None:
    moe = next(s for s in shapes.SHAPES.values() if s.mixture_of_experts())
    neutrality = fill_neutrality(shapes.shape_config(moe, None))
    (warning,) = fill_not_neutral("fill", neutrality)
    assert warning["code"] == "fill_not_neutral" and 'Mode "seeded"' in warning["message"]
    assert fill_not_neutral("seeded", neutrality) == []
    sparse = fill_neutrality({"hidden_size": 8, "index_topk": 2048})
    assert sparse["neutral"] is False and "sparse index attention" in sparse["reasons"][0]
    speculative = fill_neutrality({"hidden_size": 8}, {"method": "ngram", "num_speculative_tokens": 2})
    assert speculative["neutral"] is False and "speculative decoding" in speculative["reasons"][0]


# ------------------------------------------------------------------ sweeps


def test_a_sweep_over_fill_and_seeded_pairs_them_and_compares_fill_with_seeded(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "db.sqlite")
    body = SweepCreate.model_validate({
        "base": {"input_len": 64, "output_len": 6, "num_prompts": 4, "max_concurrency": 2},
        "grid": {"mode": ["fill", "seeded"]}, "until_decided": {"max_pairs": 4}})
    sweep = sweeps.create_sweep(engine, body, random.Random(0))
    _, runs = sweeps.get_sweep(engine, sweep.id)
    assert len(runs) == 4 and len({r.pair_id for r in runs}) == 2
    for k in range(2):
        pair = [r for r in runs if r.trial == k]
        assert {r.spec["mode"] for r in pair} == {"fill", "seeded"}
        for r in pair:
            value = 5.0 * (1.2 if r.spec["mode"] == "fill" else 1.0) + k
            for status in (RunStatus.starting, RunStatus.running):
                store.transition(engine, r.id, status)
            store.transition(engine, r.id, RunStatus.succeeded, summary={
                "decode_median_itl_ms": value, "decode_median_tpot_ms": value})
    (verdict,) = sweep_public(engine, sweep.id).fill_vs_prefill
    assert verdict["against"] == "seeded"
    assert verdict["fill"] != verdict["prefill"] and verdict["pairs"] == 2
    assert "fill/seeded" in verdict["message"]
    assert math.isclose(verdict["ratios"][0]["ratio"], math.exp(np.mean(
        [math.log(6.0 / 5.0), math.log(7.0 / 6.0)])), rel_tol=1e-9)


def test_until_decided_over_prefill_and_seeded_is_422(client: TestClient) -> None:
    body = {"base": {"input_len": 64}, "grid": {"mode": ["prefill", "seeded"]},
            "until_decided": {"max_pairs": 4}}
    response = client.post("/api/sweeps", json=body)
    assert response.status_code == 422
    assert 'mode over [\\"fill\\", \\"prefill\\"] or [\\"fill\\", \\"seeded\\"]' in json.dumps(
        response.json()["detail"])


# ------------------------------------------------------------------ through the service


def test_a_seeded_run_without_the_servers_counters_fails_unproven(
        stub_service: Callable[..., TestClient]) -> None:
    # The stub server streams like vLLM but keeps no prefix cache counters.
    client = stub_service()
    run_id = client.post("/api/runs", json={"mode": "seeded", "input_len": 64, "output_len": 4,
                                            "num_prompts": 4, "max_concurrency": 2}).json()["id"]
    run = wait_finished(client, run_id)
    assert run["status"] == "failed"
    assert "gave no prefix-cache counters" in run["error"] and "not counted" in run["error"]
    seeding_done = run["summary"]["seeding"]
    assert seeding_done["prompts"] == 4 and seeding_done["seconds"] > 0
    assert seeding_done["proven"] is False and seeding_done["reused"] is None
    # The connector left the seeding and the measured requests to vLLM, and told them apart.
    connector = run["connector"]
    assert connector["seeding_requests"] == 4 and connector["prefill_requests"] == 4
    assert connector["filled_requests"] == 0
    page = client.get(f"/runs/{run_id}").text
    assert "<h2>Seeding</h2>" in page and "<strong>Not proven</strong>" in page
    assert '<th>requests of the seeding pass (mode seeded)</th><td class="num">4</td>' in page
    assert run["provenance"]["prefill"].startswith("real: vLLM prefilled every prompt once")


def test_the_seeding_pass_keeps_driver_logs_of_its_own_and_they_go_with_the_run(
        stub_service: Callable[..., TestClient]) -> None:
    client = stub_service()
    logs_dir = client.app.state.settings.logs_dir  # type: ignore[attr-defined]
    run_id = client.post("/api/runs", json={"mode": "seeded", "input_len": 64, "output_len": 4,
                                            "num_prompts": 4, "max_concurrency": 2}).json()["id"]
    wait_finished(client, run_id)
    # The measured requests' drivers did not write over the seeding pass's logs.
    assert sorted(p.name for p in logs_dir.glob(f"{run_id}.*")) == [
        f"{run_id}.driver0.log", f"{run_id}.seeding.driver0.log"]
    assert client.delete(f"/api/runs/{run_id}").status_code == 204
    assert list(logs_dir.glob(f"{run_id}.*")) == []


def test_a_server_that_hangs_in_the_seeding_pass_fails_the_run_within_the_stall_limit(
        stub_service: Callable[..., TestClient]) -> None:
    # The second prompt of the seeding pass and every request after it get no token; /health
    # still answers and the request timeout is the default 600 s.
    client = stub_service({"STUB_HANG_AT_REQUEST": "2", "STUB_HANG_HEALTHY": "1"}, stall_s=2)
    run_id = client.post("/api/runs", json={"mode": "seeded", "input_len": 64, "output_len": 4,
                                            "num_prompts": 4, "max_concurrency": 2}).json()["id"]
    started = time.monotonic()
    run = wait_finished(client, run_id, timeout=60)
    assert run["status"] == "failed"
    assert run["error"].startswith("vLLM server hung during the seeding pass: none of the 2 open "
                                   "streams got a token"), run["error"]
    assert "stub: hanging as told" in run["error"]
    assert time.monotonic() - started < 15
    # No measured request was sent, and the hung server takes no more runs.
    assert run["progress"]["completed"] == 0 and run["progress"]["failed"] == 0
    worker = client.get(f"/api/workers/{run['worker_id']}").json()
    assert worker["status"] == "failed" and "hung" in worker["error"]


# ------------------------------------------------------------------ capacity searches


def test_a_seeded_capacity_search_probes_with_one_seed_set_per_trial() -> None:
    body = CapacityCreate.model_validate({
        "base": {"mode": "seeded", "output_len": 8}, "input_lens": [4096],
        "sla": {"metric": "decode_median_itl_ms", "max_ms": 50}})
    low, high = probe_spec(body.base, 4096, 1, 0), probe_spec(body.base, 4096, 8, 0)
    assert low.mode == high.mode == "seeded"
    # The probe at 8 sends more prompts, and its seed set starts with the probe at 1's.
    assert high.num_prompts > low.num_prompts
    assert low.seed_set_salt() == high.seed_set_salt() != probe_spec(body.base, 4096, 8, 1).seed_set_salt()
    # A seed set that does not fit refuses the probe as the KV arithmetic does: a bound.
    problem = seeding.fit(1000, 16, [4096], [8]).problem()
    assert problem is not None and problem.startswith("infeasible")
    with pytest.raises(ValueError, match=r'base\.mode must be "fill" or "seeded"'):
        CapacityCreate.model_validate({"base": {"mode": "prefill"}, "input_lens": [4096],
                                       "sla": {"metric": "decode_median_itl_ms", "max_ms": 50}})
