"""A run whose every request failed shows what failed and no figures: no "64/64" progress and
no 0.00 latencies where nothing was measured, in the runs table, on its page and in the API."""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi.testclient import TestClient

from tests.conftest import wait_finished

SMALL = {"input_len": 32, "output_len": 4, "num_prompts": 4, "max_concurrency": 2}
# What vLLM answered every request of a run whose input filled the model's whole length.
REFUSAL = "max_tokens must be at least 1, got 0."


def _failed_run(stub_service: Callable[..., TestClient]) -> tuple[TestClient, str]:
    client = stub_service({"STUB_REFUSE_REQUESTS": REFUSAL})
    run_id = client.post("/api/runs", json=SMALL).json()["id"]
    assert wait_finished(client, run_id)["status"] == "failed"
    return client, run_id


def test_api_gives_null_figures_and_the_counts(stub_service: Callable[..., TestClient]) -> None:
    client, run_id = _failed_run(stub_service)
    run = client.get(f"/api/runs/{run_id}").json()
    assert run["progress"] == {"completed": 0, "failed": 4, "total": 4}
    assert REFUSAL in run["error"]
    summary = run["summary"]
    # Counted: still numbers. Measured over answered requests: null, not 0.0.
    assert summary["completed"] == 0 and summary["failed"] == 4
    for key in ("median_tpot_ms", "p99_itl_ms", "mean_ttft_ms", "output_throughput",
                "request_throughput", "decode_median_itl_ms"):
        assert key in summary and summary[key] is None, (key, summary[key])
    # The list answers the same.
    listed = client.get("/api/runs").json()["runs"][0]
    assert listed["summary"]["median_tpot_ms"] is None


def test_runs_table_shows_what_failed_and_no_figures(stub_service: Callable[..., TestClient]) -> None:
    client, run_id = _failed_run(stub_service)
    html = client.get("/").text
    row = html.split(f'<a href="/runs/{run_id}">')[1].split("</tr>")[0]
    cells = re.findall(r'<td class="num[^"]*">(.*?)</td>', row, flags=re.S)
    # ISL, OSL, load, progress, median TPOT, output tok/s.
    progress, tpot, throughput = cells[3], cells[4], cells[5]
    assert progress.startswith("0/4") and "4 failed" in progress, progress
    assert tpot == "-" and throughput == "-", (tpot, throughput)
    cause = html.split(f'<a href="/runs/{run_id}">')[1].split('class="cause-row"')[1].split("</tr>")[0]
    assert REFUSAL in cause


def test_run_page_shows_the_error_and_dashes(stub_service: Callable[..., TestClient]) -> None:
    client, run_id = _failed_run(stub_service)
    html = client.get(f"/runs/{run_id}").text
    assert REFUSAL in html.split('id="cause"')[1].split("</p>")[0]
    assert 'id="nothing-measured"' in html
    latency = html.split('id="latency"')[1].split("</table>")[0]
    cells = re.findall(r'<td class="num">(.*?)</td>', latency)
    assert len(cells) == 4 * 7 and set(cells) == {"-"}, cells
    throughput = html.split("<h2>Throughput</h2>")[1].split("</table>")[0]
    assert "0.00" not in throughput
    assert re.search(r"<th>failed</th><td class=\"num\">4</td>", html)
