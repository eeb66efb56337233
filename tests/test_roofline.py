"""The roofline: the least time a decode step can take, against the measured decode ITL.

Batch and context are checked by hand on a two-request run; the floor against the worked
example of the docs (Llama-3.1-8B in bf16 at 32k context on an H100 SXM); the wiring through a
stub server that reports the sizes in its provenance, as the connector does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.analysis.roofline import min_step_s, occupancy, roofline, step_bytes
from service.control import energy
from service.core.sample import Sample
from service.web import charts
from tests.conftest import wait_finished

# Llama-3.1-8B: 7,504,924,672 parameters in bf16; KV of a token: 32 layers x 8 KV heads x
# 128 dims x (K and V) x 2 bytes = 131,072 bytes. H100 SXM: 3.35 TB/s.
LLAMA_WEIGHTS = 7_504_924_672 * 2
LLAMA_KV = 32 * 8 * 128 * 2 * 2
H100_SXM = 3.35e12


def facts(weights: float = 1000, kv: float = 10, measured: float = 1e6,
          spec: float | None = 2e6) -> dict[str, Any]:
    return {"weight_bytes": weights, "weight_params": weights / 2, "kv_bytes_per_token": kv,
            "kv_dtype": "bfloat16", "weight_dtype": "bfloat16", "tensor_parallel_size": 1,
            "bandwidth": {"measured_bytes_per_s": measured, "how": "copy", "fill_bytes_per_s": None,
                          "spec_bytes_per_s": spec, "spec_how": "datasheet" if spec else None},
            "device": "test device"}


def sample(index: int, prompt: int, start: float, ttft: float, itl: list[float]) -> Sample:
    return Sample(index=index, prompt_len=prompt, output_tokens=len(itl) + 1, ttft=ttft, itl=itl,
                  latency=ttft + sum(itl), start_time=start, success=True)


# A: prompt 100, tokens at 1, 2, 3, 4. B: prompt 200, tokens at 1, 2. Both wait from 0 to 1,
# so every gap is steady. Window [1, 4]: 3 s; streaming: A 3 s + B 1 s = 4 s, so batch 4/3.
# Contexts during the gaps (prompt + tokens so far): A 101, 102, 103; B 201 -> 507 / 4.
TWO = [sample(0, 100, 0.0, 1.0, [1.0, 1.0, 1.0]), sample(1, 200, 0.0, 1.0, [1.0])]


def test_batch_and_context_are_time_weighted_over_the_steady_window() -> None:
    seen = occupancy(TWO)
    assert seen is not None
    assert seen.window_s == pytest.approx(3.0)
    assert seen.batch == pytest.approx(4 / 3)
    assert seen.context_tokens == pytest.approx(126.75)


def test_a_gap_while_a_request_waits_for_its_first_token_is_left_out() -> None:
    # C starts at 2.5 and waits until 3.5: A's gaps [2, 3] and [3, 4] overlap its wait.
    runs = [*TWO, sample(2, 50, 2.5, 1.0, [])]
    seen = occupancy(runs)
    assert seen is not None
    # Left: A [1, 2] (context 101) and B [1, 2] (201): one second, two sequences.
    assert seen.window_s == pytest.approx(1.0)
    assert seen.batch == pytest.approx(2.0)
    assert seen.context_tokens == pytest.approx(151.0)


def test_the_run_against_its_roofline_by_hand() -> None:
    out = roofline(TWO, facts(), 5.38)
    assert out is not None
    # 1000 + 4/3 x 126.75 x 10 = 1000 + 1690 bytes; over 1e6 B/s: 2.69 ms.
    assert out["bytes_per_step"] == pytest.approx(2690.0)
    assert out["kv_bytes"] == pytest.approx(1690.0)
    assert out["weight_bytes"] == 1000
    assert out["min_step_ms"] == pytest.approx(2.69)
    assert out["pct_of_roofline"] == pytest.approx(50.0)
    assert out["pct_of_spec_roofline"] == pytest.approx(25.0)
    assert out["achieved_bytes_per_s"] == pytest.approx(2690 / 0.00538)
    assert out["bandwidth_bytes_per_s"] == 1e6 and out["spec_bandwidth_bytes_per_s"] == 2e6
    assert set(out) == {"batch", "context_tokens", "bytes_per_step", "weight_bytes", "kv_bytes",
                        "min_step_ms", "decode_median_itl_ms", "pct_of_roofline",
                        "pct_of_spec_roofline", "bandwidth_bytes_per_s",
                        "spec_bandwidth_bytes_per_s", "achieved_bytes_per_s"}


def test_the_worked_example_of_the_docs() -> None:
    # Batch 1 at 32k: 15.01 GB of weights + 4.29 GB of KV over 3.35 TB/s.
    assert min_step_s(LLAMA_WEIGHTS, LLAMA_KV, 1, 32768, H100_SXM) * 1000 == pytest.approx(5.7626, abs=1e-4)
    # Batch 12 at 32k: 15.01 GB + 51.54 GB.
    assert step_bytes(LLAMA_WEIGHTS, LLAMA_KV, 12, 32768) == 66_549_456_896
    assert min_step_s(LLAMA_WEIGHTS, LLAMA_KV, 12, 32768, H100_SXM) * 1000 == pytest.approx(19.865, abs=1e-3)
    # The same through the samples: one request whose one gap holds 32,768 tokens of context.
    one = [sample(0, 32767, 0.0, 0.5, [0.0072])]
    out = roofline(one, facts(LLAMA_WEIGHTS, LLAMA_KV, H100_SXM, None), 7.2)
    assert out is not None
    assert out["batch"] == pytest.approx(1.0) and out["context_tokens"] == pytest.approx(32768)
    assert out["min_step_ms"] == pytest.approx(5.7626, abs=1e-4)
    assert out["pct_of_roofline"] == pytest.approx(5.7626 / 7.2 * 100, abs=1e-2)
    assert out["pct_of_spec_roofline"] is None


@pytest.mark.parametrize("given", [
    None, {}, {**facts(), "weight_bytes": None}, {**facts(), "kv_bytes_per_token": -1},
    {**facts(), "bandwidth": {"measured_bytes_per_s": 0}}, {**facts(), "bandwidth": None},
])
def test_without_the_facts_there_is_no_roofline(given: dict[str, Any] | None) -> None:
    assert roofline(TWO, given, 5.0) is None


def test_no_steady_window_no_roofline_and_no_itl_no_percentage() -> None:
    assert roofline([sample(0, 10, 0.0, 1.0, [])], facts(), 5.0) is None
    out = roofline(TWO, facts(), None)
    assert out is not None and out["pct_of_roofline"] is None and out["achieved_bytes_per_s"] is None


def test_a_stub_run_shows_its_roofline_and_energy(stub_service: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake powercap, so the CPU path reads something on any machine.
    zone = tmp_path / "powercap" / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text("1000\n")
    (zone / "max_energy_range_uj").write_text("262143328850\n")
    monkeypatch.setattr(energy, "POWERCAP_ROOT", tmp_path / "powercap")
    given = facts(16_000_000, 4096, 3.0e12, 3.35e12)
    client = stub_service(env={"STUB_ROOFLINE": json.dumps(given)})
    sweep = client.post("/api/sweeps", json={
        "base": {"output_len": 16, "num_prompts": 8},
        "grid": {"input_len": [128, 256], "max_concurrency": [2]}}).json()
    by_len = {r["spec"]["input_len"]: r["id"] for r in sweep["runs"]}
    assert wait_finished(client, by_len[128])["status"] == "succeeded"
    run_id = by_len[256]
    run = wait_finished(client, run_id)
    assert run["status"] == "succeeded", run["error"]
    assert run["provenance"]["roofline"]["weight_bytes"] == 16_000_000
    r = run["summary"]["roofline"]
    assert r["weight_bytes"] == 16_000_000
    assert 1 <= r["batch"] <= 2 and r["context_tokens"] > 256
    assert r["min_step_ms"] == pytest.approx(r["bytes_per_step"] / 3.0e12 * 1000)
    assert r["pct_of_roofline"] == pytest.approx(
        r["min_step_ms"] / run["summary"]["decode_median_itl_ms"] * 100)
    e = run["summary"]["energy"]
    assert e["available"] is True and e["source"] == "powercap" and e["energy_j"] == 0
    page = client.get(f"/runs/{run_id}").text
    assert "% of measured" in page and "not known" not in page.split("<h2>Roofline</h2>")[1][:200]
    assert "RAPL package energy counters" in page
    export = client.get(f"/api/runs/{run_id}/export").json()
    assert export["decodebench"]["roofline"] == r
    assert export["decodebench"]["energy"]["source"] == "powercap"
    # The sweep draws each concurrency's floor (dashed) beside its decode median ITL.
    sweep_page = client.get(f"/sweeps/{sweep['id']}").text
    assert "roofline min step time (dashed)" in sweep_page
    assert "max_concurrency=2 roofline" in sweep_page and 'stroke-dasharray="5 3"' in sweep_page


def test_a_dashed_series_takes_the_colour_of_the_one_it_bounds() -> None:
    svg = str(charts.lines({"c=1": [(1.0, 5.0), (2.0, 6.0)], "c=2": [(1.0, 9.0)],
                            "c=1 floor": [(1.0, 4.0), (2.0, 4.5)]},
                           "t", "x", "ms", dashed={"c=1 floor": "c=1"}))
    lines = svg.split("<polyline")[1:]
    assert 'stroke="#3b6fd8"' in lines[0] and "dasharray" not in lines[0]
    assert 'stroke="#d8743b"' in lines[1]
    assert 'stroke="#3b6fd8"' in lines[2] and 'stroke-dasharray="5 3"' in lines[2]


def test_a_server_that_did_not_report_its_sizes_has_no_roofline(client: Any) -> None:
    run_id = client.post("/api/runs", json={"input_len": 64, "output_len": 8, "num_prompts": 4,
                                            "max_concurrency": 2}).json()["id"]
    run = wait_finished(client, run_id)
    assert run["status"] == "succeeded", run["error"]
    assert run["provenance"]["roofline"] is None and run["summary"]["roofline"] is None
    assert "energy" in run["summary"]
    page = client.get(f"/runs/{run_id}").text
    assert "not known: the server&#39;s connector did not report its model and KV sizes" in page \
        or "not known: the server's connector did not report its model and KV sizes" in page
    assert client.get(f"/api/runs/{run_id}/export").json()["decodebench"]["roofline"] is None


def test_a_mixture_of_experts_step_reads_only_the_experts_its_batch_touches() -> None:
    # 128 experts, 8 per token: one token touches 8; 4/3 tokens on average touch
    # 128 x (1 - (120/128)^(4/3)) of them. Routed experts hold 800 of the 1000 weight bytes.
    moe = {**facts(), "expert_weight_bytes": 800, "num_experts": 128, "experts_per_token": 8}
    out = roofline(TWO, moe, 5.38)
    assert out is not None
    touched = 128 * (1 - (120 / 128) ** (4 / 3))
    assert out["weight_bytes"] == pytest.approx(200 + 800 * touched / 128)
    assert out["bytes_per_step"] == pytest.approx(out["weight_bytes"] + 1690.0)
    # A dense model of the same bytes reads them all.
    assert roofline(TWO, facts(), 5.38)["weight_bytes"] == 1000  # type: ignore[index]


def test_the_connector_counts_a_mixture_of_experts_routed_weights_apart(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from connector.roofline import counted_params, routing
    from service.core import shapes

    model = "decodebench-shapes/qwen3-30b-a3b"
    config = AutoConfig.from_pretrained(shapes.ensure_shape(tmp_path, model, 1))
    total, experts = counted_params(config)
    # One layer: 128 experts x (gate, up, down) of 2048 x 768.
    assert experts == 128 * 3 * 2048 * 768
    assert total > experts and routing(config) == (128, 8)
    dense = AutoConfig.from_pretrained(shapes.ensure_shape(tmp_path, "decodebench-shapes/smollm2-135m", 2))
    assert counted_params(dense)[1] == 0 and routing(dense) is None
