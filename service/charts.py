"""Small server-rendered SVG charts: no JavaScript library, no network, nothing to vendor.

Each function returns an ``<svg>`` element as ``Markup`` for the templates; every
label is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from html import escape

import numpy as np
from markupsafe import Markup

W, H = 560, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 28, 40
PALETTE = ("#3b6fd8", "#d8743b", "#3ba55d", "#a83bd8", "#d83b5e", "#3bb6d8", "#8a8f3b", "#555")


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
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"


class _Frame:
    def __init__(self, title: str, xlabel: str, ylabel: str, x: tuple[float, float],
                 y: tuple[float, float]) -> None:
        self.x0, self.x1 = x if x[1] > x[0] else (x[0], x[0] + 1)
        self.y0, self.y1 = y if y[1] > y[0] else (y[0], y[0] + 1)
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {W} {H}" '
            f'width="{W}" height="{H}" role="img" aria-label="{escape(title)}">',
            f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13" '
            f'font-weight="600">{escape(title)}</text>',
        ]
        for t in _ticks(self.y0, self.y1):
            py = self.py(t)
            self.parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py:.1f}" y2="{py:.1f}" '
                              'stroke="#e3e6ee"/>')
            self.parts.append(f'<text x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end" '
                              f'font-size="10">{_fmt(t)}</text>')
        for t in _ticks(self.x0, self.x1):
            px = self.px(t)
            self.parts.append(f'<text x="{px:.1f}" y="{H - BOTTOM + 14}" text-anchor="middle" '
                              f'font-size="10">{_fmt(t)}</text>')
        self.parts.append(f'<text x="{W / 2}" y="{H - 6}" text-anchor="middle" '
                          f'font-size="11">{escape(xlabel)}</text>')
        self.parts.append(f'<text x="12" y="{H / 2}" text-anchor="middle" font-size="11" '
                          f'transform="rotate(-90 12 {H / 2})">{escape(ylabel)}</text>')

    def px(self, x: float) -> float:
        return LEFT + (x - self.x0) / (self.x1 - self.x0) * (W - LEFT - RIGHT)

    def py(self, y: float) -> float:
        return H - BOTTOM - (y - self.y0) / (self.y1 - self.y0) * (H - TOP - BOTTOM)

    def done(self) -> Markup:
        return Markup("".join([*self.parts, "</svg>"]))


def histogram(values: Sequence[float], title: str, xlabel: str, ylabel: str = "count",
              bins: int = 30) -> Markup:
    """Counts of ``values`` in equal-width bins."""
    if not values:
        return empty(title)
    lo, hi = min(values), max(values)
    width = (hi - lo) / bins or 1.0
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / width))] += 1
    frame = _Frame(title, xlabel, ylabel, (lo, lo + width * bins), (0, max(counts)))
    for i, c in enumerate(counts):
        x, x2 = frame.px(lo + i * width), frame.px(lo + (i + 1) * width)
        y = frame.py(c)
        frame.parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(0.5, x2 - x - 1):.1f}" '
                           f'height="{frame.py(0) - y:.1f}" fill="{PALETTE[0]}"/>')
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


def lines(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str,
          ylabel: str) -> Markup:
    """One line (with dots) per named series, with a legend."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        return empty(title)
    # Headroom above the highest point keeps the legend clear of the lines.
    frame = _Frame(title, xlabel, ylabel, (min(p[0] for p in pts), max(p[0] for p in pts)),
                   (0, max(p[1] for p in pts) * 1.3))
    for i, (name, points) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        path = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in sorted(points))
        frame.parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                           'stroke-width="2"/>')
        for x, y in points:
            frame.parts.append(f'<circle cx="{frame.px(x):.1f}" cy="{frame.py(y):.1f}" r="3" '
                               f'fill="{color}"/>')
        frame.parts.append(f'<text x="{W - RIGHT - 4}" y="{TOP + 12 + 13 * i}" text-anchor="end" '
                           f'font-size="10" fill="{color}">{escape(name)}</text>')
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
    as lines in the order given (points in order of x), with a legend per panel. Series
    named in ``sampled`` are readings at discrete times (scrapes): each reading is also a
    dot, so a line between two readings is not taken for a measurement."""
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

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {W} {height}" '
        f'width="{W}" height="{height}" role="img" aria-label="{escape(title)}">',
        f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13" '
        f'font-weight="600">{escape(title)}</text>',
    ]
    color = 0
    for i, (ylabel, series) in enumerate(panels):
        top = TOP + i * (PANEL_H + PANEL_GAP)
        bottom = top + PANEL_H
        # Headroom above the highest point keeps the legend (top right) clear of the lines.
        headroom = 1.1 + 0.15 * len(series)
        y1 = max((y for pts in series.values() for _, y in pts), default=0.0) * headroom or 1.0

        def py(y: float, top: float = top, y1: float = y1) -> float:
            return top + PANEL_H - y / y1 * PANEL_H

        for t in _ticks(0.0, y1, 4):
            parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
                         'stroke="#e3e6ee"/>')
            parts.append(f'<text x="{LEFT - 6}" y="{py(t) + 4:.1f}" text-anchor="end" '
                         f'font-size="10">{_fmt(t)}</text>')
        for t in _ticks(x0, x1):
            parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{top}" y2="{bottom}" '
                         'stroke="#f0f1f5"/>')
        middle = (top + bottom) / 2
        parts.append(f'<text x="12" y="{middle}" text-anchor="middle" font-size="11" '
                     f'transform="rotate(-90 12 {middle})">{escape(ylabel)}</text>')
        for j, (name, points) in enumerate(series.items()):
            stroke = PALETTE[color % len(PALETTE)]
            color += 1
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in _thin(points))
            dashes = ' stroke-dasharray="3 2"' if name in sampled else ""
            parts.append(f'<polyline points="{path}" fill="none" stroke="{stroke}" '
                         f'stroke-width="1.5"{dashes}/>')
            if name in sampled:
                parts.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{stroke}"/>'
                             for x, y in _thin(points))
            parts.append(f'<text x="{W - RIGHT - 4}" y="{top + 12 + 13 * j}" text-anchor="end" '
                         f'font-size="10" fill="{stroke}">{escape(name)}</text>')
    for t in _ticks(x0, x1):
        parts.append(f'<text x="{px(t):.1f}" y="{height - BOTTOM + 14}" text-anchor="middle" '
                     f'font-size="10">{_fmt(t)}</text>')
    parts.append(f'<text x="{W / 2}" y="{height - 6}" text-anchor="middle" '
                 f'font-size="11">{escape(xlabel)}</text>')
    return Markup("".join([*parts, "</svg>"]))


def empty(title: str) -> Markup:
    """A placeholder when there is nothing to draw."""
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart empty" viewBox="0 0 {W} 60" '
        f'width="{W}" height="60"><text x="{W / 2}" y="34" text-anchor="middle" font-size="12" '
        f'fill="#888">{escape(title)}: no data yet</text></svg>'
    )
