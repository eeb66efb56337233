"""Charts as a reader sees them: parsed SVG, positions read back through the drawn y axis."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from itertools import pairwise

import numpy as np
import pytest
from markupsafe import Markup

from service.web import charts
from service.web.charts import Point

pytestmark = pytest.mark.unit

NS = "{http://www.w3.org/2000/svg}"
HOSTILE = "<script>x</script>"


def _svg(markup: Markup) -> ET.Element:
    root = ET.fromstring(str(markup))  # raises unless the chart is well-formed XML
    assert root.tag == f"{NS}svg" and "chart" in root.get("class", "").split()
    return root


def _all(root: ET.Element, tag: str, cls: str | None = None) -> list[ET.Element]:
    return [e for e in root.iter(f"{NS}{tag}") if cls is None or cls in e.get("class", "").split()]


def _coords(element: ET.Element) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in (xy.split(",") for xy in element.get("points", "").split())]


def _y_axis(root: ET.Element) -> Callable[[float], float]:
    """Value -> pixel y, from the y-axis tick labels (each drawn 4 px below its grid line)."""
    ticks = [(float(t.text or ""), float(t.get("y", "")) - 4) for t in _all(root, "text", "ytick")]
    (v0, p0), (v1, p1) = ticks[0], ticks[-1]
    return lambda v: p0 + (v - v0) * (p1 - p0) / (v1 - v0)


def _xticks(root: ET.Element) -> dict[str, float]:
    return {t.text or "": float(t.get("x", "")) for t in _all(root, "text", "xtick")}


def _hovers(root: ET.Element) -> list[str]:
    return [c.findtext(f"{NS}title", "") for c in _all(root, "circle", "dot")]


WITH_INTERVALS = {"tpot": [Point(2048, 10.0, 9.0, 12.0), Point(8192, 14.0, 12.5, 16.0),
                           Point(32768, 20.0, 17.0, 25.0)]}


def test_intervals_draw_a_band_from_lo_to_hi() -> None:
    root = _svg(charts.lines(WITH_INTERVALS, "TPOT", "input_len", "ms"))
    (band,) = _all(root, "polygon", "band")
    py = _y_axis(root)
    points = WITH_INTERVALS["tpot"]
    outline = _coords(band)
    # Along the his left to right, back along the los.
    expected = [py(p.hi or 0) for p in points] + [py(p.lo or 0) for p in reversed(points)]
    assert [y for _, y in outline] == pytest.approx(expected, abs=0.2)
    assert band.get("fill-opacity") == "0.15"


def test_intervals_draw_an_error_bar_per_point_from_lo_to_hi() -> None:
    root = _svg(charts.lines(WITH_INTERVALS, "TPOT", "input_len", "ms"))
    bars = _all(root, "line", "errorbar")
    py = _y_axis(root)
    assert len(bars) == 3
    for bar, p in zip(bars, WITH_INTERVALS["tpot"], strict=True):
        assert p.lo is not None and p.hi is not None
        assert float(bar.get("y1", "")) == pytest.approx(py(p.lo), abs=0.2)
        assert float(bar.get("y2", "")) == pytest.approx(py(p.hi), abs=0.2)
    assert len(_all(root, "line", "errorcap")) == 6


def test_points_without_intervals_get_no_band_and_no_error_bars() -> None:
    root = _svg(charts.lines({"a": [(1, 2.0), (2, 3.0)], "b": [Point(1, 1.0), Point(2, 1.5)]},
                             "T", "x", "y"))
    assert _all(root, "polygon", "band") == [] and _all(root, "line", "errorbar") == []
    assert len(_all(root, "polyline")) == 2


def test_band_spans_only_consecutive_points_with_both_ends() -> None:
    points = [Point(1, 5.0, 4.0, 6.0), Point(2, 5.0, 4.0, 6.0), Point(3, 5.0),
              Point(4, 5.0, 4.0, 6.0), Point(5, 5.0, lo=4.0)]
    root = _svg(charts.lines({"a": points}, "T", "x", "y"))
    (band,) = _all(root, "polygon", "band")
    assert len(_coords(band)) == 4  # the first two points only; the lone fourth has just a bar
    assert len(_all(root, "line", "errorbar")) == 3


def test_y_range_reaches_every_interval_top() -> None:
    root = _svg(charts.lines({"a": [Point(1, 1.0, 0.5, 50.0), Point(2, 2.0)]}, "T", "x", "y"))
    (bar,) = _all(root, "line", "errorbar")
    assert charts.TOP <= float(bar.get("y2", "")) < float(bar.get("y1", ""))
    assert float(bar.get("y2", "")) == pytest.approx(_y_axis(root)(50.0), abs=0.2)


def test_log2_ticks_read_in_tokens_and_are_evenly_spaced() -> None:
    series = {"c=1": [(x, 1.0) for x in (2048, 8192, 32768, 131072)], "c=2": [(8192, 2.0)]}
    ticks = _xticks(_svg(charts.lines(series, "T", "input_len", "ms", log2_x=True)))
    assert list(ticks) == ["2k", "8k", "32k", "128k"]
    steps = np.diff(list(ticks.values()))
    assert steps == pytest.approx([steps[0]] * 3, abs=0.2) and steps[0] > 0


def test_log2_labels_keep_non_multiples_of_1024_whole() -> None:
    series = {"a": [(8, 1.0), (1000, 1.0), (1536, 1.0), (1024, 1.0)]}
    ticks = _xticks(_svg(charts.lines(series, "T", "x", "y", log2_x=True)))
    assert {"8", "1536"} <= set(ticks)
    assert "1000" in ticks or "1k" in ticks  # the two may be too close for both labels


def test_log2_axis_drops_non_positive_x_and_centres_one_value() -> None:
    root = _svg(charts.lines({"a": [(0, 1.0), (-4, 2.0), (4096, 3.0)]}, "T", "x", "y", log2_x=True))
    (dot,) = _all(root, "circle", "dot")
    assert _xticks(root) == {"4k": pytest.approx((charts.LEFT + charts.W - charts.RIGHT) / 2, abs=0.2)}
    assert float(dot.get("cx", "")) == pytest.approx(_xticks(root)["4k"], abs=0.2)


def test_log2_axis_with_only_non_positive_x_is_the_empty_chart() -> None:
    assert "no data yet" in charts.lines({"a": [(0, 1.0)]}, "T", "x", "y", log2_x=True)


def test_hover_text_names_the_point_and_its_interval() -> None:
    root = _svg(charts.lines({"tpot": [Point(2048, 12.34, 11.11, 13.57), (4096, 15.0)]}, "T", "x", "y"))
    assert _hovers(root) == ["tpot: x=2048, y=12.3 [11.1, 13.6]", "tpot: x=4096, y=15"]


def test_a_label_replaces_the_default_hover_text() -> None:
    root = _svg(charts.lines({"a": [Point(1, 2.0, label="run r-abc: 2 ms")]}, "T", "x", "y"))
    assert _hovers(root) == ["run r-abc: 2 ms"]


def test_dots_with_href_are_links_to_the_run() -> None:
    root = _svg(charts.lines({"a": [Point(1, 2.0, href="/runs/r-abc?x=1&y=2"), Point(2, 3.0)]},
                             "T", "x", "y"))
    (link,) = _all(root, "a")
    assert link.get("href") == "/runs/r-abc?x=1&y=2"
    # The first dot is inside the link, the second (no href) is not.
    assert _all(link, "circle", "dot") == _all(root, "circle", "dot")[:1]


@pytest.mark.parametrize("href", ["javascript:alert(1)", "//evil.example/runs", "https://evil.example"])
def test_links_to_other_sites_are_refused(href: str) -> None:
    with pytest.raises(ValueError, match="same-site"):
        charts.lines({"a": [Point(1, 2.0, href=href)]}, "T", "x", "y")


def test_dots_are_big_enough_to_hover() -> None:
    root = _svg(charts.lines({"a": [(1, 2.0)]}, "T", "x", "y"))
    assert [c.get("r") for c in _all(root, "circle", "dot")] == ["4"]


def _legend_ys(root: ET.Element) -> list[float]:
    return [float(t.get("y", "")) for g in _all(root, "g", "legend") for t in _all(g, "text")]


def test_legend_lies_below_the_plot_and_its_axis_label() -> None:
    names = [f"max_concurrency={c}" for c in (1, 2, 4, 8, 16, 32, 64, 128)]
    root = _svg(charts.lines({n: [(1, 100.0), (2, 100.0)] for n in names}, "T", "x", "y"))
    (baseline,) = _all(root, "line", "axis")
    (xlabel,) = _all(root, "text", "xlabel")
    ys = _legend_ys(root)
    assert [t.text for g in _all(root, "g", "legend") for t in _all(g, "text")] == names
    assert min(ys) > float(xlabel.get("y", "")) > float(baseline.get("y1", ""))
    assert max(ys) < float(root.get("height", ""))
    assert len(set(ys)) > 1  # eight long names wrap to a second row


def test_legend_entries_wrap_within_the_width() -> None:
    names = [f"series number {i}" for i in range(9)]
    root = _svg(charts.lines({n: [(1, 1.0)] for n in names}, "T", "x", "y"))
    for g in _all(root, "g", "legend"):
        (text,) = _all(g, "text")
        right = float(text.get("x", "")) + charts.CHAR_W * len(text.text or "")
        assert right <= charts.W - charts.RIGHT


def test_timeline_legend_lies_below_the_axis_label() -> None:
    root = _svg(charts.timeline([("requests", {"running": [(0, 1.0), (1, 2.0)]}),
                                 ("KV (%)", {"kv": [(0, 10.0), (1, 20.0)]})], "Server", "s"))
    (xlabel,) = _all(root, "text", "xlabel")
    assert [t.text for g in _all(root, "g", "legend") for t in _all(g, "text")] == ["running", "kv"]
    assert min(_legend_ys(root)) > float(xlabel.get("y", ""))
    assert len(_all(root, "polyline")) == 2


def _steps(root: ET.Element) -> list[tuple[float, float]]:
    (line,) = _all(root, "polyline")
    py = _y_axis(root)
    zero, one = py(0.0), py(1.0)
    return [(x, (y - zero) / (one - zero)) for x, y in _coords(line)]


def test_cdf_climbs_from_zero_to_one_without_falling() -> None:
    values = np.random.default_rng(0).lognormal(size=500)
    steps = _steps(_svg(charts.cdf({"tpot": values}, "TPOT", "ms")))
    xs, shares = [x for x, _ in steps], [s for _, s in steps]
    assert shares[0] == pytest.approx(0.0, abs=0.01) and shares[-1] == pytest.approx(1.0, abs=0.01)
    assert all(b >= a for a, b in pairwise(shares))
    assert all(b >= a for a, b in pairwise(xs))


def test_cdf_of_ten_thousand_values_draws_at_most_400_steps() -> None:
    values = np.random.default_rng(1).normal(50, 5, size=10_000)
    root = _svg(charts.cdf({"itl": values}, "ITL", "ms"))
    steps = _steps(root)
    assert len({round(s, 4) for _, s in steps}) <= charts.CDF_POINTS + 1  # the levels, 0 included
    assert len(steps) <= 2 * charts.CDF_POINTS
    (line,) = _all(root, "polyline")
    assert line.findtext(f"{NS}title", "") == f"itl: n=10000, median={np.median(values):.3g}"


def test_cdf_skips_empty_series_and_is_the_empty_chart_when_all_are() -> None:
    root = _svg(charts.cdf({"none": [], "some": [1.0, 2.0, 3.0]}, "T", "x"))
    assert [t.text for g in _all(root, "g", "legend") for t in _all(g, "text")] == ["some"]
    assert "chart empty" in charts.cdf({"none": [], "also": np.array([])}, "T", "x")


def test_cdf_log_x_ticks_at_powers_of_ten_and_drops_non_positive_values() -> None:
    root = _svg(charts.cdf({"a": [-1.0, 0.0, 3.0, 40.0, 700.0, 25_000.0]}, "T", "x", log_x=True))
    ticks = _xticks(root)
    assert list(ticks) == ["10", "100", "1000", "10000"]
    assert np.diff(list(ticks.values())) == pytest.approx([np.diff(list(ticks.values()))[0]] * 3, abs=0.2)
    assert "n=4," in (_all(root, "polyline")[0].findtext(f"{NS}title") or "")


@pytest.mark.parametrize(
    "chart",
    [
        lambda: charts.lines({HOSTILE: [Point(1, 2.0, label=HOSTILE)]}, HOSTILE, HOSTILE, HOSTILE),
        lambda: charts.cdf({HOSTILE: [1.0, 2.0]}, HOSTILE, HOSTILE),
        lambda: charts.timeline([(HOSTILE, {HOSTILE: [(0, 1.0)]})], HOSTILE, HOSTILE),
        lambda: charts.histogram([1.0, 2.0], HOSTILE, HOSTILE, HOSTILE),
    ],
    ids=["lines", "cdf", "timeline", "histogram"],
)
def test_hostile_names_are_escaped(chart: Callable[[], Markup]) -> None:
    markup = chart()
    assert HOSTILE not in markup and "&lt;script&gt;" in markup
    root = _svg(markup)  # still well-formed, and the reader sees the name as typed
    assert _all(root, "script") == []
    assert HOSTILE in [t.text for t in _all(root, "text")]


def test_histogram_counts_sum_to_the_number_of_values() -> None:
    values = np.random.default_rng(2).exponential(3.0, size=1234)
    root = _svg(charts.histogram(values.tolist(), "TPOT", "ms", bins=30))
    bars = _all(root, "rect")
    counts = [int(re.sub(r".*: ", "", r.findtext(f"{NS}title", ""))) for r in bars]
    assert len(bars) == 30 and sum(counts) == 1234
    py = _y_axis(root)
    tallest = bars[counts.index(max(counts))]
    assert float(tallest.get("y", "")) == pytest.approx(py(max(counts)), abs=0.2)


def test_histogram_of_equal_values_puts_them_in_one_bar() -> None:
    root = _svg(charts.histogram([5.0] * 7 + [float("nan")], "T", "x"))
    counts = [int(re.sub(r".*: ", "", r.findtext(f"{NS}title", ""))) for r in _all(root, "rect")]
    assert counts[0] == 7 and sum(counts) == 7


def test_scatter_draws_one_dot_per_point() -> None:
    root = _svg(charts.scatter([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)], "TTFT", "s", "ms"))
    assert len(_all(root, "circle")) == 3


def _title_lines(root: ET.Element) -> list[str]:
    (title,) = _all(root, "text", "title")
    return [span.text or "" for span in _all(title, "tspan")]


def test_a_long_title_wraps_within_the_width_and_moves_the_plot_down() -> None:
    title = ("input_len 131072: decode_median_itl_ms against concurrency (intervals at the per-look "
             "confidence)")
    short = _svg(charts.lines({"a": [(1, 2.0), (2, 3.0)]}, "T", "x", "y"))
    root = _svg(charts.lines({"a": [(1, 2.0), (2, 3.0)]}, title, "x", "y"))
    lines = _title_lines(root)
    assert " ".join(lines) == title and len(lines) == 2
    assert all(len(line) * charts.TITLE_CHAR_W <= charts.W - 2 * charts.RIGHT for line in lines)
    # The plot (and everything under the title) moves down by the added line, and the
    # chart grows by as much: nothing is cut at its bottom.
    (body,) = [g for g in _all(root, "g") if g.get("transform")]
    assert body.get("transform") == f"translate(0 {charts.TITLE_LINE})"
    assert float(root.get("height", "")) == float(short.get("height", "")) + charts.TITLE_LINE
    assert _all(body, "polyline", "line") and _all(body, "g", "legend")
    assert _title_lines(short) == ["T"] and not [g for g in _all(short, "g") if g.get("transform")]


def test_an_empty_charts_long_title_wraps_too() -> None:
    root = ET.fromstring(str(charts.empty("x " * 80)))
    lines = [span.text or "" for span in root.iter(f"{NS}tspan")]
    assert len(lines) > 1 and all(len(line) * charts.TITLE_CHAR_W <= charts.W for line in lines)


def test_marked_points_take_their_marks_colour_and_each_mark_drawn_a_legend_dot() -> None:
    marks = {"pass": "#00aa00", "fail": "#cc0000", "undecided": "#999999"}
    points = [Point(1, 10.0, 9.0, 11.0, mark="pass"), Point(2, 20.0, 18.0, 22.0, mark="fail"), Point(3, 30.0)]
    root = _svg(charts.lines({"ms": points}, "T", "x", "y", marks=marks))
    line_color = charts.PALETTE[0]
    assert [c.get("fill") for c in _all(root, "circle", "dot")] == ["#00aa00", "#cc0000", line_color]
    assert [e.get("stroke") for e in _all(root, "line", "errorbar")] == ["#00aa00", "#cc0000"]
    # One line through them all, in the series' colour.
    (line,) = _all(root, "polyline", "line")
    assert line.get("stroke") == line_color and len(_coords(line)) == 3
    # The legend: the series, then a dot per mark drawn (none for "undecided").
    legend = [(t.text, g.find(f"{NS}circle")) for g in _all(root, "g", "legend") for t in _all(g, "text")]
    assert [name for name, _ in legend] == ["ms", "pass", "fail"]
    assert legend[0][1] is None
    assert [dot.get("fill") for _, dot in legend[1:] if dot is not None] == ["#00aa00", "#cc0000"]
