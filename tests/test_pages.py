"""Pages: charts drawn from stored samples, sweep curves, comparisons, escaping."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from datetime import UTC, datetime, timedelta
from html import unescape as html_unescape
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlmodel import Session

from service.core.spec import EngineSpec, RunSpec, worker_key
from service.storage.tables import Run, Worker
from tests.conftest import wait_finished

SMALL = {"input_len": 16, "output_len": 8, "num_prompts": 6, "max_concurrency": 3}


def _svgs(html: str) -> list[str]:
    return re.findall(r"<svg[^>]*class=\"chart\".*?</svg>", html, flags=re.S)


def test_run_page_draws_histograms_and_ttft_over_time(client: TestClient) -> None:
    run = client.post("/api/runs", json=SMALL).json()
    wait_finished(client, run["id"])
    html = client.get(f"/runs/{run['id']}").text
    charts = _svgs(html)
    assert len(charts) == 4  # the three distributions, then the server view
    assert all("<rect" in c for c in charts[:2])  # histogram bars
    assert charts[2].count("<circle") == 6  # one dot per request
    assert "vLLM server" in html and "none (CPU)" in html


def test_run_page_before_any_sample_says_so(client: TestClient) -> None:
    run = client.post("/api/runs", json={**SMALL, "num_prompts": 1}).json()
    client.post(f"/api/runs/{run['id']}/cancel")
    html = client.get(f"/runs/{run['id']}").text
    assert "no data yet" in html


def test_sweep_page_draws_curves_and_pairs_fill_with_prefill(client: TestClient) -> None:
    body = {"base": SMALL, "grid": {"input_len": [8, 32], "max_concurrency": [1, 2],
                                    "mode": ["fill", "prefill"]}}
    sweep = client.post("/api/sweeps", json=body).json()
    for r in sweep["runs"]:
        wait_finished(client, r["id"])
    html = client.get(f"/sweeps/{sweep['id']}").text
    charts = _svgs(html)
    assert len(charts) == 4
    # One line per concurrency and mode on the TPOT charts (vLLM's median, the decode-only
    # median, p99), one per input length and mode on throughput; each dot opens its run.
    assert charts[0].count("<polyline") == 4 and "max_concurrency=1 fill" in charts[0]
    assert "Decode-only median TPOT" in charts[1] and charts[1].count("<polyline") == 4
    assert charts[3].count("<polyline") == 4 and "input_len=32 prefill" in charts[3]
    assert charts[0].count('<a href="/runs/r-') == 8
    # Single trials: each point carries its bootstrap interval over requests, drawn as a band.
    assert charts[0].count('class="band"') == 4 and charts[0].count('class="errorbar"') == 8
    # One line per point; one pair each, so no point is decided and none flagged red.
    pairs = html.split('id="pairs"')[1].split("</ul>")[0]
    assert pairs.count("side by side") == 4
    assert pairs.count("· one pair: cannot tell; run 5 pairs") == 4
    # Fill against prefill in percent, as the compare page says it.
    pct = r"[+-]\d+\.\d%"
    assert re.search(rf"decode ITL fill/prefill {pct} \[{pct}, {pct}\] by a bootstrap over requests", pairs)
    assert len(re.findall(r'class="verdict flag-undecided"', pairs)) == 4
    assert 'id="fill-flags"' not in html
    assert 'id="add-trials"' in html
    table = html.split('id="point-table"')[1].split("</table>")[0]
    assert table.count('href="/runs/r-') == 8


def test_compare_shows_runs_side_by_side_with_differences(client: TestClient) -> None:
    ids = [client.post("/api/runs", json={**SMALL, "output_len": n}).json()["id"] for n in (4, 12)]
    for run_id in ids:
        wait_finished(client, run_id)
    html = client.get(f"/compare?ids={ids[0]}&ids={ids[1]}").text
    assert ids[0] in html and ids[1] in html
    assert "median_tpot_ms" in html
    # One run a side: a difference is one within these two runs, and the page says so.
    assert re.search(r"[+-]\d+\.\d% \[[+-]\d+\.\d%, [+-]\d+\.\d%\]: (worse|better) \(different at 95% "
                     r"within these two runs; drift between runs is not in this interval: "
                     r"repeat both to tell\)"
                     r"|not distinguishable at 95%", html)
    # The distributions: a CDF of TTFT, TPOT and ITL with one line per run.
    charts = _svgs(html)
    assert len(charts) == 3 and all(c.count("<polyline") == 2 for c in charts)
    assert client.get(f"/compare?ids={ids[0]},r-nope").status_code == 404
    # No ids, or one: a page that says what to give, not an error.
    empty = client.get("/compare")
    assert empty.status_code == 200 and 'id="choose"' in empty.text


def test_user_strings_are_escaped_on_pages(client: TestClient) -> None:
    hostile = "<script>alert(1)</script>"
    html = client.get("/", params={"model": hostile}).text
    assert hostile not in html
    assert "&lt;script&gt;" in html


def test_index_has_the_submit_form_and_lists_sweeps(client: TestClient) -> None:
    html = client.get("/").text
    assert 'id="submit-form"' in html and 'name="input_len"' in html and 'name="grid"' in html
    sweep = client.post("/api/sweeps", json={"base": SMALL, "grid": {"output_len": [2, 3]}}).json()
    html = client.get("/").text
    assert f'href="/sweeps/{sweep["id"]}"' in html


def test_index_pages_through_ten_thousand_runs(client: TestClient) -> None:
    from sqlalchemy import insert

    from service.core.spec import RunSpec
    from service.storage.tables import Run

    engine = client.app.state.engine  # type: ignore[attr-defined]
    spec = RunSpec().model_dump()
    rows = [{"id": f"r-bulk{i:05d}", "spec": spec, "model": "decodebench-tiny", "status": "succeeded",
             "total": 64} for i in range(10_000)]
    with engine.begin() as conn:
        conn.execute(insert(Run), rows)
    first = client.get("/?status=succeeded").text
    assert "10000 runs" in first and "page 1 of 200" in first
    last = client.get("/?status=succeeded&page=200").text
    assert last.count('href="/runs/r-bulk') == 50
    assert client.get("/api/runs?limit=500&offset=9900").json()["total"] == 10_000


def _insert(client: TestClient, *rows: Any) -> None:
    engine = client.app.state.engine  # type: ignore[attr-defined]
    with Session(engine) as session:
        session.add_all(rows)
        session.commit()


def _between(html: str, start: str, end: str) -> str:
    return html.split(start, 1)[1].split(end, 1)[0]


def _text(html: str) -> str:
    """What a reader sees of some HTML (which may start inside a tag): tags gone (a ``<wbr>``,
    where a line may break, without a space), spaces squeezed."""
    html = re.sub(r"^[^<>]*>", "", html).replace("<wbr>", "")
    return " ".join(html_unescape(re.sub(r"<[^>]+>", " ", html)).split())


LAUNCH_ERROR = (
    "vLLM server exited with code 1 before it became healthy; last log lines:\n"
    "INFO 11-23 22:10:01 [api_server.py:1100] vLLM API server version 0.32.0\n"
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3/site-packages/transformers/utils/hub.py", line 470, in cached_files\n'
    "OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find "
    "them in the cached files."
)


def _failed_run(run_id: str, model: str, error: str = LAUNCH_ERROR) -> Run:
    spec = RunSpec().model_dump() | {"model": model}
    return Run(id=run_id, spec=spec, model=model, status="failed", error=error, total=64,
               finished_at=datetime.now(UTC))


def test_a_failed_start_shows_its_root_cause_and_the_fix_in_one_line(client: TestClient) -> None:
    # As the service writes a start whose engine failed: the root cause from the server's
    # log, the fix, then the log's tail, which ends in vLLM's wrappers of the cause.
    cause = ("ValueError: To serve at least one request with the model's max seq len (131072), (5.62 GiB "
             "KV cache is needed, which is larger than the available KV cache memory (5.25 GiB). Based "
             "on the available memory, the estimated maximum model length is 122368. Try increasing "
             "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing "
             "`max_model_len` when initializing the engine.")
    fix = "Fix: set engine.max_model_len to at most 122368, or raise engine.gpu_memory_utilization."
    error = "\n".join([cause, fix, "vLLM server's engine failed to start (the server was stopped); "
                       "last log lines:", "RuntimeError: Engine core initialization failed. See root "
                       "cause above. Failed core proc(s): {}"])
    _insert(client, _failed_run("r-failedstart1", "decodebench-tiny", error))
    html = client.get("/runs/r-failedstart1").text
    shown = _text(_between(html, 'id="cause"', "</p>"))
    assert shown.startswith("failed ValueError: To serve at least one request with the model's max seq len "
                            "(131072)"), shown
    assert shown.endswith(f"… · {fix}"), shown  # the cause cut to fit, never the fix
    assert "Engine core initialization failed" not in shown
    assert "Engine core initialization failed" in _between(html, '<details id="error">', "</details>")


def test_run_page_header_names_the_parameters_with_units_and_utc_times(client: TestClient) -> None:
    run = client.post("/api/runs", json={**SMALL, "fill": {"mean": 0.02, "std": 0.001}}).json()
    wait_finished(client, run["id"])
    html = client.get(f"/runs/{run['id']}").text
    header = _text(_between(html, 'id="params"', "</p>"))
    for seen in ("model decodebench-tiny", "ISL 16 tokens", "OSL 8 tokens", "concurrency 3",
                 "prompts 6", "mode fill (mean 0.02, std 0.001)", "engine TP 1"):
        assert seen in header, (seen, header)
    times = _text(_between(html, 'id="times"', "</p>"))
    assert re.fullmatch(r"created \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC · started \S+ \S+ UTC · "
                        r"finished \S+ \S+ UTC · took [\d.]+ s", times), times
    # Every number of the summary tables carries its unit.
    for key, unit in (("output_throughput", "tok/s"), ("request_throughput", "req/s"),
                      ("duration", "s"), ("decode_median_tpot_ms", "ms")):
        row = _between(html, f"<th>{key}", "</tr>")
        assert f'<td class="unit muted">{unit}</td>' in row, key
    assert "<h2>Latency (ms)</h2>" in html
    # A rate run says its rate where a concurrency run says its concurrency.
    rated = client.post("/api/runs", json={**SMALL, "request_rate": 40.0, "max_concurrency": None}).json()
    header = _text(_between(client.get(f"/runs/{rated['id']}").text, 'id="params"', "</p>"))
    assert "rate 40 req/s" in header and "concurrency" not in header


def test_max_concurrent_requests_is_explained_next_to_the_true_peak_in_flight(client: TestClient) -> None:
    run = client.post("/api/runs", json=SMALL).json()
    done = wait_finished(client, run["id"])
    html = client.get(f"/runs/{run['id']}").text
    vllm_row = _between(html, 'id="max-concurrent"', "</tr>")
    assert "one-second bucket" in vllm_row  # the tooltip on vLLM's figure
    assert f'<td class="num">{done["summary"]["max_concurrent_requests"]}' in vllm_row
    peak = int(_text(_between(html, 'id="peak-in-flight"', "</tr>")).split()[-2])
    assert 1 <= peak <= SMALL["max_concurrency"]
    assert "can read 12 for a concurrency-4 run" in html


def test_failed_run_shows_its_cause_in_one_line_naming_the_model_with_the_log_folded(
    client: TestClient,
) -> None:
    _insert(client, _failed_run("r-failedcause1", "org/missing-model"))
    html = client.get("/runs/r-failedcause1").text
    cause = _text(_between(html, 'id="cause"', "</p>"))
    assert cause.startswith("failed model org/missing-model: OSError: We couldn't connect to "
                            "'https://huggingface.co'"), cause
    assert cause.endswith("vLLM server exited with code 1 before it became healthy")
    assert "INFO" not in cause and "Traceback" not in cause
    folded = _between(html, '<details id="error">', "</details>")
    assert "<summary>" in folded and "vLLM API server version 0.32.0" in folded
    assert "<details id=\"error\" open" not in html
    # An error without a log tail is its own cause, with nothing to fold.
    _insert(client, _failed_run("r-failedcause2", "decodebench-tiny", "hung: no token for 30 s"))
    html = client.get("/runs/r-failedcause2").text
    assert _text(_between(html, 'id="cause"', "</p>")) == "failed hung: no token for 30 s"
    assert "<details" not in html


def test_starting_run_shows_elapsed_time_against_the_last_start_and_the_last_log_line(
    client: TestClient, tmp_path: Path,
) -> None:
    model = "org/slow-model"
    key = worker_key(model, EngineSpec())
    now = datetime.now(UTC)
    log = tmp_path / "w-now.log"
    log.write_text("INFO loading weights\n" * 1000 + "INFO Loading safetensors checkpoint shards: 40% done\n")
    common = {"key": key, "model": model, "engine": {}, "url": "http://127.0.0.1:9", "port": 9}
    _insert(
        client,
        Worker(id="w-earlier", status="stopped", token_hash="a", log_path=str(tmp_path / "old.log"),
               created_at=now - timedelta(hours=1), ready_at=now - timedelta(hours=1) + timedelta(seconds=42),
               stopped_at=now - timedelta(minutes=30), **common),
        Worker(id="w-now", status="starting", token_hash="b", log_path=str(log),
               created_at=now - timedelta(seconds=7), **common),
        Run(id="r-starting01", spec=RunSpec().model_dump() | {"model": model}, model=model,
            status="starting", total=64),
    )
    html = client.get("/runs/r-starting01").text
    box = _text(_between(html, 'id="starting"', "</div>"))
    assert "Starting vLLM server w-now for org/slow-model" in box
    elapsed = float(re.search(r"([\d.]+) s so far", box).group(1))  # type: ignore[union-attr]
    assert 7 <= elapsed < 60
    assert "the last start of this model took 42 s" in box
    assert "Last log line: INFO Loading safetensors checkpoint shards: 40% done" in box


def test_index_lists_failed_and_stopped_servers_with_their_reasons(client: TestClient) -> None:
    now = datetime.now(UTC)
    common = {"key": "k", "engine": {}, "url": "http://127.0.0.1:9", "port": 9, "log_path": "/nonexistent"}
    _insert(
        client,
        Worker(id="w-broken", model="org/broken", status="failed", token_hash="a", stopped_at=now,
               error="vLLM server exited with code 1 before it became healthy; last log lines:\nboom",
               **common),
        Worker(id="w-done", model="decodebench-tiny", status="stopped", token_hash="b", stopped_at=now,
               **common),
    )
    table = _between(client.get("/").text, 'id="workers"', "</table>")
    broken = _text(_between(table, 'class="worker-failed"', "</tr>"))
    assert "org/broken" in broken and "failed" in broken
    assert "vLLM server exited with code 1 before it became healthy" in broken and "boom" not in broken
    assert "stopped by the service" in _text(_between(table, 'class="worker-stopped"', "</tr>"))


def test_index_runs_show_their_cause_and_sweep_and_can_be_picked_to_compare(client: TestClient) -> None:
    sweep = client.post("/api/sweeps", json={"base": SMALL, "grid": {"output_len": [2, 3]}}).json()
    ids = [r["id"] for r in sweep["runs"]]
    _insert(client, _failed_run("r-failedindex", "org/missing-model"))
    html = client.get("/").text
    runs = _between(html, 'id="runs"', "</table>")
    cause_row = _between(runs, 'class="cause-row"', "</tr>")
    assert "model org/missing-model: OSError" in _text(cause_row)
    assert "\n" not in _between(cause_row, ">↳", "</div>")
    for run_id in ids:
        row = _between(runs, f'value="{run_id}"', "</tr>")
        assert f'<a href="/sweeps/{sweep["id"]}">' in row
    # Ticking runs and pressing "compare" is a plain GET form: /compare?ids=A&ids=B.
    form = _between(html, '<form id="compare-runs"', "</form>")
    assert 'method="get" action="/compare"' in form and form.count('type="checkbox" name="ids"') == 3
    for run_id in ids:
        wait_finished(client, run_id)
    picked = client.get("/compare", params=[("ids", ids[0]), ("ids", ids[1])])
    assert picked.status_code == 200 and 'id="compare"' in picked.text


def test_index_shows_a_shapes_whole_name_and_the_depth_it_was_built_at(client: TestClient) -> None:
    shape = "decodebench-shapes/llama-3.2-1b"
    rows = []
    for run_id, layers in (("r-depth2", 2), ("r-depth4", 4), ("r-depthall", None)):
        spec = RunSpec(model=shape, engine=EngineSpec(num_layers=layers)).model_dump()
        rows.append(Run(id=run_id, spec=spec, model=shape, status="succeeded", total=64))
    _insert(client, *rows)
    runs = _between(client.get("/").text, 'id="runs"', "</table>")
    # The whole name (a break allowed after its "/"), never cut where shapes differ.
    seen = {run_id: _text(_between(runs, f'value="{run_id}"', "</tr>"))
            for run_id in ("r-depth2", "r-depth4", "r-depthall")}
    assert all(shape in text for text in seen.values()), seen
    assert "2 of 16 layers" in seen["r-depth2"] and "4 of 16 layers" in seen["r-depth4"]
    assert "layers" not in seen["r-depthall"]


def test_sweep_base_spec_shows_only_what_the_grid_did_not_set(client: TestClient) -> None:
    body = {"base": SMALL, "grid": {"input_len": [8, 16], "fill.mean": [0.01, 0.02]}}
    sweep = client.post("/api/sweeps", json=body).json()
    base = json.loads(html_unescape(_between(client.get(f"/sweeps/{sweep['id']}").text,
                                             "<h2>Base spec</h2>", "</pre>").split("<pre>")[1]))
    assert "input_len" not in base and "mean" not in base["fill"]
    assert base["max_concurrency"] == 3 and base["fill"]["std"] == 0.0 and base["output_len"] == 8


def test_sweep_exports_its_table_and_draws_token_axes_and_picks_points_to_compare(
    client: TestClient,
) -> None:
    body = {"base": SMALL, "grid": {"input_len": [2048, 8192, 32768], "max_concurrency": [1, 2]}}
    sweep = client.post("/api/sweeps", json=body).json()
    for r in sweep["runs"]:
        wait_finished(client, r["id"])
    html = client.get(f"/sweeps/{sweep['id']}").text
    # A log-2 token axis with a tick at each measured length, labelled as people write them.
    axis = _svgs(html)[0]
    assert re.search(r">2k</text>.*>8k</text>.*>32k</text>", axis, flags=re.S)
    assert "log-2 scale" in axis
    export = _between(html, 'id="export"', "</p>")
    assert f'href="/api/sweeps/{sweep["id"]}/export?format=csv"' in export
    assert f'href="/api/sweeps/{sweep["id"]}/export?format=json"' in export
    answer = client.get(f"/api/sweeps/{sweep['id']}/export?format=csv")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/csv")
    assert "attachment" in answer.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(answer.text)))
    assert sorted((int(r["input_len"]), int(r["max_concurrency"])) for r in rows) == [
        (n, c) for n in (2048, 8192, 32768) for c in (1, 2)]
    assert all(float(r["median_tpot_ms"]) > 0 and r["mode"] == "fill" for r in rows)
    assert all(float(r["median_tpot_ms_ci_lo"]) <= float(r["median_tpot_ms_ci_hi"]) for r in rows)
    table = client.get(f"/api/sweeps/{sweep['id']}/export?format=json").json()
    assert table["columns"] == list(rows[0]) and len(table["rows"]) == 6
    assert {r["point"] for r in table["rows"]} == {r["point"] for r in rows}
    assert client.get(f"/api/sweeps/{sweep['id']}/export?format=xml").status_code == 422
    assert client.get("/api/sweeps/s-nope/export").status_code == 404
    # Every point can be ticked; the form asks /compare for the ticked ones.
    form = _between(html, '<form id="compare-points"', "</form>")
    assert 'method="get" action="/compare"' in form
    picked = re.findall(r'type="checkbox" name="ids" value="([^"]+)"', form)
    assert sorted(picked) == sorted(r["point"] for r in rows)
    assert 'id="compare"' in client.get("/compare", params=[("ids", p) for p in picked[:3]]).text


def test_compare_headers_label_the_setup_and_every_change_says_better_or_worse(client: TestClient) -> None:
    ids = [client.post("/api/runs", json={**SMALL, "max_concurrency": c}).json()["id"] for c in (1, 3)]
    for run_id in ids:
        wait_finished(client, run_id)
    html = client.get("/compare", params=[("ids", ids[0]), ("ids", ids[1])]).text
    table = _between(html, 'id="compare"', "</table>")
    heads = _between(table, "<thead>", "</thead>")
    for label in ("model", "ISL", "OSL", "concurrency", "prompts", "mode", "engine"):
        assert heads.count(f"<dt>{label}</dt>") == 2, label
    assert "(reference)" in _text(_between(heads, ids[0], "</th>"))
    rows = _between(table, "<tbody>", "</tbody>").split("</tr>")[:-1]
    assert len(rows) == 11
    for row in rows:
        metric = _text(_between(row, "<th>", "</th>"))
        change = _text(row.rsplit("<td", 1)[1])
        assert re.search(r"\b(better|worse|no change)\b", change), (metric, change)
    # No ids: a page that says what to give, never raw JSON.
    empty = client.get("/compare")
    assert empty.headers["content-type"].startswith("text/html") and 'id="choose"' in empty.text


# The stub's inter-token time: 10 ms + 10 ms per running stream; a limit of 35 ms on the
# median puts the boundary at 2 (30 ms), with 3 (40 ms) the first failing.
SLOPED = {"STUB_TOKEN_INTERVAL_S": "0.010", "STUB_ITL_SLOPE_S": "0.010"}


def test_capacity_page_draws_the_sla_curve_and_the_frontier_and_exports_its_probes(stub_service: Any) -> None:
    client = stub_service(SLOPED)
    html = client.get("/").text
    assert 'id="capacity-form"' in html and 'name="sla.max_ms"' in html and "decode_p99_itl_ms" in html
    body = {"base": {"output_len": 8}, "input_lens": [8], "max_concurrency": 4,
            "sla": {"metric": "decode_median_itl_ms", "max_ms": 35}}
    search_id = client.post("/api/capacity", json=body).json()["id"]
    deadline = datetime.now(UTC) + timedelta(seconds=240)
    while client.get(f"/api/capacity/{search_id}").json()["status"] not in ("succeeded", "failed"):
        assert datetime.now(UTC) < deadline, "the search did not end"
        time.sleep(0.2)
    search = client.get(f"/api/capacity/{search_id}").json()
    (context,) = search["contexts"]
    assert (context["max_concurrency"], context["first_failing"]) == (2, 3)
    assert f'href="/capacity/{search_id}"' in client.get("/").text

    html = client.get(f"/capacity/{search_id}", params={"prefill_tokens_per_s": 800}).text
    text = _text(html)
    assert context["statement"] in html_unescape(html)
    sla_svg, frontier_svg = _svgs(_between(html, 'id="context-8"', "</section>"))
    # The SLA curve: a dot per judged probe with its interval (1, 2, then where the line
    # through them meets the limit: 3 and the one beside it, on a busy machine 4 too), and the
    # limit as a dashed line.
    judged = len(context["probes"])
    assert judged in (3, 4), context["probes"]
    assert sla_svg.count("<title>concurrency ") == judged and sla_svg.count('class="errorbar"') == judged
    assert "limit 35 ms" in sla_svg and "stroke-dasharray" in sla_svg
    # The frontier: per server against per user, error bars both ways, passes apart from fails.
    assert frontier_svg.count("<title>concurrency ") == judged
    assert frontier_svg.count('class="errorbar"') == frontier_svg.count('class="xerrorbar"') == judged
    # Each dot in its verdict's colour, the verdicts drawn named in the legend.
    assert "pass: within the SLA" in frontier_svg and "fail: over the SLA" in frontier_svg
    assert "pass: within the SLA" in sla_svg and "fail: over the SLA" in sla_svg
    # Each probe's runs are linked, from its dots and from its row.
    for probe in context["probes"]:
        for run_id in probe["run_ids"]:
            assert f'href="/runs/{run_id}"' in html
        if len(probe["run_ids"]) > 1:
            assert f'href="/groups/{probe["group_id"]}"' in sla_svg
    # Decode servers per prefill server, with its formula's inputs.
    ratio = client.get(f"/api/capacity/{search_id}", params={"prefill_tokens_per_s": 800}).json()[
        "contexts"][0]["decode_servers_per_prefill_server"]
    assert f"Decode servers per prefill server: {ratio['sentence']}" in text
    assert "P = 800 prefill tok/s / 8 tokens = 100 requests/s" in text

    exported = client.get(f"/api/capacity/{search_id}/export", params={"format": "csv"})
    assert exported.status_code == 200 and exported.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(exported.text)))
    assert [(int(r["input_len"]), int(r["concurrency"]), r["verdict"]) for r in rows] == [
        (8, 1, "pass"), (8, 2, "pass"), (8, 3, "fail"), (8, 4, "fail")][:judged]
    two = next(r for r in rows if r["concurrency"] == "2")
    assert float(two["figure_ms_lo"]) <= float(two["figure_ms"]) <= float(two["figure_ms_hi"])
    assert float(two["figure_ms"]) <= 35
    # Passed by its interval, then wholly under the limit; or, where a busy machine made its
    # trials drift apart (see test_capacity), by its point estimate, and the row says so.
    assert float(two["figure_ms_hi"]) <= 35 or two["decided_by"] == "point estimate", two
    assert two["context_max_concurrency"] == "2" and two["run_ids"].split() == context["probes"][1]["run_ids"]
    as_json = client.get(f"/api/capacity/{search_id}/export", params={"format": "json"}).json()
    assert as_json["rows"] == [{k: (None if v == "" else v) for k, v in r.items()} for r in
                               json.loads(json.dumps(as_json["rows"]))]
    assert as_json["search"]["contexts"][0]["max_concurrency"] == 2 and len(as_json["rows"]) == judged
