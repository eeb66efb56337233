"""What the command line prints: the result block of ``vllm bench serve`` (its headings, line
order and number formats, so a person's eyes and scripts find what they know) and decodebench's
own lines after it, and tables of runs, sweeps and comparisons."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

# Each metric section of vLLM's block: (key, name in its lines, heading), in vLLM's order.
SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
    ("client_queue_time", "Client Queue Time", "Client-side Queueing"),
    ("e2el_including_client_queue", "E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
)


def _line(label: str, value: Any, decimals: bool = True) -> str:
    shown = f"{value:<10.2f}" if decimals and isinstance(value, int | float) else f"{value!s:<10}"
    return f"{label:<40} {shown}"


def _percentile_words(result: Mapping[str, Any], metric: str) -> list[str]:
    """The percentiles the file has for a metric (``p99``, ``p99.9``), in the file's order."""
    suffix = f"_{metric}_ms"
    return [k[1:-len(suffix)] for k in result
            if k.startswith("p") and k.endswith(suffix) and k[1:-len(suffix)].replace(".", "").isdigit()]


def vllm_block(result: Mapping[str, Any], percentile_metrics: Sequence[str]) -> list[str]:
    """The lines ``vllm bench serve`` prints after a run, from its result file's keys."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _line("Successful requests:", result["completed"], False),
             _line("Failed requests:", result["failed"], False)]
    if result.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", result["max_concurrency"], False))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(_line("Request rate configured (RPS):", float(result["request_rate"])))
    lines += [_line("Benchmark duration (s):", result["duration"]),
              _line("Total input tokens:", result["total_input_tokens"], False),
              _line("Total generated tokens:", result["total_output_tokens"], False),
              _line("Request throughput (req/s):", result["request_throughput"])]
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"]))
    lines += [_line("Output token throughput (tok/s):", result["output_throughput"]),
              _line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
              _line("Peak concurrent requests:", result["max_concurrent_requests"]),
              _line("Total token throughput (tok/s):", result["total_token_throughput"])]
    for key, name, heading in SECTIONS:
        if key not in percentile_metrics or f"mean_{key}_ms" not in result:
            continue
        lines += ["{s:{c}^{n}}".format(s=heading, n=50, c="-"),
                  _line(f"Mean {name} (ms):", result[f"mean_{key}_ms"]),
                  _line(f"Median {name} (ms):", result[f"median_{key}_ms"])]
        lines += [_line(f"P{word} {name} (ms):", result[f"p{word}_{key}_ms"])
                  for word in _percentile_words(result, key)]
    lines.append("=" * 50)
    return lines


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def _interval(ci: Any) -> str:
    return f" [{ci[0]:.2f}, {ci[1]:.2f}]" if isinstance(ci, list) and len(ci) == 2 else ""


def decodebench_lines(run: Mapping[str, Any], url: str) -> list[str]:
    """decodebench's own lines after vLLM's block: the run, how its KV cache was made, the
    steady decode figures with their 95% intervals, the roofline and the warnings."""
    spec = run["spec"]
    summary = run.get("summary") or {}
    how = ("KV cache filled by the connector (no prefill)" if spec.get("mode") == "fill"
           else "KV cache from a real prefill, done once and replayed from the prefix cache"
           if spec.get("mode") == "seeded" else "KV cache from a real prefill")
    lines = ["{s:{c}^{n}}".format(s=" decodebench ", n=50, c="-"),
             _line("Run:", run["id"], False),
             _line("Status:", run["status"], False),
             _line("Mode:", f"{spec.get('mode')}: {how}", False)]
    if summary:
        for key, label in (("decode_median_itl_ms", "Decode median ITL (ms):"),
                           ("decode_p99_itl_ms", "Decode P99 ITL (ms):"),
                           ("decode_median_tpot_ms", "Decode median TPOT (ms):")):
            if key in summary:
                lines.append(f"{label:<40} {_ms(summary[key])}{_interval(summary.get(f'{key}_ci'))}")
        lines.append(_line("Steady decode gaps:", summary.get("decode_gaps") or 0, False))
        roof = summary.get("roofline") or {}
        if roof.get("pct_of_roofline") is not None:
            lines.append(_line("Share of the roofline (%):", roof["pct_of_roofline"]))
        energy = summary.get("energy") or {}
        if energy.get("joules_per_output_token") is not None:
            lines.append(_line("Energy per output token (J):", energy["joules_per_output_token"]))
    if run.get("error"):
        lines.append(_line("Error:", run["error"], False))
    for warning in run.get("warnings") or []:
        lines.append(f"warning {warning['code']}: {warning['message']}")
    lines += [_line("Page:", f"{url}/runs/{run['id']}", False), "=" * 50]
    return lines


def runs_table(runs: Sequence[Mapping[str, Any]]) -> Table:
    table = Table("status", "model", "ISL", "OSL", "conc", "mode", "done", "decode ITL ms",
                  "created", title="runs, newest first")
    table.add_column("id", no_wrap=True)
    table.columns.insert(0, table.columns.pop())
    for run in runs:
        spec, summary, progress = run["spec"], run.get("summary") or {}, run["progress"]
        measured = summary.get("decode_median_itl_ms") if summary.get("decode_gaps") else None
        table.add_row(run["id"], run["status"], spec.get("model", ""), str(spec.get("input_len", "")),
                      str(spec.get("output_len", "")), str(spec.get("max_concurrency") or "-"),
                      spec.get("mode", ""), f"{progress['completed']}/{progress['total']}",
                      _ms(measured), str(run["created_at"])[:19])
    return table


def compare_table(result: Mapping[str, Any]) -> Table:
    """``GET /api/compare`` as a table: each arm against the first, per metric."""
    arms = [arm["id"] for arm in result["arms"]]
    table = Table("metric", *arms[:1], *(f"{a} / {arms[0]}" for a in arms[1:]), "verdict",
                  title=f"against {arms[0]} (95% intervals)")
    for row in result["metrics"]:
        cells = [row.get("key") or row.get("metric", "")]
        values = row.get("values") or []
        first = values[0] if values else None
        cells.append(_ms(first.get("value")) + _interval(first.get("ci")) if isinstance(first, dict) else "-")
        verdicts = []
        for change in row.get("changes") or []:
            ratio = change.get("ratio")
            cells.append("-" if ratio is None else f"{ratio:.3f}{_interval(change.get('ci'))}")
            verdict = change.get("verdict", "")
            if verdict == "different" and change.get("across_runs") is False:
                verdict += " (within these runs only)"
            if change.get("tolerance"):
                verdict += f", {change['tolerance']}"
            verdicts.append(verdict)
        table.add_row(*cells, ", ".join(verdicts))
    return table


# A sweep point's figures as the command prints them: (key, name, unit).
POINT_LINE = (("decode_median_tpot_ms", "decode median TPOT", "ms"),
              ("decode_median_itl_ms", "decode median ITL", "ms"),
              ("median_ttft_ms", "median TTFT", "ms"),
              ("output_throughput", "output", "tok/s"))


def point_figures(point: Mapping[str, Any]) -> str:
    """One sweep point's figures with their 95% intervals, and its trials."""
    figures = point.get("figures") or {}
    parts = []
    for key, name, unit in POINT_LINE:
        fig = figures.get(key)
        if isinstance(fig, Mapping) and fig.get("value") is not None:
            parts.append(f"{name} {fig['value']:.2f}{_interval(fig.get('ci'))} {unit}")
    trials = len(point.get("runs") or [])
    ok = point.get("succeeded", 0)
    count = f"{ok} of {trials} trials succeeded" if ok != trials else \
        f"{trials} trial{'s' * (trials != 1)}"
    return (", ".join(parts) or "no figures") + f" ({count})"


def _figure(figure: Any, digits: int = 1) -> str:
    """A figure as ``value [lo, hi]``, or ``-``."""
    if not isinstance(figure, Mapping):
        return "-"
    lo, hi = figure["ci"]
    return f"{figure['value']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def capacity_table(search: Mapping[str, Any]) -> Table:
    """``GET /api/capacity/{id}`` as a table, a row per input length: the boundary with the
    range that holds it, the first failing concurrency, the decode rates there, the cost."""
    sla = search["sla"]
    table = Table("input_len", "max concurrency", "range", "first failing", "limited by",
                  "confidence", "decode tok/s per user (1/TPOT)", "decode tok/s per server", "runs", "wall s",
                  title=(f"capacity search {search['id']} ({search['status']}): largest concurrency with "
                         f"{sla['metric']} <= {sla['max_ms']:g} ms; decode output tokens/s, 95% intervals"))
    for c in search["contexts"]:
        low, high = c["boundary_range"]
        at_least = c.get("at_least")
        boundary = (">= " if at_least else "") + str(c["max_concurrency"]) + ("" if c["decided"] else " ?")
        table.add_row(str(c["input_len"]), boundary, f"[{low}, open)" if at_least else f"[{low}, {high}]",
                      str(c["first_failing"] or "-"), c["limited_by"],
                      f"{c['confidence']:.0%}", _figure(c.get("tokens_per_s_per_user")),
                      _figure(c.get("tokens_per_s_per_server")), str(c["runs"]),
                      "-" if c["wall_s"] is None else f"{c['wall_s']:.0f}")
    return table


def ratio_table(search: Mapping[str, Any]) -> Table | None:
    """Decode servers per prefill server per input length (P / D with its inputs), or None
    when the answer has none (no prefill rate given, or no boundary yet)."""
    rows = [(c["input_len"], c["decode_servers_per_prefill_server"]) for c in search["contexts"]
            if c.get("decode_servers_per_prefill_server")]
    if not rows:
        return None
    table = Table("input_len", "prefill tok/s", "P req/s", "output_len", "C max", "mean TPOT ms at C max",
                  "D req/s", "P / D", "decode servers per prefill server",
                  title="P = prefill tok/s / input_len; D = C max / (output_len x mean TPOT); ranges carry "
                        "P's bracket, D's 95% interval over trials and C max's range")
    for input_len, r in rows:
        prefill = f"{r['prefill_tokens_per_s']:g}"
        if r.get("prefill_source") == "measured":
            low, high = r["prefill_tokens_per_s_range"]
            prefill = (f">= {low:.4g} measured" if high is None
                       else f"{low:.4g} [{low:.4g}, {high:.4g}) measured")
        d_lo, d_hi = r["decode_requests_per_s_range"]
        r_lo, r_hi = r["ratio_range"]
        table.add_row(str(input_len), prefill, f"{r['prefill_requests_per_s']:.3g}",
                      str(r["output_len"]), str(r["max_concurrency"]),
                      _figure(r["tpot_ms"], 2) if r.get("tpot_ms") else "one trial",
                      f"{r['decode_requests_per_s']:.3g} [{d_lo:.3g}, {d_hi:.3g}]",
                      f"{r['ratio']:.3g} [{r_lo:.3g}, {'open' if r_hi is None else format(r_hi, '.3g')}]",
                      r["sentence"])
    return table
