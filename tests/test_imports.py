"""Imports: a ``vllm bench serve --save-result`` file stored as a run measured elsewhere."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import wait_finished

# Written by vLLM's own ``vllm bench serve --save-result --save-detailed`` (tests/test_metrics.py).
REFERENCE = Path(__file__).parent / "data" / "vllm-bench-serve-result.json"
# What vLLM drops from its file without --save-detailed (``main`` in vllm/benchmarks/serve.py).
DETAILED_ONLY = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
# A run of the stub server's, queued after an import.
LATER = {"input_len": 8, "output_len": 2, "num_prompts": 1}


def _reference() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(REFERENCE.read_text())
    return data


@pytest.mark.parametrize(("offset", "finished"), [
    (None, "2026-11-22T11:02:57"),  # no offset given: the date is taken as UTC
    ("+02:00", "2026-11-22T09:02:57"),
    ("-05:30", "2026-11-22T16:32:57"),
])
def test_the_files_local_date_is_read_at_the_offset_given(client: TestClient, offset: str | None,
                                                          finished: str) -> None:
    params = {} if offset is None else {"utc_offset": offset}
    response = client.post("/api/imports", json=_reference(), params=params)
    assert response.status_code == 201, response.text
    run = response.json()
    assert run["finished_at"].startswith(finished)
    assert run["provenance"]["imported"]["date_utc_offset"] == (offset or "+00:00")


@pytest.mark.parametrize("offset", ["2", "+15:00", "+02:61", "UTC+2", "+0200x"])
def test_a_bad_offset_is_a_422_naming_it(shared_client: TestClient, offset: str) -> None:
    response = shared_client.post("/api/imports", json=_reference(), params={"utc_offset": offset})
    assert response.status_code == 422 and "utc_offset" in response.text, response.text


def test_import_of_a_detailed_file_compares_not_distinguishable_with_itself(client: TestClient) -> None:
    data = _reference()
    data["gpu"] = "H100"  # a --metadata KEY=VALUE pair
    response = client.post("/api/imports", json=data)
    assert response.status_code == 201, response.text
    run = response.json()
    assert run["status"] == "imported"
    assert run["spec"]["model"] == "tiny"
    assert run["spec"]["mode"] == "prefill"
    assert (run["spec"]["input_len"], run["spec"]["output_len"]) == (4096, 32)
    assert run["spec"]["max_concurrency"] == 4 and run["spec"]["request_rate"] is None
    assert run["progress"] == {"completed": 8, "failed": 0, "total": 8}
    # The file's own figures, as vLLM wrote them, and decodebench's beside them.
    assert run["summary"]["median_tpot_ms"] == data["median_tpot_ms"]
    assert run["summary"]["output_throughput"] == data["output_throughput"]
    assert "decode_median_itl_ms" in run["summary"] and "median_tpot_ms_ci" in run["summary"]
    imported = run["provenance"]["imported"]
    assert imported["date"] == "20261122-110257" and imported["backend"] == "openai"
    assert imported["metadata"] == {"gpu": "H100"}
    assert run["finished_at"].startswith("2026-11-22T11:02:57")

    requests = client.get(f"/api/runs/{run['id']}/requests").json()
    assert [r["ttft"] for r in requests] == data["ttfts"]
    assert [r["itl"] for r in requests] == data["itls"]
    assert all(r["success"] for r in requests)

    # The same file imported twice: two runs of the very same requests (compare drops a
    # repeated id).
    twin = client.post("/api/imports", json=data).json()
    compared = client.get("/api/compare", params={"ids": f"{run['id']},{twin['id']}"})
    assert compared.status_code == 200, compared.text
    rows = {m["metric"]: m["changes"][0] for m in compared.json()["metrics"]}
    for metric in ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "decode_median_itl_ms"):
        assert rows[metric]["verdict"] == "not distinguishable", rows[metric]
        assert "not distinguishable at 95%" in rows[metric]["message"]

    listed = client.get("/api/runs", params={"status": "imported"}).json()
    assert [r["id"] for r in listed["runs"]] == [twin["id"], run["id"]]
    page = client.get("/")
    assert run["id"] in page.text and "status-imported" in page.text
    assert client.get(f"/runs/{run['id']}").status_code == 200
    exported = client.get(f"/api/runs/{run['id']}/export").json()
    assert exported["median_tpot_ms"] == data["median_tpot_ms"] and exported["ttfts"] == data["ttfts"]


def test_imported_run_can_be_the_baseline_and_is_never_scheduled(client: TestClient) -> None:
    data = _reference()
    for key in DETAILED_ONLY:
        del data[key]
    response = client.post("/api/imports", json=data)
    assert response.status_code == 201, response.text
    run = response.json()
    assert client.get(f"/api/runs/{run['id']}/requests").json() == []
    assert run["summary"]["p99_itl_ms"] == data["p99_itl_ms"]
    assert run["progress"]["total"] == 8
    marked = client.post(f"/api/runs/{run['id']}/baseline")
    assert marked.status_code == 200, marked.text
    assert marked.json()["arm"] == run["id"]
    assert client.get(f"/api/runs/{run['id']}/baseline").json()["is_baseline"] is True
    # A run submitted after it is placed and runs: the queue, read oldest first, has been
    # read past the import since, and the imported run was not taken.
    later = wait_finished(client, client.post("/api/runs", json=LATER).json()["id"], timeout=60)
    assert later["status"] == "succeeded", later["error"]
    again = client.get(f"/api/runs/{run['id']}").json()
    assert again["status"] == "imported" and again["worker_id"] is None
    assert [w["id"] for w in client.get("/api/workers").json()] == [later["worker_id"]]
    assert client.post(f"/api/runs/{run['id']}/cancel").status_code == 409
    assert client.delete(f"/api/runs/{run['id']}").status_code == 204


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d.pop("duration"), "key 'duration' is missing"),
        (lambda d: d.pop("model_id"), "key 'model_id' is missing"),
        (lambda d: d.pop("itls"), "no 'itls'"),
        (lambda d: d.update(ttfts=d["ttfts"][:3]), "'ttfts' of the result file has 3 entries"),
        (lambda d: d.update(completed="eight"), "'completed' of the result file is not a finite number"),
        (lambda d: d.update(date="yesterday"), "'date' of the result file is not"),
        (lambda d: d.update(max_concurrency=-4), "max_concurrency"),
        (lambda d: d.update(total_output_tokens=1e300), "'total_output_tokens' of the result file is not"),
        (lambda d: d["ttfts"].__setitem__(2, -1.0), "entry 2 of 'ttfts' is not a finite number of at least"),
        (lambda d: d["start_times"].__setitem__(0, -1e12), "the requests of the result file span"),
    ],
)
def test_a_file_that_is_no_result_is_422_naming_the_key(shared_client: TestClient, change: Any,
                                                         needle: str) -> None:
    data = copy.deepcopy(_reference())
    change(data)
    response = shared_client.post("/api/imports", json=data)
    assert response.status_code == 422, response.text
    assert needle in str(response.json()["detail"])
    assert shared_client.get("/api/runs").json()["total"] == 0


def test_import_of_no_object_is_422(client: TestClient) -> None:
    response = client.post("/api/imports", json=[1, 2])
    assert response.status_code == 422
    assert client.get("/api/runs").json()["total"] == 0


@pytest.mark.parametrize("detailed", [True, False])
def test_a_file_whose_every_request_failed_is_refused_saying_so(client: TestClient, detailed: bool) -> None:
    data = copy.deepcopy(_reference())
    n = data["num_prompts"]
    data.update(completed=0, failed=n, total_output_tokens=0)
    if detailed:
        data.update(errors=["connection refused"] * n, output_lens=[0] * n)
    else:
        for key in DETAILED_ONLY:
            data.pop(key, None)
    response = client.post("/api/imports", json=data)
    assert response.status_code == 422, response.text
    assert "every request of the result file failed" in response.json()["detail"]
    assert client.get("/api/runs").json()["total"] == 0
