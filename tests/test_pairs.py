"""Pairs of fill/prefill trials: their order in the queue, the paired interval, how many
pairs would decide, one pair's wording, adding trials and the ``until_decided`` rule."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from scipy import stats

from service.analysis.comparison import BY_KEY, Arm, change
from service.analysis.fill_verdict import by_the_rule
from service.analysis.intervals import CONFIDENCE
from service.analysis.pairs import PAIRED, pair_looks, pairs_needed, ratio_by_pairs
from service.control import queue, until_decided
from service.control.until_decided import follow_up
from service.core.status import RunStatus
from service.core.sweep import SweepCreate, TrialsCreate
from service.storage import store, sweeps
from service.storage.db import make_engine
from service.storage.tables import Run
from service.web.sweep_view import sweep_public
from tests.conftest import AUTH, ServedTestClient, make_client, make_settings, wait_finished, wait_until

BASE = {"input_len": 16, "output_len": 6, "num_prompts": 4, "max_concurrency": 2}
KEYS = ("decode_median_itl_ms", "decode_median_tpot_ms")


def test_a_sweep_over_mode_runs_each_pair_back_to_back(stub_service: Callable[..., TestClient]) -> None:
    # A token every 20 ms, not the stub's 2 ms: on a busy CI machine the client once read a
    # 2 ms stream's last five tokens in one read, so that prefill run's decode median ITL was
    # 0 ms and its pair had no ratio to check.
    client = stub_service({"STUB_TOKEN_INTERVAL_S": "0.02"})
    # Mode first in the grid: the grid's own order would queue both fill points first.
    body = {"base": {**BASE, "seed": 7}, "grid": {"mode": ["fill", "prefill"], "input_len": [8, 16]},
            "repeats": 2}
    sweep = client.post("/api/sweeps", json=body).json()
    runs = sweep["runs"]
    assert len(runs) == 8 and len({r["pair_id"] for r in runs}) == 4
    for i in range(0, 8, 2):
        first, second = runs[i], runs[i + 1]
        assert first["pair_id"] == second["pair_id"] and first["pair_id"].startswith("p-")
        assert {first["spec"]["mode"], second["spec"]["mode"]} == {"fill", "prefill"}
        assert first["spec"]["input_len"] == second["spec"]["input_len"]
        assert (first["pair_order"], second["pair_order"]) == (0, 1)
        # Pair k of every point before pair k + 1 of any; pair k has its own seed.
        assert first["trial"] == second["trial"] == i // 4
        assert first["spec"]["seed"] == second["spec"]["seed"] == 7 + i // 4
    done = [wait_finished(client, r["id"]) for r in runs]
    assert all(r["status"] == "succeeded" for r in done)
    started = sorted(done, key=lambda r: r["started_at"])
    assert [r["id"] for r in started] == [r["id"] for r in runs]

    verdicts = client.get(f"/api/sweeps/{sweep['id']}").json()["fill_vs_prefill"]
    assert len(verdicts) == 2
    for verdict in verdicts:
        assert verdict["pairs"] == 2 and not verdict["one_pair"]
        assert verdict["line"].startswith(f"{verdict['verdict']} over 2 pairs: "), verdict["line"]
        by_pair: dict[str, dict[str, Any]] = {}
        for r in done:
            if r["spec"]["input_len"] == verdict["point"]["input_len"]:
                by_pair.setdefault(r["pair_id"], {})[r["spec"]["mode"]] = r["summary"]
        for key, found in zip(KEYS, verdict["ratios"], strict=True):
            d = [math.log(p["fill"][key] / p["prefill"][key]) for p in by_pair.values()]
            assert found["method"] == PAIRED and found["pairs"] == 2
            assert found["ratio"] == pytest.approx(math.exp(np.mean(d)))
            if np.std(d) > 0:
                ci = stats.ttest_1samp(d, 0.0).confidence_interval(0.95)
                assert found["ci"] == pytest.approx([math.exp(ci.low), math.exp(ci.high)])
        # Compare of the two arms that ran as pairs gives the same paired interval.
        compared = client.get(f"/api/compare?ids={verdict['prefill']}&ids={verdict['fill']}").json()
        row = next(m for m in compared["metrics"] if m["metric"] == KEYS[0])
        assert row["changes"][0]["method"] == PAIRED and row["changes"][0]["across_runs"] is True
        assert row["changes"][0]["ci"] == pytest.approx(verdict["ratios"][0]["ci"])


def test_a_pairs_second_run_follows_its_first_however_slow_the_first_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What follows a sweep's run once its server is idle again (its sweep's look) takes a
    # second here, as a busy machine can make it: the next pair's run must not take the
    # server meanwhile, ahead of this pair's second.
    def slow_follow_up(engine: Any, run_id: str) -> int:
        time.sleep(1)
        return follow_up(engine, run_id)

    monkeypatch.setattr(queue, "follow_up", slow_follow_up)
    body = {"base": {**BASE, "seed": 7}, "grid": {"mode": ["fill", "prefill"], "input_len": [8, 16]}}
    with make_client(tmp_path) as client:
        runs = client.post("/api/sweeps", json=body).json()["runs"]
        done = [wait_finished(client, r["id"]) for r in runs]
    assert all(r["status"] == "succeeded" for r in done)
    started = sorted(done, key=lambda r: r["started_at"])
    assert [r["id"] for r in started] == [r["id"] for r in runs]


def test_the_order_in_a_pair_is_drawn_and_recorded(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "db.sqlite")
    body = SweepCreate.model_validate({"base": BASE, "grid": {"input_len": list(range(8, 16)),
                                                              "mode": ["fill", "prefill"]},
                                       "repeats": 4})
    sweep = sweeps.create_sweep(engine, body, random.Random(3))
    _, runs = sweeps.get_sweep(engine, sweep.id)  # in queue order
    firsts = [r.spec["mode"] for r in runs[::2]]
    assert len(firsts) == 32 and 8 < firsts.count("fill") < 24
    assert all(r.pair_order == 0 for r in runs[::2]) and all(r.pair_order == 1 for r in runs[1::2])
    again = sweeps.create_sweep(engine, body, random.Random(3))
    assert [r.spec["mode"] for r in sweeps.get_sweep(engine, again.id)[1][::2]] == firsts


def test_paired_interval_is_scipys_paired_t_on_the_logs() -> None:
    rng = np.random.default_rng(1)
    prefill = rng.uniform(3, 5, size=6)  # drift between pairs, shared by both arms of a pair
    fill = prefill * np.exp(rng.normal(0.02, 0.03, size=6))
    found = ratio_by_pairs(prefill, fill)
    assert found is not None and found.method == PAIRED and found.pairs == 6
    ci = stats.ttest_rel(np.log(fill), np.log(prefill)).confidence_interval(0.95)
    assert [found.lo, found.hi] == pytest.approx([math.exp(ci.low), math.exp(ci.high)])
    assert found.value == pytest.approx(math.exp(np.mean(np.log(fill / prefill))))
    assert found.log_sd == pytest.approx(np.std(np.log(fill / prefill), ddof=1))
    # The drift would swamp an unpaired interval: the paired one is far narrower.
    welch = stats.ttest_ind(np.log(fill), np.log(prefill), equal_var=False).confidence_interval(0.95)
    assert ci.high - ci.low < (welch.high - welch.low) / 3
    assert ratio_by_pairs([4.0], [4.1]) is None


@pytest.mark.parametrize(("sd", "expected"), [(0.01, 3), (0.024, 4), (0.04, 5), (0.1, 18)])
def test_how_many_pairs_would_bring_the_interval_within_5_percent(sd: float, expected: int) -> None:
    n = pairs_needed(sd)
    assert n == expected

    def enough(n: int) -> bool:
        return n >= (stats.t.ppf(0.975, n - 1) * sd / 0.05) ** 2

    assert enough(n) and (n == 2 or not enough(n - 1))
    assert pairs_needed(10.0) is None  # never within the cap


def _finish(engine: Any, run_id: str, summary: dict[str, float]) -> None:
    for status in (RunStatus.starting, RunStatus.running):
        store.transition(engine, run_id, status)
    store.transition(engine, run_id, RunStatus.succeeded, summary=summary)


def _paired_sweep(engine: Any, log_ratios: list[float], **extra: Any) -> str:
    """A sweep over mode at one point whose pairs' decode figures are finished with the
    given fill/prefill log ratios (prefill 5 ms + drift)."""
    body = SweepCreate.model_validate({"base": BASE, "grid": {"mode": ["fill", "prefill"]},
                                       "repeats": len(log_ratios), **extra})
    sweep = sweeps.create_sweep(engine, body, random.Random(0))
    _, runs = sweeps.get_sweep(engine, sweep.id)
    for k, d in enumerate(log_ratios):
        pair = [r for r in runs if r.trial == k]
        base = 5.0 + k
        for r in pair:
            value = base * math.exp(d) if r.spec["mode"] == "fill" else base
            _finish(engine, r.id, {key: value for key in KEYS})
    return sweep.id


def test_an_undecided_point_says_how_many_pairs_would_decide(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "db.sqlite")
    d = [0.0, 0.06]
    verdict = sweep_public(engine, _paired_sweep(engine, d)).fill_vs_prefill[0]
    needed = pairs_needed(float(np.std(d, ddof=1)))
    assert verdict["verdict"] == "undecided" and verdict["pairs"] == 2
    assert verdict["needed"] == needed == 6 and verdict["more"] == 4
    ratio = verdict["ratios"][0]
    pct, lo, hi = ((x - 1) * 100 for x in (ratio["ratio"], *ratio["ci"]))
    assert verdict["line"] == (f"undecided over 2 pairs: decode ITL fill/prefill {pct:+.1f}% "
                               f"[{lo:+.1f}%, {hi:+.1f}%]: not distinguishable at 95%; within +-5% "
                               "not shown; about 6 pairs would decide")


def test_one_pair_never_differs_and_says_how_many_to_run(client: TestClient) -> None:
    body = {"base": BASE, "grid": {"input_len": [8], "mode": ["fill", "prefill"]}}
    sweep = client.post("/api/sweeps", json=body).json()
    for r in sweep["runs"]:
        wait_finished(client, r["id"])
    (verdict,) = client.get(f"/api/sweeps/{sweep['id']}").json()["fill_vs_prefill"]
    assert verdict["one_pair"] and verdict["verdict"] == "undecided"
    assert verdict["line"].startswith("one pair: cannot tell; run 5 pairs")
    assert all(r["state"] == "undecided" for r in verdict["ratios"])
    page = client.get(f"/sweeps/{sweep['id']}").text
    assert "one pair: cannot tell; run 5 pairs" in page and 'id="fill-flags"' not in page


def test_added_trials_join_the_pairs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tokens 20 ms apart: on a busy machine the stub's 2 ms gaps reach a starved client in
    # bursts, and a decode ITL of 0 has no ratio.
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.02")
    with make_client(tmp_path) as client:
        _added_trials_join_the_pairs(client)


def _added_trials_join_the_pairs(client: TestClient) -> None:
    body = {"base": {**BASE, "seed": 3}, "grid": {"input_len": [8, 12], "mode": ["fill", "prefill"]}}
    sweep = client.post("/api/sweeps", json=body).json()
    first = sweep["runs"]
    added = client.post(f"/api/sweeps/{sweep['id']}/trials", json={"count": 1, "point": {"input_len": 8}})
    assert added.status_code == 201, added.text
    runs = added.json()["runs"]
    new = [r for r in runs if r["id"] not in {f["id"] for f in first}]
    assert len(runs) == 6 and len(new) == 2
    assert new[0]["pair_id"] == new[1]["pair_id"] and {r["spec"]["mode"] for r in new} == {"fill", "prefill"}
    assert [(r["trial"], r["spec"]["seed"], r["spec"]["input_len"]) for r in new] == [(1, 4, 8)] * 2
    # The point's first runs became trial 0 of its groups; the new ones joined them.
    old = [r for r in runs if r["id"] in {f["id"] for f in first} and r["spec"]["input_len"] == 8]
    assert {r["trial"] for r in old} == {0} and all(r["group_id"] for r in old)
    for r in new:
        (partner,) = [o for o in old if o["spec"]["mode"] == r["spec"]["mode"]]
        assert r["group_id"] == partner["group_id"]
    for r in runs:
        wait_finished(client, r["id"])
    found = client.get(f"/api/sweeps/{sweep['id']}").json()
    by_len = {v["point"]["input_len"]: v for v in found["fill_vs_prefill"]}
    assert by_len[8]["pairs"] == 2 and by_len[8]["ratios"][0]["method"] == PAIRED
    assert by_len[12]["one_pair"]
    html = client.get(f"/sweeps/{sweep['id']}").text
    assert 'id="add-trials"' in html
    # The page and the export count the trials each point has now, added ones too.
    assert '<strong id="trials-per-point">1 to 2 trials per point</strong>' in html
    assert "(1 asked at submit, the rest added)" in html
    rows = client.get(f"/api/sweeps/{sweep['id']}/export?format=json").json()["rows"]
    assert sorted((r["input_len"], r["mode"], r["trials"], r["pairs"]) for r in rows) == [
        (8, "fill", 2, 2), (8, "prefill", 2, 2), (12, "fill", 1, 1), (12, "prefill", 1, 1)]


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"count": 0}, 422, "greater than or equal to 1"),
    ({"count": "two"}, 422, "count"),
    ({"point": {"nope": 1}}, 422, "does not sweep"),
    ({"point": {"mode": "fill"}}, 422, "leave mode out"),
    ({"point": {"input_len": 99}}, 422, "no point"),
    ({"count": 32}, 409, "more than 32 trials"),
])
def test_bad_add_trials_are_4xx_with_the_reason(client: TestClient, body: dict[str, Any], status: int,
                                                 needle: str) -> None:
    sweep = client.post("/api/sweeps", json={"base": {**BASE, "num_prompts": 10_000},
                                             "grid": {"input_len": [8], "mode": ["fill", "prefill"]}}).json()
    response = client.post(f"/api/sweeps/{sweep['id']}/trials", json=body)
    assert response.status_code == status and needle in response.text, response.text
    assert len(client.get(f"/api/sweeps/{sweep['id']}").json()["runs"]) == 2
    assert client.post("/api/sweeps/s-nope/trials", json={}).status_code == 404
    for r in sweep["runs"]:
        client.post(f"/api/runs/{r['id']}/cancel")


def test_until_decided_queues_pairs_up_to_the_next_look(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "db.sqlite")
    extra = {"until_decided": {"max_pairs": 8}}
    wide = _paired_sweep(engine, [0.0, 0.06], **extra)
    run = sweeps.get_sweep(engine, wide)[1][0]
    assert follow_up(engine, run.id) == 2  # undecided at the look of 2 pairs: up to 4
    runs = sweeps.get_sweep(engine, wide)[1]
    assert len(runs) == 8 and len({r.pair_id for r in runs}) == 4
    verdict = sweep_public(engine, _paired_sweep(engine, [0.0, 0.001], **extra)).fill_vs_prefill[0]
    assert verdict["verdict"] == "matches"
    settled = _paired_sweep(engine, [0.0, 0.001], **extra)
    assert follow_up(engine, sweeps.get_sweep(engine, settled)[1][0].id) == 0


def test_looks_taken_at_once_queue_one_look(tmp_path: Path) -> None:
    # Both runs of a point's last pair end together (two servers): every look at once must
    # queue the next look's pairs once, not once per look.
    engine = make_engine(tmp_path / "db.sqlite")
    wide = _paired_sweep(engine, [0.0, 0.06], until_decided={"max_pairs": 8})
    ended = sweeps.get_sweep(engine, wide)[1]
    start = threading.Barrier(len(ended))

    def look(run_id: str) -> int:
        start.wait()
        return follow_up(engine, run_id)

    with ThreadPoolExecutor(len(ended)) as pool:
        queued = list(pool.map(look, [r.id for r in ended]))
    assert sorted(queued) == [0, 0, 0, 2]
    runs = sweeps.get_sweep(engine, wide)[1]
    assert len(runs) == 8 and len({r.pair_id for r in runs}) == 4


def test_a_look_under_way_when_its_sweep_is_cancelled_queues_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tmp_path / "db.sqlite")
    wide = _paired_sweep(engine, [0.0, 0.06], until_decided={"max_pairs": 8})
    real = until_decided.fill_vs_prefill

    def cancelled_meanwhile(*args: Any, **kwargs: Any) -> Any:
        # The sweep's cancel stops the rule (and cancels what is queued) while the look
        # reads its verdict, which is still undecided.
        sweeps.stop_rule(engine, wide, "the sweep was cancelled")
        return real(*args, **kwargs)

    monkeypatch.setattr(until_decided, "fill_vs_prefill", cancelled_meanwhile)
    assert follow_up(engine, sweeps.get_sweep(engine, wide)[1][0].id) == 0
    assert len(sweeps.get_sweep(engine, wide)[1]) == 4
    # A user's own added trials are not the rule's: they are queued all the same.
    assert len(sweeps.add_trials(engine, wide, TrialsCreate(count=1))) == 2


def test_a_look_missed_while_the_service_was_down_is_taken_at_its_start(tmp_path: Path) -> None:
    # The last pair of an undecided point ended, then the service stopped before its look.
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    undecided = _paired_sweep(engine, [0.0, 0.06], until_decided={"max_pairs": 8})
    decided = _paired_sweep(engine, [0.0, 0.001], until_decided={"max_pairs": 4})
    engine.dispose()
    with ServedTestClient(settings, headers=AUTH) as client:
        found = client.get(f"/api/sweeps/{undecided}").json()
        assert len(found["runs"]) == 8  # the look of 2 pairs was taken: 2 more pairs
        assert len(client.get(f"/api/sweeps/{decided}").json()["runs"]) == 4
        # Cancelling the sweep stops its rule: the 2 finished pairs are still undecided,
        # but no look queues pairs for it again, then or at the next start.
        cancelled = client.post(f"/api/sweeps/{undecided}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        (verdict,) = cancelled.json()["fill_vs_prefill"]
        assert "until decided: stopped (the sweep was cancelled)" in verdict["line"], verdict["line"]
        assert verdict["next_look"] is None
    with ServedTestClient(settings, headers=AUTH) as client:
        found = client.get(f"/api/sweeps/{undecided}").json()
        assert len(found["runs"]) == 8 and found["progress"]["queued"] == 0


def _sequential(true_log: float, sd: float, seed: int, per_look: float | None) -> tuple[bool, int]:
    """One point under the rule: 16 pairs drawn, looks at the planned counts, stop when
    decided; whether the final interval holds the true ratio, and the pairs used."""
    d = np.random.default_rng(seed).normal(true_log, sd, size=16)
    found, count = by_the_rule(d, pair_looks(2, 16), per_look)
    return found.lo <= math.exp(true_log) <= found.hi, count


def test_the_pair_rule_holds_95_percent_when_it_stops_early() -> None:
    # Measured here over 2000 seeds at a true ratio of 1.02 and a spread of 0.03 between
    # pairs: the rule's intervals hold it in 0.977 of points, stopping before the budget
    # in 39%; plain 95% intervals at the same looks hold it in 0.927 (stopping early in 69%).
    plan = pair_looks(2, 16)
    assert plan.counts == (2, 4, 8, 16) and plan.confidence == pytest.approx(1 - 0.05 / 4)
    runs = [_sequential(math.log(1.02), 0.03, seed, None) for seed in range(2000)]
    held = np.mean([h for h, _ in runs])
    assert held >= 0.95, held
    assert 0.1 < np.mean([n < 16 for _, n in runs]) < 0.9  # it does stop early, and not always
    naive = np.mean([_sequential(math.log(1.02), 0.03, seed, CONFIDENCE)[0] for seed in range(2000)])
    assert naive < 0.95 < held


def test_until_decided_through_the_service_stops_when_decided_or_spent(client: TestClient) -> None:
    body = {"base": BASE, "grid": {"mode": ["fill", "prefill"]}, "until_decided": {"max_pairs": 4}}
    sweep = client.post("/api/sweeps", json=body).json()
    assert sweep["options"] == {"until_decided": {"max_pairs": 4}} and len(sweep["runs"]) == 4
    deadline = time.monotonic() + 120
    while True:
        found = client.get(f"/api/sweeps/{sweep['id']}").json()
        verdicts = found["fill_vs_prefill"]
        settled = verdicts and (verdicts[0]["verdict"] != "undecided" or verdicts[0]["pairs"] == 4)
        if settled and found["progress"]["finished"] == found["progress"]["total"]:
            break
        assert time.monotonic() < deadline, found["progress"]
        time.sleep(0.2)
    # The scheduler takes the sweep's look after a run before it lets the run's runner go.
    scheduler = client.app.state.scheduler  # type: ignore[attr-defined]
    wait_until(lambda: not any(scheduler.handling(r["id"]) for r in found["runs"]),
               "the runners of the sweep's runs to end, with their looks")
    again = client.get(f"/api/sweeps/{sweep['id']}").json()
    (verdict,) = again["fill_vs_prefill"]
    assert len(again["runs"]) == 2 * verdict["pairs"] and verdict["pairs"] in (2, 4)
    assert "until decided" in verdict["line"]
    assert "of 2 (97.5% per look, Bonferroni)" in verdict["line"]
    bad = client.post("/api/sweeps", json={**body, "grid": {"input_len": [8]}})
    assert bad.status_code == 422 and "must sweep mode" in bad.text


def _arm(name: str, values: list[float], paired: bool) -> Arm:
    return Arm(name, [Run(id=f"{name}{k}", spec={}, model="m", status="succeeded",
                          summary={"decode_median_itl_ms": v}, pair_id=f"p{k}" if paired else None)
                      for k, v in enumerate(values)])


@pytest.mark.parametrize("paired", [False, True])
def test_a_comparison_says_the_confidence_its_interval_was_taken_at(paired: bool) -> None:
    metric = BY_KEY["decode_median_itl_ms"]
    prefill = _arm("a", [10.0, 10.1, 9.9, 10.05], paired)
    slower, same = _arm("b", [12.0, 12.2, 11.9, 12.1], paired), _arm("c", [10.3, 9.7, 10.2, 9.8], paired)
    # An until_decided look takes its interval at a corrected confidence (here 3 looks).
    look = 1 - (1 - CONFIDENCE) / 3
    assert change(None, prefill, slower, metric, look)["message"].endswith(  # type: ignore[arg-type]
        "worse (different at 98.3%); beyond +-5%")
    assert change(None, prefill, same, metric, look)["message"].endswith(  # type: ignore[arg-type]
        "not distinguishable at 98.3%; within +-5% not shown")
    assert change(None, prefill, slower, metric)["message"].endswith(  # type: ignore[arg-type]
        "worse (different at 95%); beyond +-5%")


def test_the_sweeps_verdict_and_the_compare_page_give_one_answer(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    # Decided at its first look (fill about 10% slower), under a rule of two looks (97.5% each).
    sweep_id = _paired_sweep(engine, [0.10, 0.12, 0.07, 0.11], until_decided={"max_pairs": 8})
    engine.dispose()
    with ServedTestClient(settings, headers=AUTH) as client:
        (verdict,) = client.get(f"/api/sweeps/{sweep_id}").json()["fill_vs_prefill"]
        assert verdict["verdict"] == "differs"
        ids = f"ids={verdict['prefill']}&ids={verdict['fill']}"
        compared = client.get(f"/api/compare?{ids}").json()
        rows = {row["metric"]: row["changes"][0] for row in compared["metrics"]}
        for ratio in verdict["ratios"]:
            theirs = rows[ratio["metric"]]
            assert (theirs["ci"], theirs["method"], theirs["message"]) == (
                ratio["ci"], ratio["method"], ratio["message"])
        assert verdict["ratios"][0]["method"] == f"{PAIRED}, 97.5% per look"
        assert "beyond +-5%" in verdict["line"] and verdict["ratios"][0]["message"] in verdict["line"]
        # The page names the method its header, tooltips and JSON use, and says the same.
        page = client.get(f"/compare?{ids}").text
        head = page.split('<table id="compare">')[0]
        assert f"{PAIRED}, 97.5% per look" in head and "Welch" not in head
        assert f'title="{PAIRED}, 97.5% per look"' in page
        assert compared["methods"][0] == f"{PAIRED}, 97.5% per look"
        assert verdict["ratios"][0]["message"] in page


def test_advice_past_a_sensible_number_of_pairs_says_the_noise_is_too_high(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    # Pairs that disagree by +-20%: +-5% would take some 66 pairs.
    sweep_id = _paired_sweep(engine, [0.0, 0.25, -0.15])
    (verdict,) = sweep_public(engine, sweep_id).fill_vs_prefill
    engine.dispose()
    assert pairs_needed(float(np.std([0.0, 0.25, -0.15], ddof=1))) == 66
    assert verdict["verdict"] == "undecided" and verdict["needed"] is None and verdict["more"] is None
    assert "over 32 would be needed, the difference is too small to tell at this machine's noise" \
        in verdict["line"], verdict["line"]
    with ServedTestClient(settings, headers=AUTH) as client:
        page = client.get(f"/sweeps/{sweep_id}").text
    assert 'name="count" min="1" max="32" value="1"' in page
