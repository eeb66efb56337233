"""Metrics: hand-computed values, and equality with vLLM's own ``calculate_metrics``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from service.metrics import Sample, export_vllm, summarize

REFERENCE = Path(__file__).parent / "data" / "vllm-bench-serve-result.json"


def _three() -> list[Sample]:
    # A: 4 tokens, TTFT 0.1 s, gaps 0.02/0.03/0.05, latency 0.2 s, starts at 0.0.
    # B: 1 token, TTFT 0.3 s, latency 0.3 s, starts at 0.5.
    # C: failed.
    return [
        Sample(index=0, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.02, 0.03, 0.05],
               latency=0.2, start_time=0.0, success=True),
        Sample(index=1, prompt_len=20, output_tokens=1, ttft=0.3, itl=[], latency=0.3,
               start_time=0.5, success=True),
        Sample(index=2, prompt_len=30, output_tokens=0, ttft=0.0, itl=[], latency=0.0,
               start_time=0.6, success=False, error="boom"),
    ]


def test_counts_and_throughputs_use_only_successful_requests() -> None:
    s = summarize(_three(), duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_input_tokens"] == 30  # 10 + 20; the failed request's 30 is not counted
    assert s["total_output_tokens"] == 5
    assert s["request_throughput"] == pytest.approx(1.0)  # 2 / 2.0 s
    assert s["output_throughput"] == pytest.approx(2.5)  # 5 / 2.0 s
    assert s["total_token_throughput"] == pytest.approx(17.5)  # (30 + 5) / 2.0 s


def test_tpot_skips_single_token_outputs() -> None:
    s = summarize(_three(), duration=2.0)
    # Only A: (0.2 - 0.1) / (4 - 1) = 33.33 ms; B (1 token) is left out.
    assert s["mean_tpot_ms"] == pytest.approx(100 / 3)
    assert s["std_tpot_ms"] == pytest.approx(0.0)


def test_itl_pools_every_gap_with_population_std_and_linear_percentiles() -> None:
    s = summarize(_three(), duration=2.0)
    assert s["mean_itl_ms"] == pytest.approx(100 / 3)  # (20 + 30 + 50) / 3
    assert s["median_itl_ms"] == pytest.approx(30.0)
    # Population std of 20, 30, 50 ms: sqrt((13.33^2 + 3.33^2 + 16.67^2) / 3) = 12.47 ms.
    assert s["std_itl_ms"] == pytest.approx(12.4722, rel=1e-4)
    # p99 at rank 0.99 * 2 = 1.98: 30 + 0.98 * (50 - 30) = 49.6 ms.
    assert s["p99_itl_ms"] == pytest.approx(49.6)


def test_ttft_and_e2el_statistics() -> None:
    s = summarize(_three(), duration=2.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["std_ttft_ms"] == pytest.approx(100.0)
    assert s["p90_ttft_ms"] == pytest.approx(280.0)  # 100 + 0.9 * 200
    assert s["mean_e2el_ms"] == pytest.approx(250.0)


def test_peaks_count_tokens_and_requests_per_wall_second() -> None:
    s = summarize(_three(), duration=2.0)
    # A's 4 tokens (0.1 .. 0.2 s) and B's one (0.8 s) all land in second 0; both are active in it.
    assert s["max_output_tokens_per_s"] == 5.0
    assert s["max_concurrent_requests"] == 2


def test_goodput_counts_requests_meeting_every_slo() -> None:
    assert summarize(_three(), 2.0, {"ttft_ms": 150})["request_goodput"] == pytest.approx(0.5)
    # B has one token: its TPOT counts as 0 and meets the TPOT SLO; A's 33 ms does not.
    assert summarize(_three(), 2.0, {"tpot_ms": 10})["request_goodput"] == pytest.approx(0.5)
    both = summarize(_three(), 2.0, {"ttft_ms": 150, "tpot_ms": 10})
    assert both["request_goodput"] == 0.0
    assert summarize(_three(), 2.0)["request_goodput"] is None


def test_empty_run_is_all_zeros() -> None:
    s = summarize([], duration=0.0)
    assert s["completed"] == 0 and s["failed"] == 0
    for key, value in s.items():
        if key.endswith("_ms") or key.endswith("_throughput"):
            assert value == 0.0, key


def _synthetic(n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    clock = 1000.0
    for i in range(n):
        clock += rng.expovariate(5.0)
        if rng.random() < 0.08:
            samples.append(Sample(index=i, prompt_len=rng.randint(1, 5000), output_tokens=0, ttft=0.0,
                                  itl=[], latency=0.0, start_time=clock, success=False, error="x"))
            continue
        out = 1 if rng.random() < 0.1 else rng.randint(2, 200)
        itl = [rng.uniform(0.001, 0.08) for _ in range(out - 1)]
        ttft = rng.uniform(0.01, 2.0)
        samples.append(Sample(index=i, prompt_len=rng.randint(1, 5000), output_tokens=out, ttft=ttft,
                              itl=itl, latency=ttft + sum(itl), start_time=clock, success=True))
    return samples


def test_summary_equals_vllm_calculate_metrics() -> None:
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    samples = _synthetic(200, seed=3)
    duration = 41.5
    slos = {"ttft_ms": 900.0, "tpot_ms": 40.0, "e2el_ms": 6000.0}
    outputs = [
        RequestFuncOutput(generated_text="", success=s.success, latency=s.latency,
                          output_tokens=s.output_tokens, ttft=s.ttft, itl=list(s.itl),
                          prompt_len=s.prompt_len, error=s.error, start_time=s.start_time)
        for s in samples
    ]
    theirs, _ = calculate_metrics(
        input_requests=[], outputs=outputs, dur_s=duration, tokenizer=None,
        selected_percentiles=[50, 90, 95, 99],
        goodput_config_dict={"ttft": 900.0, "tpot": 40.0, "e2el": 6000.0},
    )
    ours = summarize(samples, duration, slos)
    expected = {
        "completed": theirs.completed, "failed": theirs.failed,
        "total_input_tokens": theirs.total_input, "total_output_tokens": theirs.total_output,
        "request_throughput": theirs.request_throughput,
        "request_goodput": theirs.request_goodput,
        "output_throughput": theirs.output_throughput,
        "total_token_throughput": theirs.total_token_throughput,
        "max_output_tokens_per_s": theirs.max_output_tokens_per_s,
        "max_concurrent_requests": theirs.max_concurrent_requests,
    }
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std"):
            expected[f"{stat}_{m}_ms"] = getattr(theirs, f"{stat}_{m}_ms")
        for p, value in getattr(theirs, f"percentiles_{m}_ms"):
            expected[f"p{int(p)}_{m}_ms"] = value
    assert 0 < theirs.request_goodput < theirs.request_throughput  # the SLOs really select
    for key, value in expected.items():
        assert ours[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_export_has_every_key_of_a_real_vllm_result_file() -> None:
    reference = json.loads(REFERENCE.read_text())
    samples = _three()
    exported = export_vllm(
        summarize(samples, 2.0, {"ttft_ms": 150}), samples,
        {"model": "m", "num_prompts": 3, "request_rate": None, "burstiness": 1.0,
         "max_concurrency": 4, "date": "20261122-120000", "label": "r-1"},
    )
    assert set(reference) <= set(exported), set(reference) - set(exported)
    assert exported["request_rate"] == "inf"
    assert exported["output_lens"] == [4, 1, 0]
    assert len(exported["itls"]) == len(exported["ttfts"]) == 3
    for key, value in reference.items():
        if not isinstance(value, list) and value is not None:
            assert type(exported[key]) is type(value) or isinstance(value, float), key
    json.dumps(exported)  # serializable as is
