"""A sweep, or a capacity search's probes, exported as the decode profile NVIDIA Dynamo's SLA
planner loads (``selected_decode_interpolation/raw_data.npz``), through the service's real
path against stub servers, read back with numpy as Dynamo's loaders read it.

Dynamo's own loader is not imported here. The ``ai-dynamo`` wheel (1.6.1, pure Python) holds
it (``dynamo/planner/monitoring/perf_metrics.py``, ``_convert_decode_profiling``; earlier
releases ``DecodeInterpolator``), but importing any of ``dynamo.planner`` runs its package
``__init__``, which imports its Kubernetes, Redis and ZMQ connectors and the compiled
``ai-dynamo-runtime``: far from light. So the tests read the file as those loaders do
(``np.load``; the four arrays; ``max_kv_tokens[0]``), interpolate it with scipy's ``griddata``
(cubic) as ``DecodeInterpolator`` does, and take the batch size back as the 1.6.1 converter
does (``round(x_kv_usage x max_kv_tokens / y_context_length)``). The dtypes and shapes asserted
are those of the profile Dynamo ships as its planner's test data
(``planner/tests/data/profiling_results/H200_TP1P_TP1D``): four float64 arrays of one length,
``max_kv_tokens`` int64 of shape (1,).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.interpolate
from fastapi.testclient import TestClient

from service.analysis.server_metrics import KV_USAGE
from service.storage import measurements, store
from service.web import dynamo_export
from tests.conftest import API_TOKEN, TESTS, wait_finished
from tests.test_capacity import SLOPED, wait_search

REPO = TESTS.parent
BASE = {"input_len": 16, "output_len": 8, "num_prompts": 4, "max_concurrency": 2}
ARRAYS = {"x_kv_usage", "y_context_length", "z_itl", "z_thpt_per_gpu"}


def _export(client: TestClient, path: str, **params: str) -> tuple[dict[str, np.ndarray], dict[str, Any],
                                                                   zipfile.ZipFile]:
    response = client.get(path, params={"format": "dynamo", **params})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/zip"
    zipped = zipfile.ZipFile(io.BytesIO(response.content))
    with np.load(io.BytesIO(zipped.read(dynamo_export.NPZ_PATH))) as raw:
        arrays = {name: raw[name] for name in raw.files}
    return arrays, json.loads(zipped.read(dynamo_export.MANIFEST_PATH)), zipped


def _summary(client: TestClient, run_id: str) -> dict[str, Any]:
    summary: dict[str, Any] = client.get(f"/api/runs/{run_id}").json()["summary"]
    return summary


def _check_layout(arrays: dict[str, np.ndarray], points: int) -> None:
    assert set(arrays) == ARRAYS | {"max_kv_tokens"}
    for name in ARRAYS:
        assert arrays[name].dtype == np.float64 and arrays[name].shape == (points,), name
    assert arrays["max_kv_tokens"].dtype == np.int64 and arrays["max_kv_tokens"].shape == (1,)


def _run_by_run(client: TestClient, arrays: dict[str, np.ndarray], manifest: dict[str, Any]) -> None:
    """Each point's values against its runs' own summaries and lengths."""
    kv_tokens = int(arrays["max_kv_tokens"][0])
    for i, point in enumerate(manifest["points"]):
        runs = [client.get(f"/api/runs/{r}").json() for r in point["run_ids"]]
        spec = runs[0]["spec"]
        concurrency = min(spec["max_concurrency"], spec["num_prompts"])
        itl = [r["summary"]["decode_median_itl_ms"] for r in runs]
        per_gpu = [r["summary"]["output_throughput"] / spec["engine"]["tensor_parallel_size"] for r in runs]
        assert arrays["z_itl"][i] == pytest.approx(np.mean(itl), rel=1e-12)
        assert arrays["z_thpt_per_gpu"][i] == pytest.approx(np.mean(per_gpu), rel=1e-12)
        context = spec["input_len"] + spec["output_len"] / 2
        assert arrays["y_context_length"][i] == context
        assert (point["input_len"], point["concurrency"]) == (spec["input_len"], concurrency)
        # Dynamo's own formula on the file's max_kv_tokens, whatever was measured: its
        # planner takes the batch back from it.
        computed = concurrency * context / kv_tokens
        assert [t["kv_usage_computed"] for t in point["trials"]] == pytest.approx([computed] * len(runs))
        assert arrays["x_kv_usage"][i] == pytest.approx(computed, rel=1e-12)
        assert point["kv_usage_source"] == "computed"


def test_sweep_exports_dynamos_decode_profile_point_by_point(client: Any) -> None:
    body = {"base": BASE, "grid": {"input_len": [8, 16], "max_concurrency": [1, 2]}}
    sweep = client.post("/api/sweeps", json=body).json()
    assert all(wait_finished(client, r["id"])["status"] == "succeeded" for r in sweep["runs"])

    arrays, manifest, zipped = _export(client, f"/api/sweeps/{sweep['id']}/export")
    assert set(zipped.namelist()) == {"selected_decode_interpolation/raw_data.npz", "manifest.json"}
    _check_layout(arrays, 4)
    run = client.get(f"/api/runs/{sweep['runs'][0]['id']}").json()
    assert arrays["max_kv_tokens"][0] == run["provenance"]["kv_cache_tokens"] > 0
    _run_by_run(client, arrays, manifest)
    exported = sorted(r for p in manifest["points"] for r in p["run_ids"])
    assert exported == sorted(r["id"] for r in sweep["runs"])
    assert manifest["skipped"] == [] and manifest["warnings"] == []

    # As Dynamo's planner reads it: the batch size back from the KV usage, exactly.
    for i, point in enumerate(manifest["points"]):
        kv = round(float(arrays["x_kv_usage"][i]) * int(arrays["max_kv_tokens"][0]))
        assert max(1, round(kv / float(arrays["y_context_length"][i]))) == point["concurrency"]
    # And as DecodeInterpolator interpolates it: cubic over (kv usage, context length).
    grid = scipy.interpolate.griddata((arrays["x_kv_usage"], arrays["y_context_length"]), arrays["z_itl"],
                                      (arrays["x_kv_usage"], arrays["y_context_length"]), method="cubic")
    assert np.allclose(grid, arrays["z_itl"])


def test_measured_kv_usage_goes_in_the_manifest_beside_dynamos_formula(client: Any) -> None:
    body = {"base": {**BASE, "max_concurrency": 1}, "grid": {"input_len": [8, 16]}}
    sweep = client.post("/api/sweeps", json=body).json()
    assert all(wait_finished(client, r["id"])["status"] == "succeeded" for r in sweep["runs"])
    engine = client.app.state.engine
    run_id = sweep["runs"][0]["id"]
    samples = measurements.get_samples(engine, run_id)
    first = samples[0]
    decoding = first.start_time + first.ttft + (first.latency - first.ttft) / 2
    prefilling = first.start_time + first.ttft / 2
    measurements.save_server_points(engine, run_id, [(decoding, {KV_USAGE: 0.25}),
                                                     (prefilling, {KV_USAGE: 0.9})])

    arrays, manifest, _ = _export(client, f"/api/sweeps/{sweep['id']}/export")
    _run_by_run(client, arrays, manifest)
    (point,) = [p for p in manifest["points"] if p["run_ids"] == [run_id]]
    # One request at a time: a scrape counts while a request is past its first token.
    steady = [p["values"][KV_USAGE] for p in measurements.server_points(engine, run_id)
              if KV_USAGE in p["values"] and any(s.start_time + s.ttft < p["t"] < s.start_time + s.latency
                                                 for s in samples)]
    assert 0.25 in steady and 0.9 not in steady
    assert point["trials"][0]["kv_usage_measured"] == pytest.approx(np.mean(steady))
    # The file keeps the formula's value, which the planner reads the batch back from.
    assert point["kv_usage_source"] == "computed"
    assert arrays["x_kv_usage"][point["index"]] == pytest.approx(point["trials"][0]["kv_usage_computed"])
    # Far from Dynamo's formula on the stub's tiny lengths: said in the manifest.
    assert any("x_kv_usage holds the formula's value" in w for w in manifest["warnings"])


def test_capacity_search_exports_a_point_per_probe(stub_service: Any) -> None:
    client = stub_service(SLOPED)
    body = {"base": {"output_len": 8}, "input_lens": [32, 64], "max_concurrency": 4,
            "sla": {"metric": "decode_median_itl_ms", "max_ms": 1000}}
    done = wait_search(client, client.post("/api/capacity", json=body).json()["id"])
    assert done["status"] == "succeeded", done

    arrays, manifest, _ = _export(client, f"/api/capacity/{done['id']}/export")
    probes = {(c["input_len"], p["concurrency"]): p for c in done["contexts"] for p in c["probes"]}
    _check_layout(arrays, len(probes))
    _run_by_run(client, arrays, manifest)
    assert {(p["input_len"], p["concurrency"]): p["run_ids"] for p in manifest["points"]} == {
        key: p["run_ids"] for key, p in probes.items()}
    # A probe of several trials is one point, their mean.
    assert any(len(p["run_ids"]) >= 2 for p in manifest["points"])


def test_a_sweep_over_mode_exports_one_mode_asked(client: Any) -> None:
    body = {"base": BASE, "grid": {"input_len": [8, 16], "mode": ["fill", "prefill"]}}
    sweep = client.post("/api/sweeps", json=body).json()
    assert all(wait_finished(client, r["id"])["status"] == "succeeded" for r in sweep["runs"])

    mixed = client.get(f"/api/sweeps/{sweep['id']}/export", params={"format": "dynamo"})
    assert mixed.status_code == 409 and "mode=" in mixed.json()["detail"], mixed.text
    arrays, manifest, _ = _export(client, f"/api/sweeps/{sweep['id']}/export", mode="prefill")
    _check_layout(arrays, 2)
    _run_by_run(client, arrays, manifest)
    assert manifest["mode"] == "prefill"
    assert {s["reason"] for s in manifest["skipped"]} == {"mode fill, not the prefill asked"}
    # Both points at one concurrency: Dynamo's interpolation needs a plane, said so.
    assert any("griddata" in w for w in manifest["warnings"])


def test_dynamo_export_refusals(client: Any) -> None:
    body = {"base": {**BASE, "num_prompts": 2000, "output_len": 64}, "grid": {"max_concurrency": [1, 2]}}
    sweep = client.post("/api/sweeps", json=body).json()
    response = client.get(f"/api/sweeps/{sweep['id']}/export", params={"format": "dynamo"})
    assert response.status_code == 409 and "nothing to export" in response.json()["detail"]
    assert client.post(f"/api/sweeps/{sweep['id']}/cancel").status_code == 200
    wrong = client.get(f"/api/sweeps/{sweep['id']}/export", params={"format": "dynamo-npz"})
    assert wrong.status_code == 422 and "dynamo" in wrong.text
    assert client.get("/api/capacity/c-nope/export", params={"format": "dynamo"}).status_code == 404


def test_the_step_model_goes_in_when_given_and_the_cli_writes_the_profile(client: Any,
                                                                         tmp_path: Path) -> None:
    body = {"base": BASE, "grid": {"input_len": [8, 16], "max_concurrency": [1, 2]}}
    sweep = client.post("/api/sweeps", json=body).json()
    assert all(wait_finished(client, r["id"])["status"] == "succeeded" for r in sweep["runs"])
    engine = client.app.state.engine
    runs = [store.get_run(engine, r["id"]) for r in sweep["runs"]]
    asked: list[str] = []

    def model(given: Any) -> dict[str, Any]:
        asked.extend(r.id for r in given)
        return {"runs": {r.id: {"ns_per_kv_token": [1.0, 0.5, 1.5]} for r in given}}

    zipped = zipfile.ZipFile(io.BytesIO(dynamo_export.archive(engine, "sweep", runs, step_regression=model)))
    assert sorted(asked) == sorted(r.id for r in runs)
    assert json.loads(zipped.read(dynamo_export.STEP_REGRESSION_PATH))["runs"][runs[0].id] == {
        "ns_per_kv_token": [1.0, 0.5, 1.5]}
    assert dynamo_export.STEP_REGRESSION_PATH in json.loads(zipped.read(dynamo_export.MANIFEST_PATH))["files"]
    nothing = zipfile.ZipFile(io.BytesIO(dynamo_export.archive(engine, "sweep", runs,
                                                               step_regression=lambda _: None)))
    assert dynamo_export.STEP_REGRESSION_PATH not in nothing.namelist()

    directory = tmp_path / "profile"
    written = subprocess.run([sys.executable, "-m", "service.cli", "--url", client.control_url, "--token",
                              API_TOKEN, "export", sweep["id"], str(directory), "--format", "dynamo"],
                             cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert written.returncode == 0, written.stderr
    with np.load(directory / "selected_decode_interpolation" / "raw_data.npz") as raw:
        assert raw["z_itl"].shape == (4,) and raw["max_kv_tokens"].shape == (1,)
    assert json.loads((directory / "manifest.json").read_text())["source"] == f"sweep {sweep['id']}"


def test_the_export_carries_each_runs_step_model_where_its_server_timed_steps(stub_service: Any) -> None:
    # The stub times its steps at a known cost, as the connector inside vLLM does.
    truth = {"fixed": 5.0, "per_kv": 400.0, "per_req": 0.8, "noise": 0.02}
    client = stub_service({"STUB_STEP_MS": json.dumps(truth), "STUB_TOKEN_INTERVAL_S": "0.01"})
    base = {"input_len": 512, "output_len": 48, "num_prompts": 6, "max_concurrency": 3}
    sweep = client.post("/api/sweeps", json={"base": base, "grid": {"input_len": [256, 512]}}).json()
    assert all(wait_finished(client, r["id"])["status"] == "succeeded" for r in sweep["runs"])
    _, manifest, zipped = _export(client, f"/api/sweeps/{sweep['id']}/export")
    assert dynamo_export.STEP_REGRESSION_PATH in zipped.namelist()
    regression = json.loads(zipped.read(dynamo_export.STEP_REGRESSION_PATH))
    assert set(regression["runs"]) == {r["id"] for r in sweep["runs"]}
    for run_id, model in regression["runs"].items():
        # What GET /api/runs/{id}/steps says of the run, coefficient for coefficient.
        steps = client.get(f"/api/runs/{run_id}/steps").json()
        assert model["fixed_ms"] == pytest.approx(steps["fixed_ms"])
        assert model["ns_per_kv_token"] == pytest.approx(steps["ns_per_kv_token"])
        assert model["input_len"] == client.get(f"/api/runs/{run_id}").json()["spec"]["input_len"]
    assert dynamo_export.STEP_REGRESSION_PATH in manifest["files"]
