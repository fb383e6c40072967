"""Figures of saved benchmark reports side by side (the Benchmark page's opening view): speedup by
policy and machine, tokens per iteration against what drafting costs, and where an iteration's
time goes (draft / verify / outside the forwards). A report is (its name, its result rows), the
rows as `bench --out` writes them (runs/validate_reports.check_bench_rows)."""

from __future__ import annotations

import plotly.graph_objects as go

Report = tuple[str, list[dict]]


def _stepped(rows: list[dict]) -> list[dict]:
    """The rows with an iteration split (not the HF references: black boxes), missing parts as 0."""
    keys = ("draft_ms_per_iteration", "verify_ms_per_iteration", "overhead_ms_per_iteration", "tokens_per_iteration")
    return [{**r, **{k: r.get(k) or 0.0 for k in keys}} for r in rows if r.get("verify_ms_per_iteration")]


def _laid_out(fig: go.Figure, **layout) -> go.Figure:
    """The side-by-side figures' common frame: 360 px, the legend above, narrow margins."""
    fig.update_layout(height=360, margin=dict(t=30, b=10, l=10, r=10), legend=dict(orientation="h", y=1.12), **layout)
    return fig


def speedup_figure(reports: list[Report]) -> go.Figure:
    """Speedup over the faster of `ar` / HF generate in the same run, one bar group per report."""
    fig = go.Figure()
    for name, rows in reports:
        shown = [r for r in rows if not r["label"].startswith("hf_")]
        fig.add_bar(x=[r["label"] for r in shown], y=[r.get("speedup", 0) for r in shown], name=name)
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888")
    return _laid_out(fig, barmode="group", yaxis_title="speedup (x the faster reference)")


def draft_cost_figure(reports: list[Report]) -> go.Figure:
    """Tokens per iteration against drafting's share of the iteration, a point per policy."""
    fig = go.Figure()
    for name, rows in reports:
        rows = [r for r in _stepped(rows) if r["tokens_per_iteration"]]
        total = [
            r["draft_ms_per_iteration"] + r["verify_ms_per_iteration"] + r["overhead_ms_per_iteration"] for r in rows
        ]
        fig.add_scatter(
            x=[100 * r["draft_ms_per_iteration"] / t for r, t in zip(rows, total, strict=True)],
            y=[r["tokens_per_iteration"] for r in rows],
            text=[r["label"] for r in rows],
            mode="markers+text",
            textposition="top center",
            name=name,
        )
    return _laid_out(fig, xaxis_title="drafting's share of the iteration (%)", yaxis_title="tokens per iteration")


def split_figure(report: Report) -> go.Figure:
    """One report's iteration split per policy: draft, verify and outside-the-forwards ms."""
    rows = _stepped(report[1])
    fig = go.Figure()
    parts = (("draft", "draft_ms_per_iteration"), ("verify", "verify_ms_per_iteration"))
    for part, key in (*parts, ("outside", "overhead_ms_per_iteration")):
        fig.add_bar(y=[r["label"] for r in rows], x=[r[key] for r in rows], name=part, orientation="h")
    fig.update_layout(
        barmode="stack",
        xaxis_title=f"ms per iteration ({report[0]})",
        height=80 + 28 * len(rows),
        margin=dict(t=30, b=10, l=10, r=10),
        yaxis=dict(autorange="reversed"),
        legend=dict(orientation="h", y=1.1),
    )
    return fig
