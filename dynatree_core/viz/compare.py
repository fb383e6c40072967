"""The compare page's figures over a Comparison's entries."""

from __future__ import annotations

import plotly.graph_objects as go

LEGEND_PER_ROW = 3  # legend entries a row holds in a chart half a laptop screen wide
LEGEND_ROW_PX = 22


def compare_figures(entries: list, *, height: int = 320) -> dict[str, go.Figure]:
    """The comparison page's charts from its EntryStats: throughput (± std), committed tokens per
    iteration, the accepted-length histogram and acceptance by tree depth."""
    labels = [e.label for e in entries]
    throughput = go.Figure(
        go.Bar(
            x=labels,
            y=[e.throughput_tps for e in entries],
            error_y=dict(type="data", array=[e.throughput_std for e in entries]),
            marker_color=["#9e9e9e" if e.reference else "#1f77b4" for e in entries],
            text=[f"{e.speedup:.2f}x" for e in entries],
            textposition="outside",
        )
    )
    throughput.update_layout(
        yaxis_title="tokens / s (mean ± std)", title="Throughput (label: speedup vs best reference)"
    )
    committed, histogram, depth = go.Figure(), go.Figure(), go.Figure()
    for e in entries:
        if e.reference:
            continue
        committed.add_scatter(
            x=list(range(1, len(e.committed_per_iteration) + 1)),
            y=e.committed_per_iteration,
            mode="lines",
            name=e.label,
        )
        if e.accepted_lengths:
            histogram.add_histogram(x=e.accepted_lengths, name=e.label, histnorm="probability", xbins=dict(size=1))
        if e.acceptance_by_depth:
            depth.add_scatter(
                x=list(range(1, len(e.acceptance_by_depth) + 1)),
                y=e.acceptance_by_depth,
                mode="lines+markers",
                name=e.label,
            )
    committed.update_layout(title="Committed tokens per iteration (first run)", xaxis_title="iteration")
    histogram.update_layout(title="Accepted draft tokens per iteration", barmode="group", xaxis_title="accepted")
    depth.update_layout(
        title="Acceptance by depth",
        xaxis_title="depth d",
        yaxis_title="P(accepted >= d | tree reached d)",
        yaxis_range=[0, 1],
    )
    figures = {"throughput": throughput, "committed": committed, "accepted": histogram, "depth": depth}
    for fig in figures.values():  # legend above the plot (below it, it covers the x-axis title), under the title
        rows = -(-len(fig.data) // LEGEND_PER_ROW) if len(fig.data) > 1 else 0  # one trace: no legend
        fig.update_layout(
            height=height + LEGEND_ROW_PX * max(rows - 1, 0),
            title=dict(y=1.0, yanchor="top", yref="container", pad=dict(t=12)),
            margin=dict(l=10, r=10, t=50 + LEGEND_ROW_PX * rows, b=10),
            legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1),
        )
    throughput.update_yaxes(range=[0, 1.2 * max((e.throughput_tps + e.throughput_std for e in entries), default=1)])
    return figures
