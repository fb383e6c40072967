"""A plotly scatter figure as a static SVG string: the live page's first drawing.

Plotly's browser bundle is ~4.7 MB of JavaScript; on a slow machine the browser needs seconds to
load and run it before the first chart appears. The live page therefore draws the tree as an SVG
image too (markers, edges, labels, legend; no hover or clicks; `st.html` would strip the SVG): the
opening replay's first frames draw only the image, later ones the interactive chart in the same
box, which hides the image once it is drawn (ui/live_view.py). Only what `tree_figure` uses is
supported: scatter traces in "lines", "markers" or "markers+text" mode, marker colour/size/symbol,
line colour/width.
"""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go

_PAD = 24  # pixels around the plotted area
_LEGEND_ROW = 20  # pixels per legend row, above the plotted area
_CHAR = 7  # a legend name's width per character at font size 12


def _points(trace) -> list[tuple[float, float] | None]:
    """(x, y) pairs, None where the trace breaks its line."""
    xs, ys = list(trace.x or ()), list(trace.y or ())
    return [None if x is None or y is None else (float(x), float(y)) for x, y in zip(xs, ys, strict=True)]


def _per_point(value, i: int, default):
    if value is None:
        return default
    if isinstance(value, (list, tuple)):
        return value[i] if i < len(value) else default
    return value


def _marker(symbol: str, x: float, y: float, size: float, colour: str) -> str:
    r = size / 2
    if symbol == "star":
        corners = []
        for k in range(10):
            a = math.pi / 2 + k * math.pi / 5
            rk = r * 1.3 if k % 2 == 0 else r * 0.55
            corners.append(f"{x + rk * math.cos(a):.1f},{y - rk * math.sin(a):.1f}")
        return f'<polygon class="node" points="{" ".join(corners)}" fill="{colour}"/>'
    fill = "white" if symbol.endswith("-open") else colour
    if symbol.startswith("triangle") or symbol.startswith("square") or symbol.startswith("diamond"):
        side = r * 1.6
        corner = f'x="{x - side / 2:.1f}" y="{y - side / 2:.1f}"'
        size = f'width="{side:.1f}" height="{side:.1f}"'
        return f'<rect class="node" {corner} {size} fill="{fill}" stroke="{colour}" stroke-width="2"/>'
    return (
        f'<circle class="node" cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" fill="{fill}" stroke="{colour}" stroke-width="2"/>'
    )


def figure_svg(fig: go.Figure, width: int = 720, height: int | None = None) -> str:
    """The figure's scatter traces drawn into a `width` x `height` SVG (height: the figure's)."""
    height = int(height or fig.layout.height or 420)
    pts = [p for t in fig.data for p in _points(t) if p is not None]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img"></svg>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    legend = legend_rows(fig, width)
    top = _PAD + _LEGEND_ROW * len(legend) + 8  # the nodes start below the legend: it covers none

    def at(p: tuple[float, float]) -> tuple[float, float]:
        fx = 0.5 if x1 == x0 else (p[0] - x0) / (x1 - x0)
        fy = 0.5 if y1 == y0 else (y1 - p[1]) / (y1 - y0)
        return _PAD + fx * (width - 2 * _PAD), top + fy * (height - top - _PAD - 14)

    body = []
    for trace in fig.data:
        mode = trace.mode or "markers"
        if "lines" in mode:
            segments, current = [], []
            for p in _points(trace) + [None]:
                if p is None:
                    if len(current) > 1:
                        segments.append("M" + " L".join(f"{x:.1f} {y:.1f}" for x, y in current))
                    current = []
                else:
                    current.append(at(p))
            colour, line_width = trace.line.color or "#999", trace.line.width or 1
            if segments:
                body.append(
                    f'<path d="{" ".join(segments)}" stroke="{colour}" stroke-width="{line_width}" fill="none"/>'
                )
        if "markers" not in mode:
            continue
        colour = trace.marker.color or "#444"
        for i, p in enumerate(_points(trace)):
            if p is None:
                continue
            x, y = at(p)
            size = float(_per_point(trace.marker.size, i, 12))
            body.append(_marker(str(_per_point(trace.marker.symbol, i, "circle")), x, y, size, str(colour)))
            label = _per_point(trace.text, i, None) if "text" in mode else None
            if label:
                body.append(
                    f'<text x="{x:.1f}" y="{y + size / 2 + 12:.1f}" text-anchor="middle" font-size="12">'
                    f"{html.escape(str(label))}</text>"
                )
    body.append('<g class="legend">')
    for row, items in enumerate(legend):
        y = _PAD + _LEGEND_ROW * row
        for x, name, colour in items:
            body.append(f'<circle cx="{x + 5}" cy="{y}" r="5" fill="{colour}"/>')
            body.append(f'<text x="{x + 14}" y="{y + 4}" font-size="12">{html.escape(name)}</text>')
    body.append("</g>")
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'style="font-family: sans-serif">' + "".join(body) + "</svg>"
    )


def legend_rows(fig: go.Figure, width: int) -> list[list[tuple[float, str, str]]]:
    """The legend of the figure's marker traces, wrapped into rows `width` wide: per row its
    entries (x, name, colour), left to right. Drawn above the nodes (`figure_svg`)."""
    rows: list[list[tuple[float, str, str]]] = [[]]
    x = _PAD
    for trace in fig.data:
        if "markers" not in (trace.mode or "markers") or not trace.name or trace.showlegend is False:
            continue
        name = str(trace.name)
        step = 24 + _CHAR * len(name)  # dot, gap, name, gap
        if rows[-1] and x + step - 10 > width - _PAD:
            rows.append([])
            x = _PAD
        rows[-1].append((x, name, str(trace.marker.color or "#444")))
        x += step
    return [row for row in rows if row]
