"""Capacity searches through the service, against stub servers whose inter-token time
grows with the streams they run: a known boundary."""

from __future__ import annotations

import html
import io
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.analysis.capacity import capped_reason, plan_for
from service.analysis.intervals import pooled_quantile_ci
from service.analysis.prefill_rate import RATE_TRIAL_CAP
from service.analysis.summary_intervals import summary_intervals
from service.control.capacity import follow_up
from service.core.capacity import SLA_METRICS, CapacityCreate
from service.core.sample import Sample
from service.core.status import RunStatus
from service.storage import capacity as capacity_store
from service.storage import measurements, store
from service.storage.db import make_engine
from service.web import capacity_view
from tests.conftest import AUTH, ServedTestClient, make_settings, wait_for

ENDED = {"succeeded", "failed", "cancelled"}
# Inter-token time 10 ms + 10 ms per running stream: 60 ms at 5 streams, 70 ms at 6. A
# limit of 65 ms on the median puts the boundary at 5, 5 ms from either side.
SLOPED = {"STUB_TOKEN_INTERVAL_S": "0.010", "STUB_ITL_SLOPE_S": "0.010"}
BASE = {"output_len": 8}
SLA = {"metric": "decode_median_itl_ms", "max_ms": 65}


def wait_search(client: TestClient, search_id: str, timeout: float = 240) -> dict[str, Any]:
    """Poll a search until it has ended; fail the test on timeout."""
    deadline = time.monotonic() + timeout
    found: dict[str, Any] = {}
    while time.monotonic() < deadline:
        found = client.get(f"/api/capacity/{search_id}").json()
        if found["status"] in ENDED:
            return found
        time.sleep(0.2)
    raise AssertionError(f"search {search_id} did not end in {timeout} s; last seen: {found}")


def probes_of(context: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["concurrency"]: p for p in context["probes"]}


def test_the_search_finds_the_stub_boundary_exactly_and_counts_its_runs(stub_service: Any) -> None:
    client = stub_service(SLOPED)
    body = {"base": BASE, "input_lens": [64], "sla": SLA, "max_concurrency": 16,
            "prefill_tokens_per_s": 6400}
    response = client.post("/api/capacity", json=body)
    assert response.status_code == 201, response.text
    search = response.json()
    assert search["status"] in ("queued", "running") and search["plan"]["ceiling"] == 16
    done = wait_search(client, search["id"])

    assert done["status"] == "succeeded", done
    (context,) = done["contexts"]
    assert context["decided"] and context["state"] == "decided"
    assert (context["max_concurrency"], context["first_failing"]) == (5, 6)
    assert context["limited_by"] == "sla" and context["boundary_range"] == [5, 5]
    assert context["confidence"] == 0.95 and "with 95% confidence it is 5" in context["statement"]
    probes = probes_of(context)
    # Doubling to the first fail, then bisecting: 1 2 4 8, 6 5.
    assert set(probes) == {1, 2, 4, 5, 6, 8}
    assert [probes[c]["verdict"] for c in (1, 2, 4, 5)] == ["pass"] * 4
    assert probes[6]["verdict"] == probes[8]["verdict"] == "fail"
    assert probes[5]["trials"] >= 2 and probes[6]["trials"] >= 2
    assert all(p["decided_by"] == "interval" for p in probes.values())
    assert probes[5]["ci_ms"][1] <= 65 < probes[6]["ci_ms"][0]
    assert probes[5]["confidence"] == pytest.approx(done["plan"]["per_look_confidence"])
    # Every run it spent is counted, each one a probe run linked to the search.
    run_ids = [r for p in probes.values() for r in p["run_ids"]]
    assert context["runs"] == done["runs"] == len(run_ids) == len(set(run_ids))
    assert context["runs"] <= 10  # against 30 for a scan of 10 levels x 3 trials
    for run_id in probes[5]["run_ids"]:
        run = client.get(f"/api/runs/{run_id}").json()
        assert run["capacity_id"] == search["id"] and run["status"] == "succeeded"
        assert run["spec"]["max_concurrency"] == 5 and run["spec"]["num_prompts"] == 20
    # The decode rates at the boundary: 5 streams, each a token per ~60 ms. The rate is
    # 1 / the median TPOT (a request's mean gap), which a busy machine's stalls stretch more
    # than the median ITL the SLA holds: 65.3 ms was seen while that ITL passed 65.
    per_user = context["tokens_per_s_per_user"]
    assert 1000 / 80 < per_user["value"] < 1000 / 55
    assert context["tokens_per_s_per_server"]["value"] == pytest.approx(5 * per_user["value"])
    assert context["wall_s"] > 0 and done["finished_at"] is not None
    # Each probe's rates, the frontier's points: per server rises with concurrency while
    # per user falls, and the boundary's are the context's.
    passed = [probes[c] for c in (1, 2, 4, 5)]
    users = [p["tokens_per_s_per_user"]["value"] for p in passed]
    servers = [p["tokens_per_s_per_server"]["value"] for p in passed]
    assert users == sorted(users, reverse=True) and servers == sorted(servers)
    assert probes[5]["tokens_per_s_per_user"] == per_user
    # Decode servers per prefill server: P = 6400 / 64 = 100 req/s; D = 5 / (8 x TPOT).
    ratio = context["decode_servers_per_prefill_server"]
    assert ratio["prefill_requests_per_s"] == pytest.approx(100)
    assert (ratio["max_concurrency"], ratio["output_len"], ratio["input_len"]) == (5, 8, 64)
    assert ratio["tpot_ms"]["value"] == pytest.approx(1000 / per_user["value"])
    d = ratio["decode_requests_per_s"]
    assert d["value"] == pytest.approx(5 / (8 * ratio["tpot_ms"]["value"] / 1000))
    assert ratio["ratio"]["value"] == pytest.approx(100 / d["value"])
    assert ratio["ratio"]["ci"][0] <= ratio["ratio"]["value"] <= ratio["ratio"]["ci"][1]
    assert "P = 6400 tok/s / 64 = 100 req/s" in ratio["formula"]
    # A prefill rate asked on the GET answers for it instead; and without any, no ratio.
    other = client.get(f"/api/capacity/{search['id']}", params={"prefill_tokens_per_s": 3200}).json()
    assert other["contexts"][0]["decode_servers_per_prefill_server"]["ratio"]["value"] == \
        pytest.approx(ratio["ratio"]["value"] / 2)
    assert client.get(f"/api/capacity/{search['id']}", params={"prefill_tokens_per_s": 0}).status_code == 422
    listed = client.get("/api/capacity").json()
    assert listed["total"] == 1 and listed["searches"][0]["status"] == "succeeded"
    assert sum(listed["searches"][0]["runs"].values()) == context["runs"]


def test_a_measured_prefill_rate_sizes_decode_servers_per_prefill_server(stub_service: Any) -> None:
    # One prefill at a time, 2.5 ms per prompt token: 160 ms for 64 tokens, so the stub
    # prefills at most 6.25 requests/s; near-regular arrivals (burstiness 100) keep the
    # TTFT near 160 ms (plus the machine's noise) below that rate, and above it requests
    # queue and TTFT grows with each.
    client = stub_service({**SLOPED, "STUB_PREFILL_S_PER_TOKEN": "0.0025"})
    body = {"base": {**BASE, "burstiness": 100.0}, "input_lens": [64],
            "sla": {"metric": "decode_median_itl_ms", "max_ms": 35}, "max_concurrency": 4,
            "prefill": {"ttft_p99_max_ms": 600, "start_rate": 2, "num_prompts": 12}}
    response = client.post("/api/capacity", json=body)
    assert response.status_code == 201, response.text
    done = wait_search(client, response.json()["id"])

    assert done["status"] == "succeeded", (done["error"], done["contexts"][0]["prefill"]["probes"])
    (context,) = done["contexts"]
    assert (context["max_concurrency"], context["first_failing"]) == (2, 3)
    prefill = context["prefill"]
    assert prefill["state"] == "decided" and prefill["error"] is None
    rate, failing = prefill["max_rate"], prefill["first_failing_rate"]
    # No rate well above what the stub prefills can pass; noise may fail one below it.
    assert 6.25 / 4 <= rate < failing and rate <= 6.25 * 1.5, prefill["probes"]
    assert failing <= rate * 1.25  # bisected to the asked precision
    # Each rate is real-prefill runs of one output token at that rate (each its own seed),
    # judged by the interval of its p99 TTFT: wholly under the limit passes, wholly over
    # fails, else another run, pooled, up to the cap, where the point estimate decides.
    rates = {p["request_rate"]: p for p in prefill["probes"]}
    assert {2, 4} <= set(rates) and prefill["runs"] == sum(len(p["run_ids"]) for p in rates.values())
    for r, probe in rates.items():
        runs = [client.get(f"/api/runs/{run_id}").json() for run_id in probe["run_ids"]]
        assert 1 <= len(runs) == probe["trials"] <= RATE_TRIAL_CAP
        assert len({run["spec"]["seed"] for run in runs}) == len(runs)
        for run in runs:
            assert run["capacity_id"] == done["id"] and run["status"] == "succeeded"
            assert (run["spec"]["mode"], run["spec"]["output_len"], run["spec"]["request_rate"],
                    run["spec"]["num_prompts"]) == ("prefill", 1, r, 12)
        if len(runs) == 1:
            assert probe["p99_ttft_ms"] == runs[0]["summary"]["p99_ttft_ms"]
            assert probe["ci_ms"] == runs[0]["summary"]["p99_ttft_ms_ci"]
        lo, hi = probe["ci_ms"]
        if probe["decided_by"] == "interval":
            assert probe["verdict"] == ("pass" if hi <= 600 else "fail") and (hi <= 600 or lo > 600)
        else:
            assert probe["trials"] == RATE_TRIAL_CAP and lo <= 600 < hi
            assert probe["verdict"] == ("pass" if probe["p99_ttft_ms"] <= 600 else "fail")
    assert rates[rate]["verdict"] == "pass" and rates[failing]["verdict"] == "fail"
    # The decode probes are counted apart from the prefill runs.
    assert done["runs"] == context["runs"] + prefill["runs"]
    # P / D with P measured: the bracket of prefill tokens/s carries into the ratio.
    assert prefill["tokens_per_s"] == pytest.approx(64 * rate)
    assert prefill["tokens_per_s_range"] == pytest.approx([64 * rate, 64 * failing])
    ratio = context["decode_servers_per_prefill_server"]
    assert ratio["prefill_source"] == "measured"
    assert ratio["prefill_requests_per_s_range"] == pytest.approx([rate, failing])
    d = ratio["decode_requests_per_s"]
    assert d["value"] == pytest.approx(2 / (8 * ratio["tpot_ms"]["value"] / 1000))
    assert ratio["ratio"]["value"] == pytest.approx(rate / d["value"])
    assert ratio["ratio"]["ci"] == pytest.approx([rate / d["ci"][1], failing / d["ci"][0]])
    assert f"P = {64 * rate:.4g} tok/s (measured" in ratio["formula"]
    # The page shows the prefill side's rates, the bracket and the formula with it.
    page = client.get(f"/capacity/{done['id']}").text
    assert "Prefill side (decided):" in page and prefill["statement"] in html.unescape(page)
    assert "(measured: the rate where the TTFT limit is crossed lies in" in page
    assert all(f'<a href="/runs/{p["run_id"]}">' in page for p in prefill["probes"])
    # A rate given on the GET answers for it instead.
    given = client.get(f"/api/capacity/{done['id']}", params={"prefill_tokens_per_s": 640}).json()
    assert given["contexts"][0]["decode_servers_per_prefill_server"]["prefill_source"] == "given"


@pytest.mark.parametrize(
    ("prefill", "extra", "where", "named"),
    [
        ({"ttft_p99_max_ms": 0}, {}, ["body", "prefill", "ttft_p99_max_ms"], "greater than 0"),
        ({"ttft_p99_max_ms": 100, "start_rate": 8, "max_rate": 4}, {}, ["body", "prefill"],
         "max_rate (4) is below start_rate (8)"),
        ({"ttft_p99_max_ms": 100, "num_prompts": 2}, {}, ["body", "prefill", "num_prompts"], "8"),
        ({"ttft_p99_max_ms": 100, "rate": 3}, {}, ["body", "prefill", "rate"], "did you mean 'max_rate'"),
        ({"ttft_p99_max_ms": 100}, {"prefill_tokens_per_s": 1000}, ["body"],
         "give one of them, not both"),
    ],
)
def test_bad_prefill_input_is_a_422_naming_the_field(client: TestClient, prefill: dict[str, Any],
                                                     extra: dict[str, Any], where: list[str],
                                                     named: str) -> None:
    body = {"base": BASE, "input_lens": [64], "sla": SLA, "prefill": prefill, **extra}
    response = client.post("/api/capacity", json=body)
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == where and named in error["msg"], error
    if where == ["body"]:
        assert "prefill_tokens_per_s" in error["msg"] and "prefill" in error["msg"]
    assert client.get("/api/runs").json()["total"] == 0


def test_a_probe_the_server_capped_is_reported_capped_and_bounds_the_search(stub_service: Any) -> None:
    # The server runs at most 3 streams and says so nowhere but in its queue: the probe at
    # 4 is neither pass nor fail, and the answer is 3, what the server held.
    client = stub_service({**SLOPED, "STUB_MAX_RUNNING": "3"})
    body = {"base": BASE, "input_lens": [64], "sla": SLA, "max_concurrency": 16}
    done = wait_search(client, client.post("/api/capacity", json=body).json()["id"])

    (context,) = done["contexts"]
    probes = probes_of(context)
    assert probes[4]["verdict"] == "capped" and "queued_in_server" in probes[4]["capped"]
    assert probes[4]["figure_ms"] is None and probes[4]["decided_by"] is None
    assert set(probes) == {1, 2, 3, 4}
    assert (context["max_concurrency"], context["first_failing"]) == (3, None)
    assert context["limited_by"] == "capped" and "the probe at 4 was capped" in context["limit_reason"]
    assert context["decided"] and probes[3]["trials"] == 2


def test_the_vllm_sweep_export_is_drawn_by_vllms_plot_pareto_without_the_capped_probe(
        stub_service: Any, tmp_path: Path) -> None:
    client = stub_service({**SLOPED, "STUB_MAX_RUNNING": "3"})
    body = {"base": BASE, "input_lens": [64], "sla": SLA, "max_concurrency": 16}
    done = wait_search(client, client.post("/api/capacity", json=body).json()["id"])
    probes = probes_of(done["contexts"][0])
    assert probes[4]["verdict"] == "capped"

    response = client.get(f"/api/capacity/{done['id']}/export", params={"format": "vllm-sweep"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/zip"
    assert (response.headers["content-disposition"]
            == f'attachment; filename="decodebench-{done["id"]}-vllm-sweep.zip"')
    directory = tmp_path / "experiment"
    zipfile.ZipFile(io.BytesIO(response.content)).extractall(directory)
    folder = "SERVE--tensor_parallel_size=1-BENCH--random_input_len=64-max_concurrency={}"
    # A folder per probe, a record per trial that measured; the capped probe's run is a
    # failure with the reason, never a point at a concurrency the server did not run.
    for c in (1, 2, 3):
        trials = json.loads((directory / folder.format(c) / "summary.json").read_text())
        assert [t["label"] for t in trials] == probes[c]["run_ids"]
        assert {(t["max_concurrency"], t["random_input_len"]) for t in trials} == {(c, 64)}
    capped = directory / folder.format(4)
    assert not (capped / "summary.json").exists()
    failure = json.loads((capped / "run=0.failure.json").read_text())
    assert failure["error_type"] == "held_out" and "the probe at 4 was capped" in failure["error"]
    assert failure["run_id"] == probes[4]["run_ids"][0]

    # vLLM's own plot_pareto (the installed one) reads it and draws the frontier.
    points = sum(probes[c]["trials"] for c in (1, 2, 3))
    drawn = subprocess.run([sys.executable, "-m", "vllm.benchmarks.sweep.plot_pareto", str(directory)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    assert f"Plotted {points} points" in drawn.stdout
    assert (directory / "pareto" / "PARETO.png").read_bytes().startswith(b"\x89PNG")


def test_a_vllm_sweep_export_before_any_probe_measured_is_409(stub_service: Any) -> None:
    client = stub_service({"STUB_TOKEN_INTERVAL_S": "0.05"})
    search = client.post("/api/capacity", json={"base": {"output_len": 64}, "input_lens": [64],
                                                "sla": SLA}).json()
    response = client.get(f"/api/capacity/{search['id']}/export", params={"format": "vllm-sweep"})
    assert response.status_code == 409 and "nothing to export" in response.json()["detail"]
    client.post(f"/api/capacity/{search['id']}/cancel")


def test_the_servers_max_num_seqs_bounds_the_search_before_it_probes_above(stub_service: Any) -> None:
    client = stub_service(SLOPED)
    base = {**BASE, "engine": {"extra_args": ["--max-num-seqs=3"]}}
    body = {"base": base, "input_lens": [64], "sla": SLA, "max_concurrency": 16}
    done = wait_search(client, client.post("/api/capacity", json=body).json()["id"])

    (context,) = done["contexts"]
    assert set(probes_of(context)) == {1, 2, 3}
    assert (context["max_concurrency"], context["limited_by"]) == (3, "max_num_seqs")
    assert "max_num_seqs is 3" in context["limit_reason"]


def test_the_kv_cache_bounds_the_bracket_and_a_batch_it_cannot_hold_is_refused(stub_service: Any) -> None:
    # 100 blocks of 16: 1,600 tokens. 300 + 8 tokens a request: 5 fit; 2,000 + 8: none.
    client = stub_service({"STUB_TOKEN_INTERVAL_S": "0.002", "STUB_KV_BLOCKS": "100"})
    body = {"base": BASE, "input_lens": [300, 2000], "sla": SLA}
    done = wait_search(client, client.post("/api/capacity", json=body).json()["id"])

    fits, too_long = done["contexts"]
    assert set(probes_of(fits)) == {1, 2, 4, 5}
    assert (fits["max_concurrency"], fits["limited_by"]) == (5, "kv_cache")
    assert "holds 1,600 tokens: 5 requests of 308 tokens" in fits["limit_reason"]
    assert done["plan"]["ceiling"] == 1024  # the default, not reached
    (refused,) = too_long["probes"]
    # vLLM fits its max_model_len to that cache (auto-fit): the run is longer than that.
    assert refused["verdict"] == "refused" and "2008 tokens > 1584" in refused["refused"]
    assert (too_long["max_concurrency"], too_long["limited_by"], too_long["decided"]) == (0, "refused", True)
    assert "2008 tokens > 1584" in too_long["limit_reason"]
    assert done["status"] == "succeeded" and done["runs"] == 6


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"input_lens": []}, ["body", "input_lens"]),
        ({"sla": {"metric": "decode_median_itl_ms", "max_ms": 0}}, ["body", "sla", "max_ms"]),
        ({"sla": {"metric": "p99_e2el_ms", "max_ms": 50}}, ["body", "sla", "metric"]),
        ({"max_concurrency": 0}, ["body", "max_concurrency"]),
        ({"base": {"max_concurrency": 8}}, ["body", "base"]),
        ({"input_lens": [64, 64]}, ["body", "input_lens"]),
    ],
)
def test_bad_input_is_a_422_naming_the_field_and_starts_nothing(
        client: TestClient, change: dict[str, Any], where: list[str]) -> None:
    body = {"base": BASE, "input_lens": [64], "sla": SLA, **change}
    response = client.post("/api/capacity", json=body)
    assert response.status_code == 422, response.text
    assert [e["loc"] for e in response.json()["detail"]] == [where]
    assert client.get("/api/capacity").json()["total"] == 0
    assert client.get("/api/runs").json()["total"] == 0


def test_an_unknown_metric_is_refused_with_the_ones_there_are(client: TestClient) -> None:
    body = {"base": BASE, "input_lens": [64], "sla": {"metric": "p99_e2el_ms", "max_ms": 50}}
    (error,) = client.post("/api/capacity", json=body).json()["detail"]
    assert all(m in error["msg"] for m in SLA_METRICS)


def test_an_input_length_the_model_cannot_take_is_a_422(client: TestClient) -> None:
    body = {"base": BASE, "input_lens": [64, 200_000], "sla": SLA}
    response = client.post("/api/capacity", json=body)
    assert response.status_code == 422 and "input_lens: 200000" in response.text


def test_cancel_stops_the_search_and_delete_then_removes_it(stub_service: Any) -> None:
    client = stub_service({"STUB_TOKEN_INTERVAL_S": "0.05"})
    body = {"base": {"output_len": 64}, "input_lens": [64, 128], "sla": SLA}
    search = client.post("/api/capacity", json=body).json()
    first = search["contexts"][0]["probes"][0]["run_ids"][0]
    wait_for(client, first, lambda r: r["status"] == "running" and r["progress"]["completed"] > 0)
    refused = client.delete(f"/api/capacity/{search['id']}")
    assert refused.status_code == 409 and "cancel it first" in refused.json()["detail"]

    response = client.post(f"/api/capacity/{search['id']}/cancel")
    assert response.status_code == 200, response.text
    cancelled = response.json()
    assert cancelled["status"] == "cancelled" and cancelled["error"] == "cancelled by the user"
    run_ids = [r for c in cancelled["contexts"] for p in c["probes"] for r in p["run_ids"]]
    assert len(run_ids) == 2
    assert {client.get(f"/api/runs/{r}").json()["status"] for r in run_ids} == {"cancelled"}
    assert client.get(f"/api/runs/{first}/requests").json()  # what it measured is kept
    again = client.post(f"/api/capacity/{search['id']}/cancel")
    assert again.status_code == 409 and "nothing to cancel" in again.json()["detail"]
    time.sleep(0.5)  # the look after the cancelled runs queues nothing
    assert client.get(f"/api/capacity/{search['id']}").json()["runs"] == 2

    assert client.delete(f"/api/capacity/{search['id']}").status_code == 204
    assert client.get(f"/api/capacity/{search['id']}").status_code == 404
    assert all(client.get(f"/api/runs/{r}").status_code == 404 for r in run_ids)
    assert client.get("/api/capacity").json()["total"] == 0


def test_cancel_and_delete_of_an_unknown_search_are_404_in_the_one_shape(client: TestClient) -> None:
    for response in (client.get("/api/capacity/c-nope"), client.post("/api/capacity/c-nope/cancel"),
                     client.delete("/api/capacity/c-nope")):
        assert response.status_code == 404
        assert response.json() == {"detail": "capacity search 'c-nope' not found"}


def test_a_probe_that_ended_while_the_service_was_down_is_looked_at_on_start(tmp_path: Path) -> None:
    # The first probe failed (the service stopped during it) before its look was taken:
    # the next start takes the look, which tries that probe again.
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    body = CapacityCreate.model_validate({"base": BASE, "input_lens": [64], "sla": SLA,
                                          "max_concurrency": 4})
    search = capacity_store.create_search(engine, body, plan_for(4).as_dict())
    (run,) = capacity_store.get_search(engine, search.id)[1]
    store.transition(engine, run.id, RunStatus.starting)
    store.transition(engine, run.id, RunStatus.failed, error="the service stopped")
    engine.dispose()
    with ServedTestClient(settings, headers=AUTH) as client:
        found = client.get(f"/api/capacity/{search.id}").json()
        (probe,) = found["contexts"][0]["probes"]
        assert probe["concurrency"] == 1 and len(probe["run_ids"]) == 2
        assert probe["run_ids"][0] == run.id
        client.post(f"/api/capacity/{search.id}/cancel")


def test_a_server_whose_max_num_seqs_is_below_the_probe_caps_it() -> None:
    provenance = {"engine": {"max_num_seqs": 3}}
    assert capped_reason(4, [], provenance) == (
        "the server's max_num_seqs is 3: it runs at most 3 requests at once, fewer than 4")
    assert capped_reason(3, [], provenance) is None
    preempted = [{"code": "preempted", "message": "vLLM preempted requests 2 times", "figure": 2}]
    assert capped_reason(3, preempted, provenance) == "preempted: vLLM preempted requests 2 times"


def _prefill_ran(engine: Any, run_id: str, ttfts_s: list[float]) -> None:
    """The prefill run ``run_id`` succeeded with one request per TTFT, its summary's p99
    TTFT and interval as a run's summary carries them."""
    samples = [Sample(index=i, prompt_len=64, output_tokens=1, ttft=t, itl=[], latency=t,
                      start_time=float(i), success=True) for i, t in enumerate(ttfts_s)]
    measurements.save_samples(engine, run_id, samples)
    summary = {"p99_ttft_ms": float(np.quantile(ttfts_s, 0.99)) * 1000,
               "p99_ttft_ms_ci": summary_intervals(samples)["p99_ttft_ms_ci"]}
    store.transition(engine, run_id, RunStatus.starting)
    store.transition(engine, run_id, RunStatus.running)
    assert store.transition(engine, run_id, RunStatus.succeeded, summary=summary)


FIRST = [0.10, 0.11, 0.12, 0.13, 0.14, 0.15, 0.15, 0.30]


def test_a_prefill_rate_whose_interval_straddles_the_limit_is_run_again_and_pooled(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    body = CapacityCreate.model_validate({"base": BASE, "input_lens": [64], "sla": SLA, "max_concurrency": 1,
                                          "prefill": {"ttft_p99_max_ms": 295, "num_prompts": 8}})
    search = capacity_store.create_search(engine, body, plan_for(1).as_dict())
    first = next(r for r in capacity_store.get_search(engine, search.id)[1] if r.spec["mode"] == "prefill")
    # Its p99 TTFT (about 290 ms, the slowest request's 300 pulls it) is under the 295 ms
    # limit, its interval is not: one more run at that rate, with the next seed (other
    # prompts, other arrivals).
    _prefill_ran(engine, first.id, FIRST)
    probe = capacity_view.capacity_public(engine, search.id).contexts[0].prefill.probes[0]  # type: ignore[union-attr]
    lo, hi = probe.ci_ms or [0.0, 0.0]
    assert probe.verdict == "undecided" and probe.p99_ttft_ms < 295 and lo <= 295 < hi
    assert follow_up(engine, first.id) == 1
    runs = [r for r in capacity_store.get_search(engine, search.id)[1] if r.spec["mode"] == "prefill"]
    assert [(r.spec["request_rate"], r.spec["seed"]) for r in runs] == [(1.0, 0), (1.0, 1)]
    # The second run's requests pool with the first's: the look holds the p99 and interval
    # of all 16 requests; the slowest one still keeps the interval over the limit: a third run.
    second = [0.10, 0.11, 0.12, 0.13, 0.14, 0.15, 0.16, 0.17]
    _prefill_ran(engine, runs[1].id, second)
    assert follow_up(engine, runs[1].id) == 1
    pooled = pooled_quantile_ci([[t] for t in [*FIRST, *second]], 0.99)
    assert pooled is not None and pooled.lo * 1000 <= 295 < pooled.hi * 1000
    look = capacity_store.get_search(engine, search.id)[0].looks["prefill 64@1"]
    assert look["runs"] == [r.id for r in runs]
    assert look["figure"] == pytest.approx([1000 * pooled.value, 1000 * pooled.lo, 1000 * pooled.hi])
    runs = [r for r in capacity_store.get_search(engine, search.id)[1] if r.spec["mode"] == "prefill"]
    assert [(r.spec["request_rate"], r.spec["seed"]) for r in runs] == [(1.0, 0), (1.0, 1), (1.0, 2)]
    # At the third run, the cap, the pooled point estimate decides, and the answer says so;
    # the search doubles on.
    _prefill_ran(engine, runs[2].id, second)
    assert follow_up(engine, runs[2].id) == 1
    found = capacity_view.capacity_public(engine, search.id).contexts[0].prefill
    assert found is not None and found.runs == 4
    probe = found.probes[0]
    assert probe.trials == 3 and probe.run_ids == [r.id for r in runs]
    assert (probe.verdict, probe.decided_by) == ("pass", "point estimate")
    assert probe.p99_ttft_ms is not None and probe.p99_ttft_ms < 295
    assert [p.request_rate for p in found.probes] == [1.0, 2.0]
    engine.dispose()
