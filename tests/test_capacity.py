"""Capacity searches through the service, against stub servers whose inter-token time
grows with the streams they run: a known boundary."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.analysis.capacity import capped_reason, plan_for
from service.core.capacity import SLA_METRICS, CapacityCreate
from service.core.status import RunStatus
from service.storage import capacity as capacity_store
from service.storage import store
from service.storage.db import make_engine
from tests.conftest import AUTH, ServedTestClient, make_settings, wait_for, wait_until

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
    assert context["limited_by"] == "sla" and context["confidence"] == 0.95
    probes = probes_of(context)
    # On a quiet machine every probe is decided by its interval and the range is exactly 5.
    # A busy one can make a probe's trials drift apart (a CI run saw the trials at 5 do so
    # beside another search on the same 2 cores): it then gets three trials, its interval
    # carries the spread and may straddle the limit, and its point estimate decides, said so
    # in the answer, whose range then holds 5 without closing on it.
    pointed = {c for c, p in probes.items() if p["decided_by"] != "interval"}
    assert all(probes[c]["trials"] == 3 and probes[c]["decided_by"] == "point estimate" for c in pointed)
    assert set(context["decided_by_point_estimate"]) == pointed
    low, high = context["boundary_range"]
    assert low <= 5 <= high
    if not pointed:
        assert (low, high) == (5, 5) and "with 95% confidence it is 5" in context["statement"]
    # 1, 2, then aimed: the line through 20 ms at 1 and 30 at 2 meets 65 at 5.5, so 5 and 6
    # together on a quiet machine (doubling and bisecting probed 1 2 4 8, 6 5); a busy one
    # slows the stub's streams and can put the aim one lower. Either way the boundary pair
    # is probed and every probe is judged as the stub's truth says.
    assert {1, 2, 5, 6} <= set(probes) <= {1, 2, 4, 5, 6, 7}
    assert all(p["verdict"] == ("pass" if c <= 5 else "fail") for c, p in probes.items())
    assert probes[5]["trials"] >= 2 and probes[6]["trials"] >= 2
    if not pointed:
        assert probes[5]["ci_ms"][1] <= 65 < probes[6]["ci_ms"][0]
    assert probes[5]["confidence"] == pytest.approx(done["plan"]["per_look_confidence"])
    # Every run it spent is counted, each one a probe run linked to the search.
    run_ids = [r for p in probes.values() for r in p["run_ids"]]
    assert context["runs"] == done["runs"] == len(run_ids) == len(set(run_ids))
    # 7 on a quiet machine (1 twice, 2, 5 twice, 6 twice; 10 before the search aimed: 1
    # twice, 2, 4 twice, 8, 6 twice, 5 twice), a probe or a trial more where the aim fell one
    # off, an interval straddled the limit or a boundary probe's runs drifted: against 30 for
    # a scan of 10 levels x 3 trials.
    assert context["runs"] <= 11
    # The first probe's two trials ran together; each probe says how it was judged.
    assert probes[1]["trials"] >= 2 and all("typical run" in p["method"] for p in probes.values())
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
    passed = [probes[c] for c in (1, 2, 5)]
    users = [p["tokens_per_s_per_user"]["value"] for p in passed]
    servers = [p["tokens_per_s_per_server"]["value"] for p in passed]
    assert users == sorted(users, reverse=True) and servers == sorted(servers)
    assert probes[5]["tokens_per_s_per_user"] == per_user
    # Decode servers per prefill server: P = 6400 / 64 = 100 req/s; D = 5 / (8 x TPOT).
    ratio = context["decode_servers_per_prefill_server"]
    assert ratio["prefill_requests_per_s"] == pytest.approx(100)
    assert (ratio["max_concurrency"], ratio["output_len"], ratio["input_len"]) == (5, 8, 64)
    # D from the mean TPOT of each of the boundary's trials (request throughput), with its
    # interval over those trials.
    tpots = [client.get(f"/api/runs/{run_id}").json()["summary"]["mean_tpot_ms"]
             for run_id in probes[5]["run_ids"]]
    assert ratio["tpot_trials"] == len(tpots) >= 2
    assert ratio["tpot_ms"]["value"] == pytest.approx(sum(tpots) / len(tpots))
    d = ratio["decode_requests_per_s"]
    assert d == pytest.approx(5 / (8 * ratio["tpot_ms"]["value"] / 1000))
    assert ratio["ratio"] == pytest.approx(100 / d)
    assert ratio["ratio_range"][0] <= ratio["ratio"] <= ratio["ratio_range"][1]
    assert ratio["confidence"] is None and "no single probability is stated" in ratio["holds_if"]
    assert "P = 6400 tok/s (given) / 64 = 100 req/s" in ratio["formula"]
    # A prefill rate asked on the GET answers for it instead; and without any, no ratio.
    other = client.get(f"/api/capacity/{search['id']}", params={"prefill_tokens_per_s": 3200}).json()
    assert other["contexts"][0]["decode_servers_per_prefill_server"]["ratio"] == \
        pytest.approx(ratio["ratio"] / 2)
    assert client.get(f"/api/capacity/{search['id']}", params={"prefill_tokens_per_s": 0}).status_code == 422
    listed = client.get("/api/capacity").json()
    assert listed["total"] == 1 and listed["searches"][0]["status"] == "succeeded"
    assert sum(listed["searches"][0]["runs"].values()) == context["runs"]


def test_a_probe_the_server_capped_is_reported_capped_and_bounds_the_search(stub_service: Any) -> None:
    # The server runs at most 3 streams and says so nowhere but in its queue: the probes at
    # 4 and above are neither pass nor fail, and the answer is 3, what the server held.
    client = stub_service({**SLOPED, "STUB_MAX_RUNNING": "3"})
    body = {"base": BASE, "input_lens": [64], "sla": SLA, "max_concurrency": 16}
    done = wait_search(client, client.post("/api/capacity", json=body).json()["id"])

    (context,) = done["contexts"]
    probes = probes_of(context)
    assert probes[4]["verdict"] == "capped" and "queued_in_server" in probes[4]["capped"]
    assert probes[4]["figure_ms"] is None and probes[4]["decided_by"] is None
    # 1, 2, then where the line aimed (5 and 6 on a quiet machine, both capped), then
    # doubling under what they left (4, capped) and 3: past a capped probe the search does
    # not aim. Every probe above 3 was capped.
    assert {1, 2, 3, 4} <= set(probes) <= {1, 2, 3, 4, 5, 6, 7}
    assert all(p["verdict"] == "capped" for c, p in probes.items() if c > 3)
    assert (context["max_concurrency"], context["first_failing"]) == (3, None)
    assert context["limited_by"] == "capped" and "the probe at 4 was capped" in context["limit_reason"]
    # The boundary probe gets two trials, three where they drifted apart (a CI run on a busy
    # machine saw its trials disagree: ``next_step`` then takes every trial the cap allows).
    assert context["decided"] and probes[3]["trials"] in (2, 3)


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
    # 1, 2, then the bound: at once where the flat line through 1 and 2 rose by noise (its
    # boundary far past 5), else doubling to 4 first.
    assert set(probes_of(fits)) in ({1, 2, 5}, {1, 2, 4, 5})
    assert (fits["max_concurrency"], fits["limited_by"]) == (5, "kv_cache")
    assert "holds 1,600 tokens: 5 requests of 308 tokens" in fits["limit_reason"]
    assert done["plan"]["ceiling"] == 1024  # the default, not reached
    (refused,) = too_long["probes"]
    # vLLM fits its max_model_len to that cache (auto-fit): the run is longer than that.
    assert refused["verdict"] == "refused" and "2008 tokens > 1584" in refused["refused"]
    assert (too_long["max_concurrency"], too_long["limited_by"], too_long["decided"]) == (0, "refused", True)
    assert "2008 tokens > 1584" in too_long["limit_reason"]
    # The first probe's two trials were queued together; both were refused, and nothing more.
    assert len(refused["run_ids"]) == 2 and too_long["runs"] == 2
    spent = sum(len(p["run_ids"]) for c in done["contexts"] for p in c["probes"])
    assert done["status"] == "succeeded" and done["runs"] == spent == fits["runs"] + 2


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
    assert len(run_ids) == 4  # the first probe of each input length: two trials, queued together
    assert {client.get(f"/api/runs/{r}").json()["status"] for r in run_ids} == {"cancelled"}
    assert client.get(f"/api/runs/{first}/requests").json()  # what it measured is kept
    again = client.post(f"/api/capacity/{search['id']}/cancel")
    assert again.status_code == 409 and "nothing to cancel" in again.json()["detail"]
    # Each cancelled run's runner takes its search's look before the scheduler lets it go.
    scheduler = client.app.state.scheduler  # type: ignore[attr-defined]
    wait_until(lambda: not any(scheduler.handling(r) for r in run_ids),
               "the runners of the cancelled runs to end, with their looks")
    assert client.get(f"/api/capacity/{search['id']}").json()["runs"] == 4

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
    # Both trials of the first probe failed (the service stopped during them) before their
    # look was taken: the next start takes the look, which ends the search with why.
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    body = CapacityCreate.model_validate({"base": BASE, "input_lens": [64], "sla": SLA,
                                          "max_concurrency": 4})
    search = capacity_store.create_search(engine, body, plan_for(4).as_dict())
    runs = capacity_store.get_search(engine, search.id)[1]
    assert [r.trial for r in runs] == [0, 1]
    for run in runs:
        store.transition(engine, run.id, RunStatus.starting)
        store.transition(engine, run.id, RunStatus.failed, error="the service stopped")
    engine.dispose()
    with ServedTestClient(settings, headers=AUTH) as client:
        found = client.get(f"/api/capacity/{search.id}").json()
        assert found["status"] == "failed" and found["runs"] == 2
        assert "2 runs of the probe at 1 failed; the last: the service stopped" in found["error"]


def test_a_server_whose_max_num_seqs_is_below_the_probe_caps_it() -> None:
    provenance = {"engine": {"max_num_seqs": 3}}
    assert capped_reason(4, [], provenance) == (
        "the server's max_num_seqs is 3: it runs at most 3 requests at once, fewer than 4")
    assert capped_reason(3, [], provenance) is None
    preempted = [{"code": "preempted", "message": "vLLM preempted requests 2 times", "figure": 2}]
    assert capped_reason(3, preempted, provenance) == "preempted: vLLM preempted requests 2 times"
