"""Metrics: hand-computed values, equality with vLLM's own ``calculate_metrics``, the export."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from service.analysis.bursts import is_bunched, run_warnings
from service.analysis.metrics import decode_stats, peak_in_flight, summarize
from service.analysis.steady_window import prefill_stall
from service.analysis.vllm_result import export_vllm
from service.core.sample import Sample

pytestmark = pytest.mark.unit

HERE = Path(__file__).resolve()
# A real result file of `vllm bench serve` (vLLM 0.32.0), kept with the tests.
REFERENCE = HERE.parent / "data" / "vllm-bench-serve-result.json"

DESIGN_KEYS = {
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
} | {
    f"{stat}_{metric}_ms"
    for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99")
    for metric in ("ttft", "tpot", "itl", "e2el")
}
# Beyond vLLM's keys: the steady decode window (ARCHITECTURE.md, "Metrics").
DECODE_KEYS = {"decode_gaps"} | {
    f"decode_{stat}_{metric}_ms" for stat in ("mean", "median", "p99") for metric in ("itl", "tpot")
}


def _ok(index: int, prompt_len: int, output_tokens: int, ttft: float, itl: list[float],
        start: float, latency: float | None = None) -> Sample:
    return Sample(index=index, prompt_len=prompt_len, output_tokens=output_tokens, ttft=ttft,
                  itl=itl, latency=ttft + sum(itl) if latency is None else latency,
                  start_time=start, success=True)


def _failed(index: int, prompt_len: int, start: float) -> Sample:
    # What a non-200 answer leaves: no chunk, so no TTFT, no latency, no tokens.
    return Sample(index=index, prompt_len=prompt_len, output_tokens=0, ttft=0.0, itl=[],
                  latency=0.0, start_time=start, success=False, error="HTTP 500: boom")


def _four() -> list[Sample]:
    # A: 4 tokens, TTFT 100 ms, gaps 20/30/50 ms, E2EL 200 ms, starts at 0.0 s.
    # B: 1 token,  TTFT 300 ms, no gaps,         E2EL 300 ms, starts at 0.5 s.
    # C: 3 tokens, TTFT 200 ms, gaps 40/60 ms,   E2EL 300 ms, starts at 1.2 s.
    # F: failed (HTTP 500), 40 prompt tokens, starts at 0.6 s.
    return [
        _ok(0, 10, 4, 0.1, [0.02, 0.03, 0.05], start=0.0, latency=0.2),
        _ok(1, 20, 1, 0.3, [], start=0.5, latency=0.3),
        _ok(2, 30, 3, 0.2, [0.04, 0.06], start=1.2, latency=0.3),
        _failed(3, 40, start=0.6),
    ]


def test_peak_in_flight_counts_requests_open_at_one_instant_where_vllm_counts_per_second() -> None:
    # Four back-to-back waves of two 0.2 s requests within one second: never more than two
    # open at once, but vLLM's one-second buckets see all eight together.
    samples = [_ok(i, 10, 2, 0.1, [0.1], start=0.2 * (i // 2)) for i in range(8)]
    assert peak_in_flight(samples) == 2
    assert summarize(samples, 1.0)["max_concurrent_requests"] == 8
    assert peak_in_flight([*samples, _failed(9, 10, start=0.1)]) == 2
    assert peak_in_flight([]) == 0


def test_summary_has_exactly_the_design_keys() -> None:
    assert set(summarize(_four(), 2.0)) == DESIGN_KEYS | DECODE_KEYS


def test_decode_window_leaves_out_gaps_while_another_request_waits_for_its_first_token() -> None:
    # A starts at 0, first token at 0.1, then gaps of 10 ms up to 0.15 (5 gaps).
    # B starts at 0.12 and waits until 0.14: A's gaps ending in (0.12, 0.14] or
    # starting before 0.14 overlap B's wait: (0.11,0.12] no, (0.12,0.13] yes, (0.13,0.14] yes,
    # (0.14,0.15] no. B's own gaps after 0.14 are 20 ms each, none overlapped.
    a = _ok(0, 10, 6, 0.1, [0.01] * 5, start=0.0)
    b = _ok(1, 10, 3, 0.02, [0.02, 0.02], start=0.12)
    d = decode_stats([a, b])
    assert d["decode_gaps"] == 3 + 2
    assert d["decode_median_itl_ms"] == pytest.approx(10.0)
    # Per request: A's steady gaps average 10 ms, B's 20 ms; the median of two is 15.
    assert d["decode_median_tpot_ms"] == pytest.approx(15.0)
    assert summarize([a, b], 1.0)["decode_gaps"] == 5


def test_full_batch_window_keeps_gaps_while_every_slot_decodes() -> None:
    # A decodes from 0.10 to 0.15 (10 ms gaps); B waits 0.00-0.12, then decodes 0.12-0.16
    # (20 ms gaps). Steady: A's last three gaps and both of B's. Both decoding throughout:
    # A's last three, and B's first (0.12-0.14); B's last (0.14-0.16) outlives A.
    a = _ok(0, 10, 6, 0.1, [0.01] * 5, start=0.0)
    b = _ok(1, 10, 3, 0.12, [0.02, 0.02], start=0.0)
    assert decode_stats([a, b])["decode_gaps"] == 3 + 2
    assert decode_stats([a, b], min_decoding=2)["decode_gaps"] == 3 + 1


def test_decode_window_of_one_request_is_all_its_gaps() -> None:
    a = _ok(0, 10, 4, 0.5, [0.02, 0.03, 0.04], start=1.0)
    d = decode_stats([a])
    assert d["decode_gaps"] == 3
    assert d["decode_mean_itl_ms"] == pytest.approx(30.0)
    assert d["decode_median_tpot_ms"] == pytest.approx(30.0)


def test_a_stream_that_arrived_at_once_is_bunched_and_warns() -> None:
    streamed = [_ok(i, 10, 9, 0.05, [0.004] * 8, start=float(i)) for i in range(9)]
    together = _ok(9, 10, 9, 0.08, [1e-5] * 8, start=9.0)
    assert not any(is_bunched(s) for s in streamed)
    assert is_bunched(together)
    runs = [*streamed, together]
    (warning,) = run_warnings(runs, summarize(runs, 10.0))
    assert warning["code"] == "bunched_streams"
    assert warning["figure"] == pytest.approx(0.1)
    assert run_warnings(streamed, summarize(streamed, 10.0)) == []


def test_a_client_reading_every_fourth_step_is_bunched_but_jitter_is_not() -> None:
    # Three of every four chunks reach the client together with the fourth.
    every_fourth = _ok(0, 10, 9, 0.05, [0.016, 1e-5, 1e-5, 1e-5] * 2, start=0.0)
    # Uneven but real engine steps: 2 ms and 6 ms in turn.
    jitter = _ok(1, 10, 9, 0.05, [0.002, 0.006] * 4, start=0.0)
    assert is_bunched(every_fourth)
    assert not is_bunched(jitter)


def test_failed_requests_are_counted_but_left_out_of_tokens_and_latencies() -> None:
    s = summarize(_four(), duration=2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 60  # 10 + 20 + 30; F's 40 prompt tokens are not counted
    assert s["total_output_tokens"] == 8  # 4 + 1 + 3
    # E2EL over A, B, C only: (200 + 300 + 300) / 3; with F's 0 it would be 200.
    assert s["mean_e2el_ms"] == pytest.approx(800 / 3)


def test_throughputs_divide_by_duration() -> None:
    s = summarize(_four(), duration=2.0)
    assert s["request_throughput"] == pytest.approx(1.5)  # 3 completed / 2 s
    assert s["output_throughput"] == pytest.approx(4.0)  # 8 tokens / 2 s
    assert s["total_token_throughput"] == pytest.approx(34.0)  # (60 + 8) / 2 s


def test_tpot_excludes_single_token_outputs() -> None:
    s = summarize(_four(), duration=2.0)
    # A: (200 - 100) / (4 - 1) = 33.33 ms; C: (300 - 200) / (3 - 1) = 50 ms; B (1 token) left out.
    # Mean 41.67 ms; with B as 0 it would be 27.78 ms.
    assert s["mean_tpot_ms"] == pytest.approx((100 / 3 + 50) / 2)
    assert s["median_tpot_ms"] == pytest.approx((100 / 3 + 50) / 2)


def test_itl_pools_every_gap_of_every_request() -> None:
    s = summarize(_four(), duration=2.0)
    # Pooled gaps 20, 30, 50, 40, 60 ms: mean 40. The mean of the per-request means,
    # (33.33 + 50) / 2 = 41.67, would be wrong.
    assert s["mean_itl_ms"] == pytest.approx(40.0)
    assert s["median_itl_ms"] == pytest.approx(40.0)


def test_std_is_the_population_std() -> None:
    s = summarize(_four(), duration=2.0)
    # ITL deviations from 40 ms: -20, -10, 0, 10, 20; sqrt((400 + 100 + 0 + 100 + 400) / 5) = sqrt(200).
    # The sample std (divide by 4) would be sqrt(250) = 15.81.
    assert s["std_itl_ms"] == pytest.approx(200**0.5)
    # TTFT 100, 300, 200 ms: deviations -100, 100, 0; sqrt(20000 / 3) = 81.65 (sample std: 100).
    assert s["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)


def test_p99_interpolates_linearly_between_ranks() -> None:
    s = summarize(_four(), duration=2.0)
    # ITL sorted 20, 30, 40, 50, 60 ms: p99 at rank 0.99 * 4 = 3.96, 50 + 0.96 * (60 - 50) = 59.6.
    assert s["p99_itl_ms"] == pytest.approx(59.6)
    # TTFT sorted 100, 200, 300 ms: p90 at rank 0.9 * 2 = 1.8, 200 + 0.8 * 100 = 280.
    assert s["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["p50_ttft_ms"] == s["median_ttft_ms"] == pytest.approx(200.0)


def test_percentile_keys_use_vllm_names() -> None:
    s = summarize(_four(), duration=2.0, percentiles=(99.9, 25.0))
    assert "p99.9_itl_ms" in s and "p25_itl_ms" in s and "p99_itl_ms" not in s
    # Rank 0.999 * 4 = 3.996: 50 + 0.996 * 10 = 59.96 ms.
    assert s["p99.9_itl_ms"] == pytest.approx(59.96)


def test_peak_tokens_per_second_counts_chunks_in_wall_clock_seconds() -> None:
    s = summarize(_four(), duration=2.0)
    # Seconds from the first start (A, 0.0 s). Tokens land at start + TTFT + running sum of gaps:
    # A at 0.10, 0.12, 0.15, 0.20 and B at 0.80: second 0 holds 5; C at 1.40, 1.44, 1.50: second 1 holds 3.
    assert s["max_output_tokens_per_s"] == 5.0


def test_max_concurrent_requests_counts_requests_active_in_the_same_second() -> None:
    # A runs 0.0-0.2 s and B 0.5-0.8 s: never at once, but both active in second 0, as vLLM counts it.
    s = summarize(_four(), duration=2.0)
    assert s["max_concurrent_requests"] == 2
    apart = [_ok(0, 1, 2, 0.1, [0.1], start=0.0), _ok(1, 1, 2, 0.1, [0.1], start=1.1)]
    assert summarize(apart, 2.0)["max_concurrent_requests"] == 1


def test_goodput_counts_only_requests_meeting_every_slo() -> None:
    # TTFT <= 250 ms: A (100) and C (200) meet it, B (300) does not: 2 / 2 s.
    assert summarize(_four(), 2.0, {"ttft_ms": 250})["request_goodput"] == pytest.approx(1.0)
    # TPOT <= 40 ms: A (33.3) and B (1 token, TPOT taken as 0) meet it, C (50) does not: 2 / 2 s.
    assert summarize(_four(), 2.0, {"tpot_ms": 40})["request_goodput"] == pytest.approx(1.0)
    # Both: only A meets both (B misses TTFT, C misses TPOT): 1 / 2 s.
    both = summarize(_four(), 2.0, {"ttft_ms": 250, "tpot_ms": 40})
    assert both["request_goodput"] == pytest.approx(0.5)


def test_goodput_slo_is_inclusive() -> None:
    # A's E2EL is exactly 200 ms and counts; B and C (300 ms) do not: 1 / 2 s.
    assert summarize(_four(), 2.0, {"e2el_ms": 200})["request_goodput"] == pytest.approx(0.5)


def test_goodput_is_none_without_slos() -> None:
    assert summarize(_four(), 2.0)["request_goodput"] is None
    assert summarize(_four(), 2.0, {})["request_goodput"] is None


def test_unknown_slo_key_is_rejected() -> None:
    with pytest.raises(ValueError, match="ttft"):
        summarize(_four(), 2.0, {"ttft": 100})


def test_empty_run_gives_zeros() -> None:
    s = summarize([], duration=0.0)
    assert s.pop("request_goodput") is None
    assert set(s.values()) == {0}, s


def test_all_failed_run_gives_zeros_but_counts_failures() -> None:
    s = summarize([_failed(0, 10, 0.0), _failed(1, 10, 0.1)], duration=1.0, goodput={"ttft_ms": 1e6})
    assert s.pop("failed") == 2
    assert s.pop("duration") == 1.0
    assert set(s.values()) == {0}, s


def test_output_tokens_fall_back_to_one_per_chunk_without_usage() -> None:
    # A server that sent no usage: 1 first chunk + 2 gaps = 3 tokens, TPOT (0.3 - 0.1) / 2 = 100 ms.
    s = summarize([_ok(0, 5, 0, 0.1, [0.1, 0.1], start=0.0)], duration=1.0)
    assert s["total_output_tokens"] == 3
    assert s["mean_tpot_ms"] == pytest.approx(100.0)


# ---- the same numbers as vLLM's own calculate_metrics ---------------------------------------

VOCAB_SIZE = 64


def _synthetic(n: int, seed: int) -> list[Sample]:
    """Seeded requests over ~40 s: failures, 1-token outputs, missing usage, TTFTs on the SLO."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    clock = 1812.0  # a perf_counter reading
    for i in range(n):
        clock += rng.expovariate(5.0)
        prompt_len = rng.randint(1, 5000)
        kind = rng.random()
        if kind < 0.05:
            samples.append(_failed(i, prompt_len, clock))
            continue
        out = 1 if rng.random() < 0.1 else rng.randint(2, 200)
        itl = [rng.uniform(0.001, 0.08) for _ in range(out - 1)]
        ttft = 0.9 if rng.random() < 0.05 else rng.uniform(0.01, 2.0)  # 0.9 s: on the TTFT SLO
        if kind < 0.08:
            # Broke mid-stream: a first token and some gaps were seen, then an exception.
            samples.append(Sample(index=i, prompt_len=prompt_len, output_tokens=0, ttft=ttft,
                                  itl=itl[:3], latency=0.0, start_time=clock, success=False,
                                  error="ClientPayloadError"))
            continue
        text = "".join(f" t{rng.randrange(VOCAB_SIZE)}" for _ in range(out))
        usage = 0 if kind < 0.13 else out  # no usage chunk: counted from the text / chunks
        samples.append(Sample(index=i, prompt_len=prompt_len, output_tokens=usage, ttft=ttft,
                              itl=itl, latency=ttft + sum(itl), start_time=clock, success=True,
                              generated_text=text))
    return samples


def _word_tokenizer() -> Any:
    """A real HF fast tokenizer, built in-process: one token per whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"t{i}": i + 1 for i in range(VOCAB_SIZE)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")


def _vllm_key(stat: str, metric: str) -> str:
    return f"{stat}_{metric}_ms"


def test_summary_equals_vllm_calculate_metrics() -> None:
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    samples = _synthetic(200, seed=3)
    duration = 43.5
    percentiles = [50.0, 90.0, 95.0, 99.0, 99.9]
    outputs = [
        RequestFuncOutput(generated_text=s.generated_text, success=s.success, latency=s.latency,
                          output_tokens=s.output_tokens, ttft=s.ttft, itl=list(s.itl),
                          prompt_len=s.prompt_len, error=s.error, start_time=s.start_time)
        for s in samples
    ]
    requests = [SampleRequest(prompt=[1] * s.prompt_len, prompt_len=s.prompt_len,
                              expected_output_len=200) for s in samples]
    theirs, their_output_lens = calculate_metrics(
        input_requests=requests, outputs=outputs, dur_s=duration, tokenizer=_word_tokenizer(),
        selected_percentiles=percentiles,
        goodput_config_dict={"ttft": 900.0, "tpot": 40.0, "e2el": 6000.0},
    )
    ours = summarize(samples, duration, {"ttft_ms": 900.0, "tpot_ms": 40.0, "e2el_ms": 6000.0},
                     percentiles=percentiles)

    expected: dict[str, Any] = {
        "completed": theirs.completed, "failed": theirs.failed,
        "total_input_tokens": theirs.total_input, "total_output_tokens": theirs.total_output,
        "request_throughput": theirs.request_throughput,
        "request_goodput": theirs.request_goodput,
        "output_throughput": theirs.output_throughput,
        "total_token_throughput": theirs.total_token_throughput,
        "max_output_tokens_per_s": theirs.max_output_tokens_per_s,
        "max_concurrent_requests": theirs.max_concurrent_requests,
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std"):
            expected[_vllm_key(stat, metric)] = getattr(theirs, _vllm_key(stat, metric))
        for p, value in getattr(theirs, f"percentiles_{metric}_ms"):
            # The result file's naming, as vllm bench serve writes it.
            word = str(int(p)) if int(p) == p else str(p)
            expected[f"p{word}_{metric}_ms"] = value

    # The data exercise what they should: failures, SLOs that select, ties, several seconds.
    assert theirs.failed >= 5 and theirs.max_concurrent_requests > 1
    assert 0 < theirs.request_goodput < theirs.request_throughput
    assert any(s.success and s.ttft == 0.9 for s in samples)
    assert any(s.success and s.output_tokens == 0 for s in samples)
    assert set(expected) == set(ours) - {"duration"} - DECODE_KEYS
    for key, value in expected.items():
        assert ours[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    exported = export_vllm(ours, samples, {"model": "m"})
    assert exported["output_lens"] == their_output_lens


# ---- the export next to a real result file of vllm bench serve ------------------------------


def _reference() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(REFERENCE.read_text())
    return data


def _export(**spec_info: object) -> dict[str, object]:
    samples = _four()
    random.Random(0).shuffle(samples)
    info: dict[str, object] = {
        "model": "tiny", "num_prompts": 4, "request_rate": None, "burstiness": 1.0,
        "max_concurrency": 4, "date": "20261122-110257", "label": "run-1",
    }
    info.update(spec_info)
    return export_vllm(summarize(samples, 2.0, {"ttft_ms": 250}), samples, info)


def test_export_has_every_key_of_a_real_vllm_result_file_in_its_order() -> None:
    reference = _reference()
    exported = _export()
    assert set(reference) <= set(exported), set(reference) - set(exported)
    assert [k for k in exported if k in reference] == list(reference)


def test_export_values_have_the_reference_types() -> None:
    reference = _reference()
    exported = _export()
    for key, value in reference.items():
        if value is not None:
            assert type(exported[key]) is type(value), key


def test_export_describes_the_run_like_vllm() -> None:
    exported = _export()
    assert exported["request_rate"] == "inf"
    assert exported["backend"] == exported["endpoint_type"] == "openai"
    assert exported["model_id"] == exported["tokenizer_id"] == "tiny"
    assert (exported["label"], exported["date"]) == ("run-1", "20261122-110257")
    assert _export(request_rate=2.5)["request_rate"] == 2.5
    assert _export(metadata={"gpu": "H100"})["gpu"] == "H100"


def test_export_lists_are_in_request_order_with_zero_output_for_failures() -> None:
    exported = _export()
    assert exported["input_lens"] == [10, 20, 30, 40]
    assert exported["output_lens"] == [4, 1, 3, 0]
    assert exported["itls"] == [[0.02, 0.03, 0.05], [], [0.04, 0.06], []]
    assert exported["errors"] == ["", "", "", "HTTP 500: boom"]


def test_export_queue_time_is_the_wait_after_the_scheduled_time() -> None:
    late = Sample(index=0, prompt_len=1, output_tokens=1, ttft=0.1, itl=[], latency=0.1,
                  start_time=10.25, success=True, due_time=10.0, sent_time=10.25)
    exported = export_vllm(summarize([late], 1.0), [late], {"model": "m"})
    assert exported["queue_times"] == [0.25]


def test_export_is_strict_json() -> None:
    exported = _export()
    assert json.loads(json.dumps(exported, allow_nan=False)) == exported


def test_a_prefill_stall_is_a_figure_not_bunched_streams() -> None:
    # Concurrency-4 real prefill: each request decodes at 5 ms a token, but pauses 300 ms
    # while the next request's prompt is prefilled (it waits 200 ms for its first token).
    runs = []
    for i in range(4):
        gaps = [0.005] * 10 + ([0.3] if i < 3 else [0.005]) + [0.005] * 10
        runs.append(_ok(i, 4096, len(gaps) + 1, 0.2, gaps, start=0.3 * i))
    summary = summarize(runs, 5.0)
    # What fired the warning before: the pooled median ITL is far below half the TPOT.
    assert summary["median_itl_ms"] < 0.5 * summary["median_tpot_ms"]
    assert not any(is_bunched(s) for s in runs)
    assert run_warnings(runs, summary) == []
    stall = prefill_stall(runs)
    assert stall["gaps"] >= 3 and 0.5 < float(stall["share"]) < 0.9  # type: ignore[arg-type]
    assert "expected of real prefill" in str(stall["message"])
    # Streams that really reached the client in bursts still warn.
    together = [_ok(i, 4096, 9, 0.2, [1e-5] * 8, start=0.3 * i) for i in range(4)]
    assert run_warnings(together, summarize(together, 5.0))[0]["code"] == "bunched_streams"
