"""``decodebench sweep`` and ``decodebench trials``: a grid of runs as one sweep, followed
to its end with its verdicts, and more trials of its points."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import click

from service.cli import render
from service.cli.client import ApiError, Client
from service.cli.common import client_of, console, err, fail
from service.cli.follow import follow_sweep


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


@click.command()
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


@click.command()
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
