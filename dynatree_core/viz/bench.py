"""Benchmark and latency figures: throughput over swept parameters (one at a time, a grid, or a
run setting such as T), a device's forward latency profile, and writing any figure to HTML (or
PNG). Saved reports side by side: viz/reports.py."""

from __future__ import annotations

import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.bench import BenchReport
from dynatree_core.measure.latency import LatencyPoint


def grid_figure(report: BenchReport, sweeps: list[tuple[str, list[str]]]):
    """Throughput over two swept parameters as a scatter coloured by tokens/s (DynaTree, Fig. 6a)."""
    (xname, _), (yname, _) = sweeps[:2]
    rows = [e for e in report.results if not e.reference and xname in e.params and yname in e.params]
    fig = go.Figure(
        go.Scatter(
            x=[float(e.params[xname]) for e in rows],
            y=[float(e.params[yname]) for e in rows],
            mode="markers+text",
            text=[f"{e.throughput_tps:.1f}" for e in rows],
            textposition="top center",
            marker=dict(size=16, color=[e.throughput_tps for e in rows], colorscale="Viridis", showscale=True,
                        colorbar=dict(title="tokens / s")),
            hovertext=[f"{e.label}: {e.throughput_tps:.1f} tok/s, {e.speedup:.2f}x" for e in rows],
        )
    )  # fmt: skip
    policy = rows[0].policy if rows else ""
    fig.update_layout(title=f"{policy}: throughput over ({xname}, {yname})", xaxis_title=xname, yaxis_title=yname,
                      height=420)  # fmt: skip
    return fig


def setting_figure(report: BenchReport, setting: str, values: list[int]):
    """Throughput and speedup against T or L_max, one line per policy (DynaTree, Figs. 4-6/5-8)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens / s", "speedup over the best AR reference"))
    suffix = [f" {setting}={v}" for v in values]
    bases = dict.fromkeys(e.label.removesuffix(s) for e in report.results for s in suffix if e.label.endswith(s))
    palette = plotly.colors.qualitative.Plotly
    for i, base in enumerate(bases):
        rows = [e for v in values for e in report.results if e.label == f"{base} {setting}={v}"]
        xs = [e.params[setting] for e in rows]
        style = dict(mode="lines+markers", name=base, legendgroup=base, line=dict(color=palette[i % len(palette)]))
        fig.add_scatter(x=xs, y=[e.throughput_tps for e in rows], row=1, col=1, **style,
                        error_y=dict(type="data", array=[e.throughput_std for e in rows]))  # fmt: skip
        fig.add_scatter(x=xs, y=[e.speedup for e in rows], row=1, col=2, showlegend=False, **style)
    title = {"T": "new tokens T", "max_new_tokens": "new tokens T"}.get(setting, "prompt cut L_max (tokens)")
    fig.update_xaxes(title_text=title)
    fig.update_layout(title=f"Scaling over {title}", height=420)
    return fig


def sweep_figures(report: BenchReport, sweeps: list[tuple[str, list[str]]]):
    """Throughput (± std over rounds) and tokens per iteration against each swept parameter, with
    the best reference's throughput as a dashed line (one figure per parameter)."""
    refs = [e for e in report.results if e.reference]
    best_ref = max(refs, key=lambda e: e.throughput_tps) if refs else None
    figures = {}
    for name, values in sweeps:
        rows = [
            e for e in report.results if not e.reference and e.label.endswith(tuple(f" {name}={v}" for v in values))
        ]
        xs = [e.label.rsplit("=", 1)[1] for e in rows]
        fig = make_subplots(specs=[[{"secondary_y": True}]])
        fig.add_scatter(
            x=xs,
            y=[e.throughput_tps for e in rows],
            error_y=dict(type="data", array=[e.throughput_std for e in rows]),
            mode="lines+markers",
            name="tokens / s",
        )
        fig.add_scatter(
            x=xs, y=[e.tokens_per_iteration for e in rows], mode="lines+markers", name="tokens / iteration",
            secondary_y=True,
        )  # fmt: skip
        if best_ref is not None:
            fig.add_hline(y=best_ref.throughput_tps, line_dash="dash", annotation_text=best_ref.label)
        policy = rows[0].policy if rows else ""
        fig.update_layout(title=f"{policy}: throughput vs {name}", xaxis_title=name, height=380, xaxis_type="category")
        fig.update_yaxes(title_text="tokens / s", secondary_y=False)
        fig.update_yaxes(title_text="tokens / iteration", secondary_y=True)
        figures[name] = fig
    return figures


def write_figure(fig, path, png: bool = False) -> list[str]:
    """Write a figure as HTML, and as PNG too when asked (needs the optional `kaleido` package and a
    Chrome/Chromium). Returns the paths written. The figures of one folder share one plotly.js
    beside them (`plotly.min.js`, 4.6 MB, written once; offline like an inline copy) instead of a
    copy in every file: a defaults refit's sweeps drew 88 MB of HTML, almost all of it that script."""
    html, image = path.with_name(path.name + ".html"), path.with_name(path.name + ".png")
    fig.write_html(html, include_plotlyjs="directory")
    written = [str(html)]
    if png:
        try:
            fig.write_image(image, width=1000, height=fig.layout.height or 420)
        except (ImportError, ValueError, RuntimeError) as exc:
            raise DynaTreeError(f"--png needs `pip install kaleido` and Chrome or Chromium: {exc}") from exc
        written.append(str(image))
    return written


def latency_figure(points: list[LatencyPoint]):
    fig = go.Figure()
    for model in dict.fromkeys(p.model for p in points):
        for context in dict.fromkeys(p.context for p in points):
            sel = [p for p in points if p.model == model and p.context == context]
            fig.add_scatter(
                x=[p.new_tokens for p in sel],
                y=[p.ms for p in sel],
                mode="lines+markers",
                name=f"{model}, context {context}",
            )
    fig.update_layout(
        title="One forward's latency vs tokens it reads",
        xaxis_title="new tokens in the forward",
        yaxis_title="ms (median)",
        xaxis_type="log",
        height=420,
    )
    return fig
