"""What a run's page says fits what the run was: units by magnitude, texts by mode, the
engine as its server ran it, counts as counts, imports as what their file says."""

from __future__ import annotations

import json
import re
from html import unescape
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlmodel import Session

from service.analysis.steady_window import prefill_stall
from service.core.sample import Sample
from service.storage.tables import Run
from tests.conftest import wait_finished

SMALL = {"input_len": 16, "output_len": 8, "num_prompts": 6, "max_concurrency": 3}
REFERENCE = Path(__file__).parent / "data" / "vllm-bench-serve-result.json"
# A CPU's roofline: some 40 GB/s of memory bandwidth, a fraction of a GPU's TB/s.
CPU_ROOFLINE = {"batch": 3.0, "context_tokens": 16.0, "bytes_per_step": 5_400_000.0,
                "weight_bytes": 5_376_512.0, "kv_bytes": 24_576.0, "bandwidth_bytes_per_s": 41.2e9,
                "spec_bandwidth_bytes_per_s": None, "min_step_ms": 0.131, "decode_median_itl_ms": 2.0,
                "pct_of_roofline": 6.55, "pct_of_spec_roofline": None, "achieved_bytes_per_s": 2.7e9}


def _stalled_samples() -> list[Sample]:
    """Four requests of concurrency 4: each pauses while the next one waits for its first token."""
    out = []
    for i in range(4):
        gaps = [0.005] * 10 + ([0.3] if i < 3 else [0.005]) + [0.005] * 10
        out.append(Sample(index=i, prompt_len=16, output_tokens=len(gaps) + 1, ttft=0.2, itl=gaps,
                          latency=0.2 + sum(gaps), start_time=0.3 * i, success=True))
    return out


def test_a_fill_runs_page_speaks_of_fill_and_gb_per_s_on_a_cpu(client: TestClient) -> None:
    run = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert run["status"] == "succeeded" and run["spec"]["mode"] == "fill"
    # What the runner stores for a fill run on a CPU: the roofline, and decode paused by fills.
    summary = {**run["summary"], "roofline": CPU_ROOFLINE,
               "prefill_stall": prefill_stall(_stalled_samples(), "fill")}
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        session.exec(update(Run).where(Run.id == run["id"]).values(summary=summary))  # type: ignore[call-overload]
        session.commit()
    page = unescape(client.get(f"/runs/{run['id']}").text)
    roof = page.split('id="roofline"')[1].split("</table>")[0]
    assert "measured 41.2 GB/s" in roof and "2.7 GB/s" in roof and "TB/s" not in roof, roof
    assert "5.4 MB: weights 5.38 MB + KV 24.6 kB" in roof
    stall = page.split('id="prefill-stall"')[1].split("</p>")[0]
    assert stall.startswith(' class="muted">Fill stall') and "KV cache was being filled" in stall
    assert "real prefill" not in stall and "prefilled" not in stall


def test_the_engine_row_shows_the_weights_the_server_loaded(client: TestClient) -> None:
    # The bundled model has no weights: its server loads dummy ones whatever the spec says.
    run = wait_finished(client, client.post("/api/runs", json=SMALL).json()["id"])
    assert run["spec"]["engine"]["load_format"] == "auto"
    page = client.get(f"/runs/{run['id']}").text
    engine = json.loads(unescape(page.split('<code id="worker-engine">')[1].split("</code>")[0]))
    assert engine["load_format"] == "dummy"
    params = page.split('id="params"')[1].split("</p>")[0]
    assert "load_format dummy" in params


def test_an_imported_run_shows_counts_as_integers_and_its_mode_as_its_file_says(client: TestClient) -> None:
    imported = client.post("/api/imports", json=json.loads(REFERENCE.read_text()))
    assert imported.status_code == 201, imported.text
    run = imported.json()
    assert run["summary"]["completed"] == 8 and isinstance(run["summary"]["completed"], int)
    page = client.get(f"/runs/{run['id']}").text
    assert re.search(r'<td class="num">8</td><td class="unit muted">requests</td>', page)
    params = unescape(page.split('id="params"')[1].split("</p>")[0])
    assert "unknown: imported from a vllm bench serve result file" in params
    assert "prefill (real)" not in params


def test_a_seeded_run_is_headed_seeded_where_runs_are_compared(client: TestClient) -> None:
    ids = []
    for mode in ("seeded", "prefill"):
        answer = client.post("/api/runs", json={"mode": mode, "input_len": 64, "output_len": 4,
                                                "num_prompts": 2})
        assert answer.status_code == 201, answer.text
        ids.append(answer.json()["id"])
    for run_id in ids:
        wait_finished(client, run_id)
    page = unescape(client.get(f"/compare?ids={ids[0]},{ids[1]}").text)
    assert page.count("seeded (decode on KV a real prefill wrote") == 1
    assert page.count("prefill (real)") == 1
