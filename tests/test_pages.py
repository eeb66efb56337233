"""Pages: charts drawn from stored samples, sweep curves, comparisons, escaping."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

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
    pairs = html.split('id="pairs"')[1].split("</table>")[0]
    assert pairs.count("side by side") == 4
    assert pairs.count("<td class=\"muted\">bootstrap over requests</td>") == 4
    assert re.search(r'\d\.\d\d <span class="ci">\[\d\.\d\d, \d\.\d\d\]</span>', pairs)
    assert len(re.findall(r'class="verdict flag-(matches|differs|undecided)"', pairs)) == 4
    table = html.split('id="point-table"')[1].split("</table>")[0]
    assert table.count('href="/runs/r-') == 8


def test_compare_shows_runs_side_by_side_with_differences(client: TestClient) -> None:
    ids = [client.post("/api/runs", json={**SMALL, "output_len": n}).json()["id"] for n in (4, 12)]
    for run_id in ids:
        wait_finished(client, run_id)
    html = client.get(f"/compare?ids={ids[0]}&ids={ids[1]}").text
    assert ids[0] in html and ids[1] in html
    assert "median_tpot_ms" in html
    assert re.search(r"[+-]\d+\.\d% \[[+-]\d+\.\d%, [+-]\d+\.\d%\]: (worse|better) \(different at 95%\)"
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

    from service.models import Run, RunSpec

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
