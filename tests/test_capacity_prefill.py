"""The prefill side of a capacity search: the request rate one prefill server holds under a
TTFT limit, measured with real-prefill runs against a stub that prefills at a known rate, and
the decode servers per prefill server that follow from it."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.analysis import prefill_rate
from service.analysis.capacity import plan_for
from service.analysis.prefill_rate import RATE_TRIAL_CAP, rate_plan
from service.analysis.summary_intervals import summary_intervals
from service.control.capacity import follow_up
from service.core.capacity import CapacityCreate, rate_prompts
from service.core.sample import Sample
from service.core.status import RunStatus
from service.storage import capacity as capacity_store
from service.storage import measurements, store
from service.storage.db import make_engine
from service.storage.tables import Run
from service.web import capacity_view
from tests.conftest import make_settings
from tests.prefill_queue import queue_run, samples_of, simulated_search, sustainable_rate
from tests.test_capacity import BASE, SLA, SLOPED, wait_search


def test_a_measured_prefill_rate_is_what_the_stubs_queue_sustains_and_sizes_decode_servers(
        stub_service: Any) -> None:
    # The stub prefills one request at a time, 0.78125 ms per prompt token: 50 ms for 64
    # tokens, at most 20 requests/s. Poisson arrivals and a p99 TTFT limit of 1 s: a
    # simulation of that queue sustains 17.6 requests/s. A fixed 32 requests a rate read
    # its backlog as a rate; runs of 15 s each (rate x 15 requests) show the queue grow.
    # The limit is 20 service times, not 8 (400 ms, truth 14.2/s): a CI run beside the
    # suite's vLLM servers saw one run at 8 requests/s reach a p99 of 861 ms (the others
    # 263 and 346), the stub's event loop held off the cores, and the start rate failed.
    service_s, limit_ms = 0.050, 1000.0
    nominal = sustainable_rate(service_s, limit_ms / 1000)
    client = stub_service({**SLOPED, "STUB_PREFILL_S_PER_TOKEN": str(service_s / 64)})
    body = {"base": BASE, "input_lens": [64],
            "sla": {"metric": "decode_median_itl_ms", "max_ms": 35}, "max_concurrency": 4,
            "prefill": {"ttft_p99_max_ms": limit_ms, "start_rate": 8, "max_rate": 64, "duration_s": 15,
                        "min_prompts": 50, "precision": 0.1}}
    response = client.post("/api/capacity", json=body)
    assert response.status_code == 201, response.text
    assert response.json()["plan"]["prefill"]["looks"] == 3 * (4 + 3)
    done = wait_search(client, response.json()["id"], timeout=900)

    assert done["status"] == "succeeded", (done["error"], done["contexts"][0]["prefill"]["probes"])
    (context,) = done["contexts"]
    prefill = context["prefill"]
    assert prefill["state"] == "decided" and prefill["error"] is None
    rate, failing = prefill["max_rate"], prefill["first_failing_rate"]
    assert rate < failing <= rate * 1.1
    rates = {p["request_rate"]: p for p in prefill["probes"]}
    assert prefill["runs"] == sum(len(p["run_ids"]) for p in rates.values())
    for r, probe in rates.items():
        runs = [client.get(f"/api/runs/{run_id}").json() for run_id in probe["run_ids"]]
        assert 1 <= len(runs) == probe["trials"] <= RATE_TRIAL_CAP
        assert len({run["spec"]["seed"] for run in runs}) == len(runs)
        for run in runs:
            assert run["capacity_id"] == done["id"] and run["status"] == "succeeded"
            assert (run["spec"]["mode"], run["spec"]["output_len"], run["spec"]["request_rate"],
                    run["spec"]["num_prompts"]) == ("prefill", 1, r, max(50, math.ceil(r * 15)))
        lo, hi = probe["ci_ms"]
        if probe["decided_by"] == "interval":
            assert (hi is not None and hi <= limit_ms) or lo > limit_ms
        elif probe["decided_by"] == "backlog":
            assert probe["verdict"] == "fail" and probe["climb_ms"][0] > limit_ms / 2
        else:
            assert probe["verdict"] == ("pass" if probe["p99_ttft_ms"] <= limit_ms else "fail")
    assert rates[rate]["verdict"] == "pass" and rates[failing]["verdict"] == "fail"
    # Every rate over the queue's by more than 10% failed.
    over = [p for r, p in rates.items() if r > 1.1 * nominal]
    assert over and all(p["verdict"] == "fail" for p in over)
    assert done["runs"] == context["runs"] + prefill["runs"]
    # P / D with P measured: the bracket, D from the boundary's mean TPOT over its trials.
    assert prefill["tokens_per_s_range"] == pytest.approx([64 * rate, 64 * failing])
    ratio = context["decode_servers_per_prefill_server"]
    assert ratio["prefill_source"] == "measured" and ratio["confidence"] is None
    assert ratio["prefill_requests_per_s_range"] == pytest.approx([rate, failing])
    c_max = context["max_concurrency"]
    boundary = next(p for p in context["probes"] if p["concurrency"] == c_max)
    tpots = [client.get(f"/api/runs/{run_id}").json()["summary"]["mean_tpot_ms"]
             for run_id in boundary["run_ids"]]
    assert ratio["tpot_trials"] == len(tpots) >= 2
    assert ratio["tpot_ms"]["value"] == pytest.approx(float(np.mean(tpots)))
    d = ratio["decode_requests_per_s"]
    assert d == pytest.approx(c_max / (8 * float(np.mean(tpots)) / 1000))
    assert ratio["ratio"] == pytest.approx(rate / d)
    # The queue's truth with the service times the stub really took (a busy machine makes
    # its 50 ms longer): the measured rate against it, as above.
    held = [t for w in client.get("/api/workers").json()
            for t in httpx.get(f"{w['url']}/stub/requests").json()["prefill_s"]]
    assert len(held) >= 200 and min(held) >= 0.95 * service_s
    truth = sustainable_rate(np.array(held), limit_ms / 1000)
    # The measured rate is what the queue sustains: never above it by more than 10%
    # (simulated searches of this judge: 0.84-1.08 of the truth, 29 of 30 within [0.85, 1.10]).
    assert 0.75 * truth <= rate <= 1.10 * truth, (truth, prefill["probes"])
    # Its range carries the prefill side's sure range (open at the top where no rate failed
    # by an interval or a backlog) and D's, and holds the truth's P over D. D's bottom is 0
    # where the boundary's range starts at 0 (a fresh-clone CI run on a busy machine: the
    # probes at 1 and 2 passed the 35 ms limit by their point estimates only), and then the
    # top is open too.
    low, high = ratio["ratio_range"]
    sure_low, sure_high = prefill["sure_tokens_per_s_range"]
    d_low, d_high = ratio["decode_requests_per_s_range"]
    assert (d_low == 0) == (context["boundary_range"][0] == 0)
    assert low == pytest.approx(sure_low / 64 / d_high)
    assert (high is None) == (sure_high is None or d_low == 0)
    assert high is None or high == pytest.approx(sure_high / 64 / d_low)
    # The truth is the queue's rate over the service times of the whole search; a busy
    # machine moves them from run to run, and a rate judged while they were longer fails a
    # little under it (a fresh-clone run on 4 workers: P/D 1.71 against a range ending at
    # 1.61). The same 10% the measured rate is held to above.
    assert low <= 1.10 * truth / d and (high is None or truth / d <= 1.10 * high)
    assert ratio["sentence"].startswith(("1 decode server per ", f"{rate / d:.3g} decode server"))
    # The page shows the prefill side, the bracket and the planner's sentence.
    page = html.unescape(client.get(f"/capacity/{done['id']}").text)
    assert "Prefill side (decided):" in page and prefill["statement"] in page
    assert ratio["sentence"] in page and "no single probability is stated" in page
    # What the probes ran on travels with the answer.
    assert done["ran_on"] is not None and done["ran_on"].startswith(BASE.get("model", "decodebench-tiny"))
    assert f"Ran on: {done['ran_on']}" in page
    assert all(f'<a href="/runs/{p["run_id"]}">' in page for p in prefill["probes"])
    # A rate given on the GET answers for it instead.
    given = client.get(f"/api/capacity/{done['id']}", params={"prefill_tokens_per_s": 640}).json()
    assert given["contexts"][0]["decode_servers_per_prefill_server"]["prefill_source"] == "given"


@pytest.mark.parametrize(
    ("prefill", "extra", "where", "named"),
    [
        ({"ttft_p99_max_ms": 0}, {}, ["body", "prefill", "ttft_p99_max_ms"], "greater than or equal to 1"),
        # Found by the fuzzer: rates this small made the doublings to max_rate infinite (a 500).
        ({"ttft_p99_max_ms": 1e-323}, {}, ["body", "prefill", "ttft_p99_max_ms"],
         "greater than or equal to 1"),
        ({"ttft_p99_max_ms": 100, "start_rate": 1e-323, "max_rate": 82004.0}, {},
         ["body", "prefill", "start_rate"], "greater than or equal to 0.001"),
        ({"ttft_p99_max_ms": 100, "start_rate": 8, "max_rate": 4}, {}, ["body", "prefill"],
         "max_rate (4) is below start_rate (8)"),
        ({"ttft_p99_max_ms": 100, "min_prompts": 2}, {}, ["body", "prefill", "min_prompts"], "8"),
        ({"ttft_p99_max_ms": 100, "duration_s": 0.5}, {}, ["body", "prefill", "duration_s"], "1"),
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
    """The prefill run ``run_id`` succeeded with one request per TTFT, a second apart."""
    samples = [Sample(index=i, prompt_len=64, output_tokens=1, ttft=t, itl=[], latency=t,
                      start_time=float(i), success=True) for i, t in enumerate(ttfts_s)]
    measurements.save_samples(engine, run_id, samples)
    summary = {"p99_ttft_ms": float(np.quantile(ttfts_s, 0.99)) * 1000,
               "p99_ttft_ms_ci": summary_intervals(samples)["p99_ttft_ms_ci"]}
    store.transition(engine, run_id, RunStatus.starting)
    store.transition(engine, run_id, RunStatus.running)
    assert store.transition(engine, run_id, RunStatus.succeeded, summary=summary)


def _search(tmp_path: Path, prefill: dict[str, Any]) -> tuple[Any, str, Run]:
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    body = CapacityCreate.model_validate({"base": BASE, "input_lens": [64], "sla": SLA, "max_concurrency": 1,
                                          "prefill": prefill})
    plan = {**plan_for(1).as_dict(), "prefill": rate_plan(body.prefill.start_rate,  # type: ignore[union-attr]
                                                          body.prefill.max_rate, body.prefill.precision)}  # type: ignore[union-attr]
    search = capacity_store.create_search(engine, body, plan)
    first = next(r for r in capacity_store.get_search(engine, search.id)[1] if r.spec["mode"] == "prefill")
    return engine, search.id, first


# Runs of 10 s, at least 40 requests.
SHORT = {"duration_s": 10, "min_prompts": 40}


def _prefill_runs(engine: Any, search_id: str) -> list[Run]:
    return [r for r in capacity_store.get_search(engine, search_id)[1] if r.spec["mode"] == "prefill"]


def test_a_rate_runs_for_its_duration_and_near_the_limit_is_run_again_and_pooled(tmp_path: Path) -> None:
    # 10 s at 1 request/s would be 10 requests: the floor, min_prompts, makes it 40.
    engine, search_id, first = _search(tmp_path, {"ttft_p99_max_ms": 295, **SHORT})
    assert (first.spec["num_prompts"], first.spec["request_rate"]) == (40, 1.0)
    # Its p99 TTFT is under the 295 ms limit and near it; 40 requests cannot bound a p99
    # from above at the plan's confidence, but three runs of them could not either: another
    # run (the next seed), pooled, since one run's p99 near the limit is too noisy alone.
    slow = [float(t) for t in np.random.default_rng(3).permutation(np.linspace(0.10, 0.26, 40))]
    _prefill_ran(engine, first.id, slow)
    assert follow_up(engine, first.id) == 1
    look = capacity_store.get_search(engine, search_id)[0].looks["prefill 64@1"]
    assert look["runs"] == [first.id] and look["figure"][0] < 295
    assert look["figure"][2] is None  # open: too few requests for a top at this confidence
    runs = _prefill_runs(engine, search_id)
    assert [(r.spec["request_rate"], r.spec["seed"]) for r in runs] == [(1.0, 0), (1.0, 1)]
    _prefill_ran(engine, runs[1].id, slow)
    assert follow_up(engine, runs[1].id) == 1
    look = capacity_store.get_search(engine, search_id)[0].looks["prefill 64@1"]
    # Pooled: each run's requests but its first fifth, sent while its queue settled.
    assert look["runs"] == [r.id for r in runs] and look["requests"] == 2 * 32
    assert look["figure"][0] == pytest.approx(1000 * float(np.quantile(slow[8:] + slow[8:], 0.99)))
    runs = _prefill_runs(engine, search_id)
    # At the third run, the cap, the pooled point estimate decides, and the answer says so;
    # the search doubles on, to a run twice as long in requests.
    _prefill_ran(engine, runs[2].id, slow)
    assert follow_up(engine, runs[2].id) == 1
    found = capacity_view.capacity_public(engine, search_id).contexts[0].prefill
    assert found is not None and found.runs == 4
    probe = found.probes[0]
    assert probe.trials == 3 and (probe.verdict, probe.decided_by) == ("pass", "point estimate")
    assert [p.request_rate for p in found.probes] == [1.0, 2.0]
    assert _prefill_runs(engine, search_id)[-1].spec["num_prompts"] == 40
    engine.dispose()


def test_a_rate_far_under_the_limit_that_runs_cannot_bound_passes_by_its_point_estimate_at_once(
        tmp_path: Path) -> None:
    engine, search_id, first = _search(tmp_path, {"ttft_p99_max_ms": 1000, **SHORT})
    _prefill_ran(engine, first.id, [0.1] * 40)
    assert follow_up(engine, first.id) == 1
    found = capacity_view.capacity_public(engine, search_id).contexts[0].prefill
    assert found is not None
    assert (found.probes[0].verdict, found.probes[0].decided_by) == ("pass", "point estimate")
    assert [p.request_rate for p in found.probes] == [1.0, 2.0]
    engine.dispose()


def test_a_run_whose_ttft_climbs_fails_its_rate_though_its_p99_is_under_the_limit(tmp_path: Path) -> None:
    # A queue growing through the run: TTFT from 100 ms up by 5 ms a request, 40 requests a
    # second apart. Its p99 (293 ms) is under the 350 ms limit, but it climbed 195 ms through
    # the run, over half the limit: a backlog, which a longer run would have shown.
    engine, search_id, first = _search(tmp_path, {"ttft_p99_max_ms": 350, **SHORT})
    _prefill_ran(engine, first.id, [0.1 + 0.005 * i for i in range(40)])
    follow_up(engine, first.id)
    found = capacity_view.capacity_public(engine, search_id).contexts[0].prefill
    assert found is not None
    probe = next(p for p in found.probes if p.request_rate == 1.0)
    assert probe.p99_ttft_ms is not None and probe.p99_ttft_ms < 350
    assert (probe.verdict, probe.decided_by) == ("fail", "backlog")
    assert probe.climb_ms is not None and probe.climb_ms[1] > 0
    assert probe.climb_ms[0] == pytest.approx(195, rel=0.01)
    # The start rate failed: the search halves it.
    assert found.state != "stopped" and found.error is None
    assert sorted(p.request_rate for p in found.probes) == [0.5, 1.0]
    engine.dispose()


# --- a prefill server of known rate: the search's answer against the queue's truth ---------



def test_the_measured_rate_is_what_a_known_queue_sustains_not_its_backlog() -> None:
    # One prefill at a time, 0.125 s each (at most 8 requests/s), Poisson arrivals, p99 TTFT
    # limit 1 s: the queue sustains 5.70 requests/s in its steady state. Runs of 60 s (at
    # least 100 requests) bisected to 10%. Measured over these 30 seeds: answers 0.84-1.08
    # of the truth, 29 of 30 within [0.85, 1.10], none above 1.10 (searches of 32 requests a
    # rate, as before, answered up to 1.65 times it); 13.2 runs a search. The bracket of
    # point verdicts held the truth in 11 of 30; the range the interval and backlog verdicts
    # leave (``sure_bracket``) in 29 of 30.
    service_s, limit_s = 0.125, 1.0
    truth = sustainable_rate(service_s, limit_s)
    assert truth == pytest.approx(5.70, abs=0.02)
    prefill: dict[str, Any] = {"ttft_p99_max_ms": limit_s * 1000, "start_rate": 1.0, "max_rate": 64.0,
                               "precision": 0.1, "duration_s": 60.0, "min_prompts": 100}
    prefill.update(rate_plan(1.0, 64.0, 0.1))
    found = [simulated_search(100 + seed, service_s, prefill) for seed in range(30)]
    ratios = np.array([(answer or 0.0) / truth for answer, _, _ in found])
    assert float(np.mean((ratios >= 0.85) & (ratios <= 1.10))) >= 0.85, np.round(ratios, 3)
    assert ratios.max() <= 1.10 and ratios.min() >= 0.7, np.round(ratios, 3)
    assert max(n for _, n, _ in found) <= 18
    assert sum(low <= truth < (high or math.inf) for _, _, (low, high) in found) >= 27
    # The old rule, 32 requests a rate judged by their p99 alone, reads the backlog as a rate.
    old = {**prefill, "duration_s": 0.001, "min_prompts": 32}
    old_ratios = [(answer or 0.0) / truth for answer, _, _ in
                  (simulated_search(100 + seed, service_s, old) for seed in range(10))]
    assert np.median(old_ratios) > 1.2, old_ratios


def test_a_settled_queue_near_its_rate_is_no_backlog_and_a_growing_one_is() -> None:
    rng = np.random.default_rng(7)
    prompts = {rate: rate_prompts(rate, 60.0, 100) for rate in (6.4, 8.8)}
    # At 80% of the server's rate the queue settles: its TTFT rises from empty, then stays.
    settled = [samples_of(*queue_run(6.4, 0.125, prompts[6.4], rng), 2048) for _ in range(5)]
    assert not any(prefill_rate.take_look([s], ["r"], 1000.0, 0.95).backlog for s in settled)
    # At 110% it grows by 0.8 requests a second: 6 s of queue after 60 s.
    growing = samples_of(*queue_run(8.8, 0.125, prompts[8.8], rng), 2048)
    look = prefill_rate.take_look([growing], ["r"], 1000.0, 0.95)
    assert look.backlog and look.climb_ms is not None and look.climb_ms[0] > 3000


def test_a_p99_needs_hundreds_of_independent_requests_to_be_bounded() -> None:
    # The count: "p99 <= X at 95%" (one-sided) needs 299 values, all under X.
    assert prefill_rate.units_to_bound(0.99, 0.90) == 299
    values = np.linspace(0.1, 0.2, 298)
    assert prefill_rate.quantile_bounds(values, 0.99, 0.90)[1] is None
    assert prefill_rate.quantile_bounds(np.linspace(0.1, 0.2, 299), 0.99, 0.90)[1] == pytest.approx(0.2)
    # Dependent values count for less: the same 299 read as 100 effective ones bound nothing.
    assert prefill_rate.quantile_bounds(np.linspace(0.1, 0.2, 299), 0.99, 0.90, effective=100)[1] is None
