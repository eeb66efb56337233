"""Small server-rendered SVG charts: no JavaScript library, no network, nothing to vendor.

Each function returns an ``<svg class="chart">`` element as ``Markup`` for the templates;
every label is escaped. Hover text is a native ``<title>`` and a click a plain SVG ``<a>``,
so the charts work without script. Legends sit in a strip below the x-axis label, where
they can never cover a line. A title too long for the width wraps onto more lines, and the
chart below moves down to make room: an SVG clips what passes its edge.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from html import escape
from typing import Any

import numpy as np
import numpy.typing as npt
from markupsafe import Markup

W, H = 560, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 28, 40
PALETTE = ("#3b6fd8", "#d8743b", "#3ba55d", "#a83bd8", "#d83b5e", "#3bb6d8", "#8a8f3b", "#555")
LEGEND_ROW, SWATCH = 16, 16
DASH = ' stroke-dasharray="5 3"'
# Pixels per character of 10px text, a little over the average so estimates do not overlap.
CHAR_W = 6
# The same for the title's 13px bold text, and the height of one of its lines.
TITLE_CHAR_W = 7.8
TITLE_LINE = 16
# Steps drawn per CDF: more is invisible at this width and only makes the page heavy.
CDF_POINTS = 400

Values = Sequence[float] | npt.NDArray[np.floating[Any]]


@dataclass(frozen=True)
class Point:
    """One measured value on a line chart, with what a hover and a click on its dot show."""

    x: float
    y: float
    lo: float | None = None  # 95% interval ends of y, when known
    hi: float | None = None
    href: str | None = None  # a click on the dot opens this (a same-site path like /runs/r-abc)
    label: str = ""  # hover text; a default naming the series and the values when empty
    xlo: float | None = None  # 95% interval ends of x, when x is measured too (a frontier)
    xhi: float | None = None
    mark: str | None = None  # a name of ``lines``' ``marks``: the dot and its bars in its colour


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for mult in (1, 2, 5, 10):
        if (hi - lo) / (step * mult) <= n:
            step *= mult
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    # Three significant digits, but never an exponent on a value a tick can hold whole.
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _num(v: float) -> str:
    return str(int(v)) if v.is_integer() else f"{v:.6g}"


def _tokens(x: float) -> str:
    """A token count as people write it: 1024 multiples as 1k, 32k, 128k; others whole."""
    if not x.is_integer():
        return _fmt(x)
    n = int(x)
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _decades(lo: float, hi: float) -> list[tuple[float, str]]:
    """Ticks at the powers of ten within ``[lo, hi]`` (both > 0), plus the ends when fewer than two."""
    first, last = math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9)
    ticks = [10.0**k for k in range(first, last + 1)]
    if len(ticks) < 2:
        ticks = sorted({lo, hi, *ticks})
    return [(t, _fmt(t)) for t in ticks]


def _href(href: str) -> str:
    # Only same-site paths: a link built from stored data must not become javascript: or a
    # jump to another site ("//host" and "/\host" are both read as another host).
    if not href.startswith("/") or href[1:2] in ("/", "\\"):
        raise ValueError(f"chart links are same-site paths, not {href!r}")
    return escape(href)


def _title_lines(title: str) -> list[str]:
    """The title broken at spaces into lines that fit the width (a word longer than a line
    keeps a line of its own)."""
    room = int((W - 2 * RIGHT) / TITLE_CHAR_W)
    lines: list[str] = []
    for word in title.split():
        if lines and len(lines[-1]) + 1 + len(word) <= room:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def _svg(title: str, height: float, body: Sequence[str], role: str = "img") -> Markup:
    """A chart of ``height`` drawn by ``body`` under its title, the body moved down by the
    title's lines past the first."""
    lines = _title_lines(title)
    drop = TITLE_LINE * (len(lines) - 1)
    spans = "".join(f'<tspan x="{W / 2}" dy="{TITLE_LINE if i else 0}">{escape(line)}</tspan>'
                    for i, line in enumerate(lines))
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {W} {height + drop}" '
            f'width="{W}" height="{height + drop}" role="{role}" aria-label="{escape(title)}">'
            f'<text class="title" x="{W / 2}" y="16" text-anchor="middle" font-size="13" '
            f'font-weight="600">{spans}</text>')
    if drop:
        return Markup("".join([head, f'<g transform="translate(0 {drop})">', *body, "</g></svg>"]))
    return Markup("".join([head, *body, "</svg>"]))


def _legend(entries: Sequence[tuple[str, str]], top: float, dashed: Collection[str] = (),
            dots: Collection[str] = ()) -> tuple[list[str], int]:
    """Legend entries ``(name, colour)`` left to right from ``top`` down, a new row whenever
    the next would pass the width; the parts and the height they take. Entries named in
    ``dashed`` get a dashed swatch, those in ``dots`` a dot (they colour dots, not lines)."""
    parts: list[str] = []
    x, row = LEFT, 0
    for name, color in entries:
        width = SWATCH + 4 + CHAR_W * len(name) + 14
        if x > LEFT and x + width > W - RIGHT:
            x, row = LEFT, row + 1
        y = top + LEGEND_ROW * row + 11
        swatch = (f'<circle class="swatch" cx="{x + SWATCH / 2}" cy="{y - 3.5}" r="4" fill="{color}"/>'
                  if name in dots else
                  f'<line x1="{x}" x2="{x + SWATCH}" y1="{y - 3.5}" y2="{y - 3.5}" '
                  f'stroke="{color}" stroke-width="2"{DASH if name in dashed else ""}/>')
        parts.append(
            f'<g class="legend">{swatch}<text x="{x + SWATCH + 4}" y="{y}" '
            f'font-size="10">{escape(name)}</text></g>'
        )
        x += width
    return parts, (LEGEND_ROW * (row + 1) + 6 if entries else 0)


class _Frame:
    """One plot area: maps data to pixels, draws the axes, and collects the chart's parts.

    ``xlog`` (2 or 10) places x on that log scale; ``xticks`` are ``(x, label)`` pairs in
    data units, by default round numbers on a linear axis."""

    def __init__(self, title: str, xlabel: str, ylabel: str, x: tuple[float, float],
                 y: tuple[float, float], *, xlog: int | None = None,
                 xticks: Sequence[tuple[float, str]] | None = None) -> None:
        self.title = title
        self.xlog = xlog
        self.legend: list[tuple[str, str]] = []
        self.dashed: set[str] = set()
        self.dots: set[str] = set()
        self.role = "img"
        x0, x1 = self._scale(x[0]), self._scale(x[1])
        if x1 <= x0:
            # One x value: centre it (an octave or decade either side on a log axis).
            pad = 1.0 if xlog else abs(x0) / 2 or 1.0
            x0, x1 = x0 - pad, x1 + pad
        self.x0, self.x1 = x0, x1
        self.y0, self.y1 = y if y[1] > y[0] else (y[0], y[0] + 1)
        self.parts: list[str] = []
        for t in _ticks(self.y0, self.y1):
            py = self.py(t)
            self.parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py:.1f}" y2="{py:.1f}" '
                              'stroke="#e3e6ee"/>')
            self.parts.append(f'<text class="ytick" x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end" '
                              f'font-size="10">{_fmt(t)}</text>')
        self.parts.append(f'<line class="axis" x1="{LEFT}" x2="{W - RIGHT}" y1="{H - BOTTOM}" '
                          f'y2="{H - BOTTOM}" stroke="#9aa0ad"/>')
        if xticks is None:
            xticks = [(t, _fmt(t)) for t in _ticks(self.x0, self.x1)]
        right = -math.inf
        for t, label in xticks:
            px = self.px(t)
            self.parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{H - BOTTOM}" '
                              'stroke="#f0f1f5"/>')
            # Measured ticks can crowd (1000 next to 1024): a label that would touch the one
            # before it is left out, its grid line kept.
            half = CHAR_W * len(label) / 2
            if px - half < right + 4:
                continue
            right = px + half
            self.parts.append(f'<text class="xtick" x="{px:.1f}" y="{H - BOTTOM + 14}" '
                              f'text-anchor="middle" font-size="10">{escape(label)}</text>')
        self.parts.append(f'<text class="xlabel" x="{W / 2}" y="{H - 6}" text-anchor="middle" '
                          f'font-size="11">{escape(xlabel)}</text>')
        self.parts.append(f'<text x="12" y="{H / 2}" text-anchor="middle" font-size="11" '
                          f'transform="rotate(-90 12 {H / 2})">{escape(ylabel)}</text>')

    def _scale(self, x: float) -> float:
        if self.xlog == 2:
            return math.log2(x)
        if self.xlog == 10:
            return math.log10(x)
        return x

    def px(self, x: float) -> float:
        return LEFT + (self._scale(x) - self.x0) / (self.x1 - self.x0) * (W - LEFT - RIGHT)

    def py(self, y: float) -> float:
        return H - BOTTOM - (y - self.y0) / (self.y1 - self.y0) * (H - TOP - BOTTOM)

    def done(self) -> Markup:
        legend, extra = _legend(self.legend, H, self.dashed, self.dots)
        return _svg(self.title, H + extra, [*self.parts, *legend], self.role)


def histogram(values: Values, title: str, xlabel: str, ylabel: str = "count",
              bins: int = 30) -> Markup:
    """Counts of ``values`` in equal-width bins; hovering a bar shows its range and count."""
    data = np.asarray(values, dtype=np.float64)
    data = data[np.isfinite(data)]
    if not data.size:
        return empty(title)
    lo, hi = float(data.min()), float(data.max())
    counts, edges = np.histogram(data, bins=bins, range=(lo, hi if hi > lo else lo + bins))
    frame = _Frame(title, xlabel, ylabel, (float(edges[0]), float(edges[-1])), (0, int(counts.max())))
    for c, a, b in zip(counts.tolist(), edges[:-1].tolist(), edges[1:].tolist(), strict=True):
        x, x2 = frame.px(a), frame.px(b)
        y = frame.py(c)
        frame.parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(0.5, x2 - x - 1):.1f}" '
                           f'height="{frame.py(0) - y:.1f}" fill="{PALETTE[0]}">'
                           f'<title>{_fmt(a)} to {_fmt(b)}: {c}</title></rect>')
    return frame.done()


def scatter(points: Sequence[tuple[float, float]], title: str, xlabel: str, ylabel: str) -> Markup:
    """One dot per point."""
    if not points:
        return empty(title)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    frame = _Frame(title, xlabel, ylabel, (min(xs), max(xs)), (0, max(ys) * 1.1))
    for x, y in points:
        frame.parts.append(f'<circle cx="{frame.px(x):.1f}" cy="{frame.py(y):.1f}" r="2.5" '
                           f'fill="{PALETTE[0]}" fill-opacity="0.7"/>')
    return frame.done()


def fitted_scatter(groups: Mapping[str, Sequence[tuple[float, float]]],
                   fits: Mapping[str, Sequence[tuple[float, float]]],
                   marked: Mapping[str, Sequence[tuple[float, float]]], title: str, xlabel: str,
                   ylabel: str) -> Markup:
    """Dots per named group with a fitted line in the group's colour (``fits``, same names,
    drawn dashed, or none), and points ``marked`` apart as open rings in colours of their
    own; one legend below the axis. The y axis ends at the 99th percentile of every point
    (times 1.2), so a few slow outliers do not flatten the rest: those are drawn at its top."""
    every = [p for pts in (*groups.values(), *marked.values()) for p in pts
             if math.isfinite(p[0]) and math.isfinite(p[1])]
    if not every:
        return empty(title)
    xs = [p[0] for p in every]
    top = float(np.quantile([p[1] for p in every], 0.99)) * 1.2 or 1.0
    frame = _Frame(title, xlabel, ylabel, (min(0.0, min(xs)), max(xs)), (0.0, top))
    colors = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(groups)}
    for name, pts in groups.items():
        frame.parts.extend(f'<circle cx="{frame.px(x):.1f}" cy="{frame.py(min(y, top)):.1f}" r="2" '
                           f'fill="{colors[name]}" fill-opacity="0.6"/>' for x, y in pts)
        frame.legend.append((name, colors[name]))
    for name, line in fits.items():
        path = " ".join(f"{frame.px(x):.1f},{frame.py(min(y, top)):.1f}" for x, y in line)
        frame.parts.append(f'<polyline points="{path}" class="line fit" fill="none" '
                           f'stroke="{colors.get(name, PALETTE[-1])}" stroke-width="2"{DASH}/>')
    for i, (name, pts) in enumerate(marked.items()):
        color = PALETTE[(len(groups) + i) % len(PALETTE)]
        frame.parts.extend(f'<circle class="marked" cx="{frame.px(x):.1f}" cy="{frame.py(min(y, top)):.1f}" '
                           f'r="4" fill="none" stroke="{color}" stroke-width="1.5"/>' for x, y in pts)
        frame.legend.append((name, color))
    return frame.done()


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _points(raw: Iterable[Point | tuple[float, float]], positive_x: bool) -> list[Point]:
    """The drawable points in order of x: tuples as Points, non-finite values dropped (an
    interval needs both ends), and x <= 0 dropped where ``positive_x`` (a log axis)."""
    out = []
    for p in raw:
        point = p if isinstance(p, Point) else Point(float(p[0]), float(p[1]))
        if not (math.isfinite(point.x) and math.isfinite(point.y)) or (positive_x and point.x <= 0):
            continue
        lo, hi = _finite(point.lo), _finite(point.hi)
        if lo is None or hi is None:
            lo = hi = None
        else:
            lo, hi = float(min(lo, hi)), float(max(lo, hi))
        xlo, xhi = _finite(point.xlo), _finite(point.xhi)
        if xlo is None or xhi is None or (positive_x and min(xlo, xhi) <= 0):
            xlo = xhi = None
        else:
            xlo, xhi = float(min(xlo, xhi)), float(max(xlo, xhi))
        # Floats throughout: an int x (as a type checker allows) would have no is_integer().
        out.append(replace(point, x=float(point.x), y=float(point.y), lo=lo, hi=hi, xlo=xlo, xhi=xhi))
    return sorted(out, key=lambda p: p.x)


def _hover(name: str, p: Point) -> str:
    if p.label:
        return p.label
    text = f"{name}: x={_num(p.x)}, y={p.y:.3g}"
    if p.lo is not None and p.hi is not None:
        text += f" [{p.lo:.3g}, {p.hi:.3g}]"
    return text


def _bands(frame: _Frame, points: Sequence[Point], color: str) -> list[str]:
    """A translucent polygon between lo and hi over each stretch of consecutive points that
    have an interval (a lone one gets only its error bar)."""
    parts, run = [], []
    for p in [*points, None]:
        if p is not None and p.lo is not None and p.hi is not None:
            run.append((frame.px(p.x), frame.py(p.lo), frame.py(p.hi)))
            continue
        if len(run) >= 2:
            outline = [(x, hi) for x, _, hi in run] + [(x, lo) for x, lo, _ in reversed(run)]
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in outline)
            parts.append(f'<polygon class="band" points="{path}" fill="{color}" '
                         'fill-opacity="0.15" stroke="none"/>')
        run = []
    return parts


def _errorbar(frame: _Frame, p: Point, color: str) -> str:
    assert p.lo is not None and p.hi is not None
    x, lo, hi = frame.px(p.x), frame.py(p.lo), frame.py(p.hi)
    stroke = f'stroke="{color}" stroke-width="1.5"'
    return (f'<line class="errorbar" x1="{x:.1f}" x2="{x:.1f}" y1="{lo:.1f}" y2="{hi:.1f}" {stroke}/>'
            + "".join(f'<line class="errorcap" x1="{x - 3:.1f}" x2="{x + 3:.1f}" y1="{y:.1f}" '
                      f'y2="{y:.1f}" {stroke}/>' for y in (lo, hi)))


def _xerrorbar(frame: _Frame, p: Point, color: str) -> str:
    assert p.xlo is not None and p.xhi is not None
    y, lo, hi = frame.py(p.y), frame.px(p.xlo), frame.px(p.xhi)
    stroke = f'stroke="{color}" stroke-width="1.5"'
    return (f'<line class="xerrorbar" x1="{lo:.1f}" x2="{hi:.1f}" y1="{y:.1f}" y2="{y:.1f}" {stroke}/>'
            + "".join(f'<line class="errorcap" x1="{x:.1f}" x2="{x:.1f}" y1="{y - 3:.1f}" '
                      f'y2="{y + 3:.1f}" {stroke}/>' for x in (lo, hi)))


def lines(series: Mapping[str, Sequence[Point | tuple[float, float]]], title: str, xlabel: str,
          ylabel: str, *, log2_x: bool = False, dashed: Mapping[str, str] | None = None,
          marks: Mapping[str, str] | None = None) -> Markup:
    """One line (with dots) per named series, with a legend below the axis. Points with a 95%
    interval get an error bar, and consecutive ones a translucent band; hovering a dot shows
    its values, and a dot with an ``href`` is a link. A point with an x interval (``xlo``,
    ``xhi``) gets a horizontal error bar too, and no band (its x is measured, not set).
    ``log2_x`` places x on a log-2 scale with a tick at each measured x, labelled in tokens
    (2k, 32k); x <= 0 is then dropped.
    ``dashed`` names series drawn dashed, each in the colour of the series it maps to (a
    bound beside the measurement it bounds). ``marks`` gives colours by name: a point whose
    ``mark`` is one of them has its dot and bars in that colour (a verdict on one line of
    measurements), and each mark drawn gets a dot in the legend after the series."""
    dashed = dashed or {}
    marks = marks or {}
    solid = [name for name in series if name not in dashed]
    colors = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(solid)}
    for i, (name, like) in enumerate(dashed.items()):
        colors[name] = colors.get(like, PALETTE[(len(solid) + i) % len(PALETTE)])
    drawn = {name: (colors[name], pts) for name, raw in series.items()
             if (pts := _points(raw, positive_x=log2_x))}
    every = [p for _, pts in drawn.values() for p in pts]
    if not every:
        return empty(title)
    ys = [v for p in every for v in (p.y, p.lo, p.hi) if v is not None]
    xs = sorted({p.x for p in every})
    y_range = (min(0.0, min(ys)), max(0.0, max(ys) * 1.1))
    x_ends = sorted({*xs, *(v for p in every for v in (p.xlo, p.xhi) if v is not None)})
    if x_ends != xs:
        # Measured x: the axis from 0 (rates, like y's), wide enough for every bar.
        xs = [min(0.0, x_ends[0]), x_ends[-1] * 1.05]
    if log2_x:
        frame = _Frame(title, xlabel, ylabel, (xs[0], xs[-1]), y_range, xlog=2,
                       xticks=[(x, _tokens(x)) for x in xs])
    else:
        frame = _Frame(title, xlabel, ylabel, (xs[0], xs[-1]), y_range)
    for color, points in drawn.values():
        if not any(p.xlo is not None for p in points):
            frame.parts.extend(_bands(frame, points, color))
    for name, (color, points) in drawn.items():
        path = " ".join(f"{frame.px(p.x):.1f},{frame.py(p.y):.1f}" for p in points)
        dash = DASH if name in dashed else ""
        frame.parts.append(f'<polyline points="{path}" class="line" fill="none" stroke="{color}" '
                           f'stroke-width="2"{dash}/>')
        frame.parts.extend(_errorbar(frame, p, marks.get(p.mark or "", color))
                           for p in points if p.lo is not None)
        frame.parts.extend(_xerrorbar(frame, p, marks.get(p.mark or "", color))
                           for p in points if p.xlo is not None)
    # Dots last, on top of every line and band, so each one can be hovered and clicked.
    for name, (color, points) in drawn.items():
        for p in points:
            fill = marks.get(p.mark or "", color)
            dot = (f'<circle class="dot" cx="{frame.px(p.x):.1f}" cy="{frame.py(p.y):.1f}" r="4" '
                   f'fill="{fill}"><title>{escape(_hover(name, p))}</title></circle>')
            if p.href is not None:
                dot = f'<a href="{_href(p.href)}">{dot}</a>'
                frame.role = "figure"  # an "img" would hide its links from assistive technology
            frame.parts.append(dot)
        frame.legend.append((name, color))
        if name in dashed:
            frame.dashed.add(name)
    used = {p.mark for p in every}
    for mark, color in marks.items():
        if mark in used:
            frame.legend.append((mark, color))
            frame.dots.add(mark)
    return frame.done()


def cdf(series: Mapping[str, Values], title: str, xlabel: str, *, log_x: bool = False) -> Markup:
    """The empirical CDF of each named series (the share of its values at or below x) as a
    step line, with a legend below the axis; hovering a line shows its count and median.
    ``log_x`` places x on a log-10 scale (values <= 0 dropped). Empty series are skipped."""
    drawn: dict[str, tuple[str, npt.NDArray[np.float64]]] = {}
    for i, (name, values) in enumerate(series.items()):
        data = np.asarray(values, dtype=np.float64)
        keep = np.isfinite(data)
        if log_x:
            keep &= data > 0
        if keep.any():
            drawn[name] = (PALETTE[i % len(PALETTE)], np.sort(data[keep]))
    if not drawn:
        return empty(title)
    lo = min(float(d[0]) for _, d in drawn.values())
    hi = max(float(d[-1]) for _, d in drawn.values())
    frame = _Frame(title, xlabel, "share of values", (lo, hi), (0.0, 1.0), xlog=10 if log_x else None,
                   xticks=_decades(lo, hi) if log_x else None)
    for name, (color, data) in drawn.items():
        n = data.size
        # Evenly spaced quantile positions, the first and last always among them.
        at = np.unique(np.linspace(0, n - 1, min(n, CDF_POINTS)).round().astype(np.intp))
        shares = (at + 1) / n
        # Up at each value, then along to the next: (x0, 0), (x0, F0), (x1, F0), (x1, F1), ...
        corner_x = np.repeat(data[at], 2)
        corner_y = np.concatenate(([0.0], np.repeat(shares, 2)[:-1]))
        path = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}"
                        for x, y in zip(corner_x.tolist(), corner_y.tolist(), strict=True))
        hover = f"{name}: n={n}, median={float(np.median(data)):.3g}"
        frame.parts.append(f'<polyline points="{path}" class="line" fill="none" stroke="{color}" '
                           f'stroke-width="2"><title>{escape(hover)}</title></polyline>')
        frame.legend.append((name, color))
    return frame.done()


PANEL_H, PANEL_GAP = 120, 34
# Points per drawn series: more is invisible at this width and only makes the page heavy.
MAX_DRAWN = 1200


def _thin(points: Sequence[tuple[float, float]], limit: int = MAX_DRAWN) -> list[tuple[float, float]]:
    """At most ``limit`` points that keep each stretch's lowest and highest (min-max decimation)."""
    if len(points) <= limit:
        return list(points)
    ys = np.array([p[1] for p in points])
    keep = set()
    for chunk in np.array_split(np.arange(len(points)), limit // 2):
        keep.add(int(chunk[np.argmin(ys[chunk])]))
        keep.add(int(chunk[np.argmax(ys[chunk])]))
    return [points[i] for i in sorted(keep)]


def timeline(panels: Sequence[tuple[str, dict[str, Sequence[tuple[float, float]]]]], title: str,
             xlabel: str, sampled: Collection[str] = ()) -> Markup:
    """Series over one shared x axis, in stacked panels (one per ``(ylabel, series)``), drawn
    as lines in the order given (points in order of x), with one legend below the axis
    (colours are not reused across panels). Series named in ``sampled`` are readings at
    discrete times (scrapes): each reading is also a dot, so a line between two readings is
    not taken for a measurement."""
    panels = [(label, {k: v for k, v in series.items() if v}) for label, series in panels]
    panels = [(label, series) for label, series in panels if series]
    xs = [x for _, series in panels for pts in series.values() for x, _ in pts]
    if not xs:
        return empty(title)
    x0, x1 = min(xs), max(xs)
    if x1 <= x0:
        x1 = x0 + 1.0
    height = TOP + len(panels) * PANEL_H + (len(panels) - 1) * PANEL_GAP + BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT)

    parts: list[str] = []
    entries: list[tuple[str, str]] = []
    for i, (ylabel, series) in enumerate(panels):
        top = TOP + i * (PANEL_H + PANEL_GAP)
        bottom = top + PANEL_H
        y1 = max((y for pts in series.values() for _, y in pts), default=0.0) * 1.1 or 1.0

        def py(y: float, top: float = top, y1: float = y1) -> float:
            return top + PANEL_H - y / y1 * PANEL_H

        for t in _ticks(0.0, y1, 4):
            parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
                         'stroke="#e3e6ee"/>')
            parts.append(f'<text class="ytick" x="{LEFT - 6}" y="{py(t) + 4:.1f}" text-anchor="end" '
                         f'font-size="10">{_fmt(t)}</text>')
        for t in _ticks(x0, x1):
            parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{top}" y2="{bottom}" '
                         'stroke="#f0f1f5"/>')
        middle = (top + bottom) / 2
        parts.append(f'<text x="12" y="{middle}" text-anchor="middle" font-size="11" '
                     f'transform="rotate(-90 12 {middle})">{escape(ylabel)}</text>')
        for name, points in series.items():
            stroke = PALETTE[len(entries) % len(PALETTE)]
            entries.append((name, stroke))
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in _thin(points))
            dashes = ' stroke-dasharray="3 2"' if name in sampled else ""
            parts.append(f'<polyline points="{path}" fill="none" stroke="{stroke}" '
                         f'stroke-width="1.5"{dashes}/>')
            if name in sampled:
                parts.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{stroke}"/>'
                             for x, y in _thin(points))
    parts.append(f'<line class="axis" x1="{LEFT}" x2="{W - RIGHT}" y1="{height - BOTTOM}" '
                 f'y2="{height - BOTTOM}" stroke="#9aa0ad"/>')
    for t in _ticks(x0, x1):
        parts.append(f'<text class="xtick" x="{px(t):.1f}" y="{height - BOTTOM + 14}" '
                     f'text-anchor="middle" font-size="10">{_fmt(t)}</text>')
    parts.append(f'<text class="xlabel" x="{W / 2}" y="{height - 6}" text-anchor="middle" '
                 f'font-size="11">{escape(xlabel)}</text>')
    legend, extra = _legend(entries, height)
    return _svg(title, height + extra, [*parts, *legend])


def empty(title: str) -> Markup:
    """A placeholder when there is nothing to draw."""
    lines = _title_lines(f"{title}: no data yet")
    height = 44 + TITLE_LINE * len(lines)
    spans = "".join(f'<tspan x="{W / 2}" dy="{TITLE_LINE if i else 0}">{escape(line)}</tspan>'
                    for i, line in enumerate(lines))
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart empty" viewBox="0 0 {W} {height}" '
        f'width="{W}" height="{height}"><text x="{W / 2}" y="34" text-anchor="middle" font-size="12" '
        f'fill="#888">{spans}</text></svg>'
    )
