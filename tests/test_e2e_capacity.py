"""A capacity search end to end on a real vLLM (CPU) server with the bundled tiny model:
``decodebench capacity`` against the service as a real process, its table, and the answer
the API gives, every probe a run that exists and succeeded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.core.tinymodel import TINY_MODEL_NAME
from tests.conftest import API_TOKEN

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
# A limit the tiny model on a CPU keeps at every concurrency up to 4: the search brackets
# 1, 2, 4, stops at the asked bound and gives the boundary its second trial. On the median
# ITL: a p99 limit is judged by attainment over engine steps, and the few hundred steps of
# these short runs cannot show 99% at the plan's confidence (its verdicts would be by point
# estimate: ``tests/test_capacity_units.py``).
SLA_MS = 5000
SLA_METRIC = "decode_median_itl_ms"


@pytest.fixture(scope="module")
def service(real_tiny_service: httpx.Client) -> httpx.Client:
    return real_tiny_service  # one service and tiny server for the tiny model's e2e modules


def test_a_small_search_on_the_tiny_model_finds_the_asked_bound_with_runs_that_exist(
        service: httpx.Client) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "--url", str(service.base_url), "--token", API_TOKEN,
         "capacity", "--model", TINY_MODEL_NAME, "--input-len", "1024", "--output-len", "16",
         "--sla-metric", SLA_METRIC, "--sla-max-ms", str(SLA_MS), "--max-concurrency", "4",
         "--max-runs", "8", "--prefill-tokens-per-s", "10240"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "250"})
    assert done.returncode == 0, done.stdout + done.stderr
    search_id = done.stderr.split("capacity search ")[1].split()[0]
    search = service.get(f"/api/capacity/{search_id}").json()

    assert search["status"] == "succeeded", search
    (context,) = search["contexts"]
    assert context["decided"] and context["input_len"] == 1024
    assert (context["max_concurrency"], context["first_failing"]) == (4, None)
    assert context["limited_by"] == "max_concurrency" and context["boundary_range"] == [4, 4]
    probes = {p["concurrency"]: p for p in context["probes"]}
    # 1, then 4: aimed there from the first probe by the roofline the connector reported
    # (drift or not), or by doubling through 2 where the prior did not aim.
    assert {1, 4} <= set(probes) <= {1, 2, 4}
    # Each probe passed by its interval; one under 4 may be left undecided, where the prior
    # aimed from its two trials before their interval closed (a CI run saw it at 1): the
    # pass at 4 makes its verdict moot.
    passed = {c: p for c, p in probes.items() if (p["verdict"], p["decided_by"]) == ("pass", "interval")}
    assert 4 in passed and all(p["verdict"] == "undecided" for c, p in probes.items() if c not in passed)
    assert probes[4]["trials"] >= 2  # the boundary's second trial
    assert probes[1]["trials"] >= 2  # the first probe's two, queued together
    for p in passed.values():
        assert 0 < p["ci_ms"][0] <= p["figure_ms"] <= p["ci_ms"][1] <= SLA_MS
    # Every run it counts is a probe run of this search that succeeded at its concurrency,
    # on the real server with the connector filling its requests.
    run_ids = [r for p in probes.values() for r in p["run_ids"]]
    assert context["runs"] == search["runs"] == len(run_ids) == len(set(run_ids)) <= 8
    for c, probe in probes.items():
        for run_id in probe["run_ids"]:
            run = service.get(f"/api/runs/{run_id}").json()
            assert run["status"] == "succeeded" and run["capacity_id"] == search_id
            assert (run["spec"]["max_concurrency"], run["spec"]["input_len"]) == (c, 1024)
            assert run["connector"]["filled_requests"] == run["spec"]["num_prompts"]
    # The decode rate a stream sees while it decodes (1 / its full-batch TPOT) against what
    # its runs measured as a whole (each trial's output throughput, as vLLM's client counts
    # it): a run's rate also waits for each request's first token, so it lies under the
    # decode rate (16 tokens in TTFT + 15 TPOTs, at most 16/15 of it; 0.8 leaves room for
    # a median TPOT against a mean). A per-user figure off by the concurrency fails here.
    # (Not that four streams batched make more than one: on a CI machine of 2 cores busy
    # with 4 test workers, one run at 4 once made 403 against 462 at 1: how throughput
    # grows with the batch is for a benchmark on a quiet machine to measure.) Over the probes
    # that passed: an undecided one's rate may be unbounded yet.
    # A rate nothing bounds yet is null: a fresh-clone CI run's trials at 4 drifted apart
    # (median ITLs of 2.0, 5.5 and 2.7 ms) and their 9 full-batch waves left the TPOT
    # interval [0, inf). The probe at 1 rests on every request (a wave each): always bounded.
    assert probes[1]["tokens_per_s_per_user"] is not None, probes[1]
    for c, probe in passed.items():
        user, server = probe["tokens_per_s_per_user"], probe["tokens_per_s_per_server"]
        if user is None:
            assert server is None, probe
            continue
        assert user["value"] > 0 and server["confidence"] == user["confidence"]
        measured = [service.get(f"/api/runs/{r}").json()["summary"]["output_throughput"]
                    for r in probe["run_ids"]]
        assert 0.8 * sum(measured) / len(measured) <= server["ci"][1], (c, measured, server)
        assert 0.8 * probe["output_tokens_per_s_per_user"] <= user["ci"][1], (c, probe)
    ratio = context["decode_servers_per_prefill_server"]
    assert ratio["prefill_requests_per_s"] == pytest.approx(10)
    assert ratio["ratio_range"][0] <= ratio["ratio"] <= ratio["ratio_range"][1]

    # What the user read: a line per probe, the table, the answer in a sentence.
    assert f"input_len=1024 concurrency=4: pass, {SLA_METRIC}" in done.stderr
    row = next(line for line in done.stdout.splitlines() if line.lstrip("│ ").startswith("1024 "))
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[:6] == ["1024", ">= 4", "[4, open)", "-", "max_concurrency", "95%"]
    assert cells[8] == str(context["runs"])
    assert (f"input_len 1024: largest concurrency with {SLA_METRIC} <= {SLA_MS} ms at "
            "input_len 1024: at least 4 (the highest asked, max_concurrency 4 (asked), passed; higher "
            "was not probed)") in " ".join(done.stdout.split())
