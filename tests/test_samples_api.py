"""A run's samples through the API: ``/requests`` a page at a time, and the two exports
(streamed from slices of the stored samples) saying what they said when built whole."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session

from service.analysis.metrics import summarize
from service.analysis.vllm_result import VLLM_REQUEST_LISTS, export_vllm
from service.core.ids import new_id
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.core.status import RunStatus
from service.storage import measurements
from service.storage.measurements import READ_SLICE
from service.storage.tables import Run

# More than two read slices, so every export crosses slice boundaries.
MANY = 2 * READ_SLICE + 100


def _sample(i: int, **fields: Any) -> Sample:
    values: dict[str, Any] = {
        "index": i, "prompt_len": 16 + i % 7, "output_tokens": 4, "ttft": 0.1 + i / 1e4,
        "itl": [0.01 * (1 + i % 3), 0.02, 0.015], "latency": 0.2 + i / 1e4, "start_time": 100.0 + i / 10,
        "success": True, "due_time": 100.0 + i / 10 - 0.001 if i % 2 else None,
        "generated_text": f'text {i}: "quoted", ünïcödé, a\nnew line',
    }
    return Sample(**{**values, **fields})


def _stored_run(client: TestClient, samples: list[Sample], **spec: Any) -> str:
    """A succeeded run written straight to the database, with its summary."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    data = RunSpec(**spec).model_dump()
    ok = sum(s.success for s in samples)
    run = Run(id=new_id("r"), spec=data, model=data["model"], status=RunStatus.succeeded.value,
              total=len(samples), completed=ok, failed=len(samples) - ok,
              summary=summarize(samples, 2.0, {}))
    with Session(engine, expire_on_commit=False) as session:
        session.add(run)
        session.commit()
    # Stored out of order: every read is by request index all the same.
    measurements.save_samples(engine, run.id, samples[::-1])
    return run.id


@pytest.fixture
def many(client: TestClient) -> tuple[str, list[Sample]]:
    samples = [_sample(i) for i in range(MANY)]
    samples[3] = _sample(3, success=False, error="boom", itl=[], output_tokens=0)
    samples[7] = _sample(7, output_tokens=0)
    return _stored_run(client, samples), samples


def test_requests_come_a_page_at_a_time_with_the_total_and_the_next_page(
        client: TestClient, many: tuple[str, list[Sample]]) -> None:
    run_id, samples = many
    first = client.get(f"/api/runs/{run_id}/requests")
    assert first.status_code == 200
    assert [s["index"] for s in first.json()] == list(range(100))
    assert first.headers["X-Total-Count"] == str(MANY)
    assert first.headers["Link"] == f'</api/runs/{run_id}/requests?limit=100&offset=100>; rel="next"'
    last = client.get(f"/api/runs/{run_id}/requests", params={"limit": 1000, "offset": 1000})
    assert [s["index"] for s in last.json()] == list(range(1000, MANY))
    assert last.json()[0]["generated_text"] == samples[1000].generated_text
    assert "Link" not in last.headers
    assert client.get(f"/api/runs/{run_id}/requests", params={"limit": 1001}).status_code == 422


def test_following_the_next_links_reads_every_sample_once(
        client: TestClient, many: tuple[str, list[Sample]]) -> None:
    run_id, samples = many
    seen: list[dict[str, Any]] = []
    url: str | None = f"/api/runs/{run_id}/requests?limit=300"
    while url:
        page = client.get(url)
        seen += page.json()
        link = page.headers.get("Link")
        url = link[1:link.index(">")] if link else None
    assert [Sample(**s) for s in seen] == samples


def test_the_streamed_vllm_export_holds_what_export_vllm_makes(
        client: TestClient, many: tuple[str, list[Sample]]) -> None:
    run_id, samples = many
    response = client.get(f"/api/runs/{run_id}/export", params={"format": "vllm"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["content-disposition"] == f'attachment; filename="decodebench-{run_id}.json"'
    exported = json.loads(response.content)
    summary = client.get(f"/api/runs/{run_id}").json()["summary"]
    expected = export_vllm(summary, samples, {"model": exported["model_id"]})
    for key, _ in VLLM_REQUEST_LISTS:
        assert exported[key] == expected[key], key
    assert len(exported["generated_texts"]) == MANY
    assert exported["output_lens"][7] == 4  # no usage: one token per streamed chunk
    # The same keys in the same order as the whole-built dict (after the free metadata keys).
    keys = list(exported)
    assert keys[keys.index("request_rate"):] == list(expected)[list(expected).index("request_rate"):]


def test_the_streamed_csv_export_has_a_row_per_sample_in_order(
        client: TestClient, many: tuple[str, list[Sample]]) -> None:
    run_id, samples = many
    response = client.get(f"/api/runs/{run_id}/export", params={"format": "csv"})
    assert response.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.text)))
    assert [int(r["index"]) for r in rows] == list(range(MANY))
    assert rows[3]["success"] == "False" and rows[3]["error"] == "boom" and rows[3]["tpot"] == ""
    assert rows[10]["itl"] == " ".join(f"{x:.6f}" for x in samples[10].itl)


def test_csv_tpot_of_a_stream_without_usage_is_the_summarys(client: TestClient) -> None:
    # No usage from the server: output_tokens 0, five gaps between six streamed chunks.
    sample = Sample(index=0, prompt_len=64, output_tokens=0, ttft=0.05, itl=[0.01, 0.012, 0.011, 0.013, 0.02],
                    latency=0.05 + 0.066, start_time=10.0, success=True)
    run_id = _stored_run(client, [sample])
    summary = client.get(f"/api/runs/{run_id}").json()["summary"]
    rows = list(csv.DictReader(io.StringIO(client.get(f"/api/runs/{run_id}/export?format=csv").text)))
    assert rows[0]["tpot"] != ""
    assert float(rows[0]["tpot"]) * 1000 == pytest.approx(summary["mean_tpot_ms"], rel=1e-12)
    assert summary["mean_tpot_ms"] == pytest.approx(0.066 / 5 * 1000)
