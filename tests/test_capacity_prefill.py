"""The prefill side of a capacity search: the request rate one prefill server holds under a
TTFT limit, measured with real-prefill runs against a stub that prefills at a known rate, and
the decode servers per prefill server that follow from it."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.analysis.capacity import plan_for
from service.analysis.intervals import pooled_quantile_ci
from service.analysis.prefill_rate import RATE_TRIAL_CAP
from service.analysis.summary_intervals import summary_intervals
from service.control.capacity import follow_up
from service.core.capacity import CapacityCreate
from service.core.sample import Sample
from service.core.status import RunStatus
from service.storage import capacity as capacity_store
from service.storage import measurements, store
from service.storage.db import make_engine
from service.web import capacity_view
from tests.conftest import make_settings
from tests.test_capacity import BASE, SLA, SLOPED, wait_search


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
