"""``decodebench capacity``: a capacity search from flags as ``vllm bench serve`` takes
them, followed probe by probe, and its answer as a table per input length."""

from __future__ import annotations

import sys
from typing import Any

import click

from service.cli import render, vllm_flags
from service.cli.client import ApiError
from service.cli.common import client_of, console, err, fail
from service.cli.follow import follow_capacity


@click.command(context_settings={"ignore_unknown_options": False})
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
