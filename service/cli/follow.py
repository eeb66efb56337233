"""Following work on the service live: a progress bar per run (requests done of total,
elapsed, ETA, the running decode median ITL), a line per sweep point; Ctrl-C cancels on the
service. Polls once a second at most, so the display moves at least that often."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from service.cli.client import ApiError, Client

# The statuses a run ends in.
ENDED = ("succeeded", "failed", "cancelled", "imported")
POLL_S = 0.5
# Where the output is not a terminal: a progress line at least this often (seconds).
LINE_S = 10.0


def _eta(seconds: Any) -> str:
    if seconds is None:
        return "-:--:--"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _itl(value: Any) -> str:
    return "decode ITL -" if value is None else f"decode ITL {value:.2f} ms"


def follow_runs(client: Client, run_ids: Sequence[str], console: Console, quiet: bool = False,
                cancel: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Follow runs (a run's trials, one after another) until each has ended; their last state.
    Ctrl-C calls ``cancel`` (which cancels them on the service) and raises KeyboardInterrupt."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"), TextColumn("{task.fields[itl]}"))
    ended: list[dict[str, Any]] = []
    try:
        with Progress(*columns, console=console, disable=quiet or not console.is_terminal,
                      refresh_per_second=4) as bar:
            for run_id in run_ids:
                task = bar.add_task(run_id, total=None, eta="-:--:--", itl=_itl(None))
                said, said_at = "", 0.0
                while True:
                    live = client.get(f"/api/runs/{run_id}/live")
                    done, eta, itl = live["completed"] + live["failed"], _eta(live["eta_s"]), \
                        _itl(live["decode_median_itl_ms"])
                    # While its server starts, what it waits for and how long, as the service says it.
                    state = live.get("waiting") or live["status"]
                    bar.update(task, total=live["total"], completed=done, eta=eta, itl=itl,
                               description=f"{run_id} {state}")
                    # Not a terminal (a pipe, a log): a line when something moved, or every LINE_S.
                    line = (f"{run_id} {state}" if live.get("waiting")
                            else f"{run_id} {live['status']} {done}/{live['total']} ETA {eta} {itl}")
                    # A wait's elapsed time moves every second: a new line when its phase does.
                    moved = re.sub(r": \d+[hms\d]*", "", line)
                    if not quiet and not console.is_terminal and (
                            moved != said or time.monotonic() - said_at > LINE_S):
                        console.print(line, highlight=False, markup=False)
                        said, said_at = moved, time.monotonic()
                    if live["status"] in ENDED:
                        break
                    time.sleep(POLL_S)
                ended.append(client.get(f"/api/runs/{run_id}"))
    except KeyboardInterrupt:
        if cancel is not None:
            cancel()
        raise
    return ended


def _point_label(point: Mapping[str, Any], keys: Sequence[str]) -> str:
    return " ".join(f"{k}={point.get(k)}" for k in keys)


def follow_sweep(client: Client, sweep_id: str, console: Console,
                 cancel: Callable[[], None] | None = None) -> dict[str, Any]:
    """One progress line per grid point (its trials done of all, its status) until every run
    of the sweep has ended; the sweep as it ended."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[state]}"))
    try:
        with Progress(*columns, console=console, refresh_per_second=4,
                      disable=not console.is_terminal) as bar:
            tasks: dict[str, Any] = {}
            said: dict[str, str] = {}
            while True:
                sweep = client.get(f"/api/sweeps/{sweep_id}")
                keys = list(sweep["grid"])
                by_point: dict[str, list[Mapping[str, Any]]] = {}
                for run in sweep["runs"]:
                    label = _point_label({k: _spec_value(run["spec"], k) for k in keys}, keys)
                    by_point.setdefault(label, []).append(run)
                for label, runs in by_point.items():
                    if label not in tasks:
                        tasks[label] = bar.add_task(label, total=len(runs), state="")
                    states = [r["status"] for r in runs]
                    done = sum(s in ENDED for s in states)
                    counts = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states))
                    bar.update(tasks[label], total=len(runs), completed=done, state=counts)
                    # Not a terminal: a line for each point whose runs moved.
                    line = f"{label}: {done}/{len(runs)} ({counts})"
                    if not console.is_terminal and said.get(label) != line:
                        console.print(line, highlight=False, markup=False)
                        said[label] = line
                # Under until_decided a look may still queue pairs once the runs have ended.
                looking = any(row.get("next_look") for row in sweep.get("fill_vs_prefill") or [])
                if sweep["runs"] and all(r["status"] in ENDED for r in sweep["runs"]) and not looking:
                    return dict(sweep)
                time.sleep(POLL_S)
    except KeyboardInterrupt:
        if cancel is not None:
            cancel()
        raise


def _spec_value(spec: Mapping[str, Any], key: str) -> Any:
    """A grid key's value in a run's spec; dotted names reach into nested specs (``fill.mean``)."""
    value: Any = spec
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


# A probe's verdicts that end it (for now: a boundary probe may get another trial later).
PROBE_ENDS = ("pass", "fail", "capped", "refused", "failed")
# A search's statuses once it has ended.
SEARCH_ENDS = ("succeeded", "failed", "cancelled")


def probe_line(input_len: int, probe: Mapping[str, Any], sla: Mapping[str, Any]) -> str:
    """A probe as decided: its verdict with the SLA figure, interval and trials, or what
    capped or refused it."""
    head = f"input_len={input_len} concurrency={probe['concurrency']}: {probe['verdict']}"
    if probe.get("capped"):
        return f"{head} ({probe['capped']})"
    if probe.get("refused"):
        return f"{head} ({probe['refused']})"
    if probe.get("figure_ms") is None:
        return head
    ci = probe.get("ci_ms")
    interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else " (no interval yet)"
    by = f", by the {probe['decided_by']}" if probe.get("decided_by") else ""
    return (f"{head}, {sla['metric']} {probe['figure_ms']:.2f} ms{interval} against "
            f"{sla['max_ms']:g} ms over {probe['trials']} trial{'s' * (probe['trials'] != 1)}{by}")


# How long a search may stay active with every one of its runs ended before its follow
# gives up: a look queues the next runs, or ends the search, within seconds of a run's end.
LOOK_WAIT_S = 300.0

# A prefill rate's verdicts that end it.
RATE_ENDS = ("pass", "fail", "undecided", "failed")


def rate_line(input_len: int, probe: Mapping[str, Any], max_ms: float) -> str:
    """A prefill rate as judged: its verdict with the p99 TTFT (and its interval) against
    the limit over its runs and what decided it, or the run that ended without numbers."""
    head = f"input_len={input_len} prefill rate={probe['request_rate']:g}/s: {probe['verdict']}"
    if probe.get("p99_ttft_ms") is None:
        return f"{head} (run {probe['run_id']} {probe['status']} without numbers)"
    ci = probe.get("ci_ms")
    interval = (f" [{ci[0]:.2f}, {'open' if ci[1] is None else format(ci[1], '.2f')}]" if ci else "")
    trials = probe.get("trials", 1)
    by = f", by the {probe['decided_by']}" if probe.get("decided_by") else ""
    return (f"{head}, p99 TTFT {probe['p99_ttft_ms']:.2f} ms{interval} against {max_ms:g} ms over "
            f"{trials} run{'s' * (trials != 1)}{by}")


def follow_capacity(client: Client, search_id: str, console: Console,
                    cancel: Callable[[], None] | None = None,
                    look_wait_s: float = LOOK_WAIT_S) -> dict[str, Any]:
    """A line per probe each time one is decided and per prefill rate each time its run is
    judged (and per input length once its boundary, or its prefill rate, is), until the
    search has ended; the search as it ended. Ctrl-C calls ``cancel``. An ``ApiError`` once
    the search has stayed active with every run ended for ``look_wait_s``: no look advances it."""
    said: set[tuple[Any, ...]] = set()
    ended_runs: set[str] = set()
    phases = _Phases(console)
    idle_since: float | None = None
    try:
        while True:
            search = client.get(f"/api/capacity/{search_id}")
            for context in search["contexts"]:
                for probe in context["probes"]:
                    key = (context["input_len"], probe["concurrency"], probe["verdict"], probe["trials"])
                    if probe["verdict"] in PROBE_ENDS and key not in said:
                        said.add(key)
                        # One line each however wide the terminal: scripts grep them.
                        console.print(probe_line(context["input_len"], probe, search["sla"]),
                                      highlight=False, markup=False, soft_wrap=True)
                prefill = context.get("prefill")
                for probe in (prefill or {}).get("probes", []):
                    judged = (context["input_len"], "prefill", probe["request_rate"], probe["verdict"],
                              probe["run_id"])
                    if probe["verdict"] in RATE_ENDS and judged not in said:
                        said.add(judged)
                        console.print(rate_line(context["input_len"], probe, prefill["ttft_p99_max_ms"]),
                                      highlight=False, markup=False, soft_wrap=True)
                measured = (context["input_len"], "prefill")
                if prefill and prefill["state"] != "measuring" and measured not in said:
                    said.add(measured)
                    console.print(f"input_len={context['input_len']} prefill: {prefill['state']} after "
                                  f"{prefill['runs']} runs", highlight=False, markup=False, soft_wrap=True)
                if context["state"] != "probing" and (context["input_len"], "end") not in said:
                    said.add((context["input_len"], "end"))
                    console.print(f"input_len={context['input_len']}: {context['state']} after "
                                  f"{context['runs']} runs", highlight=False, markup=False, soft_wrap=True)
            if search["status"] in SEARCH_ENDS:
                return dict(search)
            if not _all_runs_ended(client, search, ended_runs, phases):
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > look_wait_s:
                raise ApiError(
                    f"capacity search {search_id} is still active, but every one of its {search['runs']} "
                    f"runs has ended and no look has queued more or ended it for {look_wait_s:.0f} s: "
                    f"its look may have failed (see the service's log). GET /api/capacity/{search_id} "
                    f"shows where it stands; POST /api/capacity/{search_id}/cancel ends it")
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        if cancel is not None:
            cancel()
        raise


class _Phases:
    """A line each time a search's run moves on while it waits (its server's start phases,
    as ``follow_runs`` shows them) and when it starts running: a search's first minutes are
    a server start and the first probe, which decide nothing to print otherwise."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.said: dict[str, str] = {}

    def saw(self, run_id: str, where: str, live: Mapping[str, Any]) -> None:
        state = live.get("waiting") or live["status"]
        if live["status"] in ENDED:
            return  # the probe's own line says how it ended
        # A wait's elapsed time moves every second: a new line when its phase does.
        moved = re.sub(r": \d+[hms\d]*", "", state)
        if self.said.get(run_id) != moved:
            self.said[run_id] = moved
            self.console.print(f"{run_id} ({where}): {state}", highlight=False, markup=False,
                               soft_wrap=True)


def _all_runs_ended(client: Client, search: Mapping[str, Any], ended: set[str],
                    phases: _Phases | None = None) -> bool:
    """Whether every run of the search has ended (``ended``: the ones seen ended, kept
    across polls so that each is read until then only); each run not ended is shown to
    ``phases`` on the way."""
    where: dict[str, str] = {}
    for context in search["contexts"]:
        for probe in context["probes"]:
            for run_id in probe["run_ids"]:
                where[run_id] = f"input_len={context['input_len']} concurrency={probe['concurrency']}"
        for probe in (context.get("prefill") or {}).get("probes", []):
            for run_id in probe["run_ids"]:
                where[run_id] = f"input_len={context['input_len']} prefill rate={probe['request_rate']:g}/s"
    # Fewer than it has: a run the answer does not list, which may not have ended.
    all_ended: bool = len(where) >= int(search["runs"])
    for run_id in sorted(set(where) - ended):
        live = client.get(f"/api/runs/{run_id}/live")
        if phases is not None:
            phases.saw(run_id, where[run_id], live)
        if live["status"] not in ENDED:
            all_ended = False
        else:
            ended.add(run_id)
    return all_ended
