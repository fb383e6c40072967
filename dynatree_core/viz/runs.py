"""Figures over a run: the committed text, running charts, SALF's mass per step, the verifier's steps
as rows, expected vs realised acceptance by depth, and the speed breakdown against the latency profile."""

from __future__ import annotations

import html
from collections.abc import Callable

import plotly.graph_objects as go

from dynatree_core.runs.records import IterationRecord
from dynatree_core.viz.tree import COLOURS, visible


def text_html(records: list[IterationRecord], decode: Callable[[int], str] = str, tail: int | None = None) -> str:
    """The generated text: accepted draft tokens and bonus tokens marked, iterations separated.
    `tail`: only the last iterations holding at least that many tokens, after a count of the rest
    (a running page draws a constant amount of text however long the run grows)."""
    start = 0
    if tail is not None:
        start, kept = len(records), 0
        while start > 0 and kept < tail:
            start -= 1
            kept += len(records[start].committed)
    parts = []
    if start:
        earlier = sum(len(r.committed) for r in records[:start])
        parts.append(f'<span style="color:#888">… {earlier} earlier tokens ({start} iterations) … </span>')
    for rec in records[start:]:
        spans = []
        for i, tok in enumerate(rec.committed):
            kind = "accepted" if i < len(rec.accepted) else "bonus"
            text = html.escape(decode(tok)).replace("\n", "⏎<br>")
            spans.append(
                f'<span title="iteration {rec.index}: {kind}" style="background:{COLOURS[kind]}22;'
                f'border-bottom:2px solid {COLOURS[kind]}">{text}</span>'
            )
        parts.append(f'<span style="border-right:1px dotted #888">{"".join(spans)}</span>')
    return '<div style="line-height:1.9;white-space:pre-wrap">' + "".join(parts) + "</div>"


def run_charts(records: list[IterationRecord], ar_tps: float | None = None, *, height: int = 460) -> go.Figure:
    """Running charts: tokens/iteration, acceptance rate, throughput (engine time only; speedup
    against an AR reference when given) and the time split of every iteration."""
    from plotly.subplots import make_subplots

    its = [r.index for r in records]
    tokens = [len(r.committed) for r in records]
    acc = [len(r.accepted) / r.drafted if r.drafted else 0.0 for r in records]
    cum_tokens, cum_ms, tps = 0, 0.0, []
    for r in records:
        cum_tokens += len(r.committed)
        cum_ms += r.wall_ms
        tps.append(1000 * cum_tokens / cum_ms if cum_ms > 0 else 0.0)
    right = "speedup vs AR" if ar_tps else "tokens / s (running)"
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=(
            "tokens committed / iteration",
            "acceptance rate (accepted / drafted)",
            right,
            "time split (ms)",
        ),
        vertical_spacing=0.18,
    )
    fig.add_trace(go.Scatter(x=its, y=tokens, mode="lines+markers", name="tokens/iteration"), row=1, col=1)
    fig.add_trace(go.Scatter(x=its, y=acc, mode="lines+markers", name="acceptance"), row=1, col=2)
    fig.add_trace(
        go.Scatter(x=its, y=[t / ar_tps for t in tps] if ar_tps else tps, mode="lines", name=right), row=2, col=1
    )
    for part, colour in (
        ("draft_ms", "#9467bd"),
        ("verify_ms", "#1f77b4"),
        ("commit_ms", "#2ca02c"),
        ("overhead_ms", "#aaaaaa"),
    ):
        fig.add_trace(
            go.Bar(x=its, y=[getattr(r, part) for r in records], name=part.removesuffix("_ms"), marker_color=colour),
            row=2,
            col=2,
        )
    fig.update_layout(barmode="stack", height=height, margin=dict(l=10, r=10, t=40, b=10), uirevision="charts")
    fig.update_yaxes(range=[0, 1.05], row=1, col=2)
    return fig


def salf_mass_figure(masses: list[float], th: float, *, height: int = 260) -> go.Figure:
    """SALF's stopping rule for one tree: the probability mass of each drafting step's batch
    (decreasing, Theorem 1) against the threshold th; drafting stops at the first bar below it."""
    steps = list(range(1, len(masses) + 1))
    colours = [COLOURS["accepted"] if m >= th else COLOURS["rejected"] for m in masses]
    fig = go.Figure(go.Bar(x=steps, y=masses, marker_color=colours, name="batch mass"))
    fig.add_hline(y=th, line_dash="dash", annotation_text=f"th = {th:g}")
    fig.update_layout(
        height=height,
        margin=dict(l=10, r=10, t=30, b=10),
        xaxis_title="drafting step (one draft forward each)",
        yaxis_title="probability mass",
        uirevision="salf",
    )
    return fig


def verification_rows(record: IterationRecord, decode: Callable[[int], str] = str) -> list[dict]:
    """The verifier's steps as table rows: where it was, which child it tried with what
    acceptance probability, the uniform draw, the residual after a rejection, what it drew last."""
    tree, rows = record.tree, []

    def where(node: int | None) -> str:
        if node is None:
            return ""
        return visible("".join(decode(tree.tokens[n]) for n in tree.path(node)[1:])) or "(root)"

    sources = bool(tree.sources)  # a tree that mixes sources says which one each tried child came from
    for step, ev in enumerate(record.verification, 1):
        row = {"step": step, "at node": where(ev.get("node")), "event": ev["kind"]}
        if sources:
            row["source"] = tree.source(ev["child"]) if ev.get("child") is not None else ""
        if ev["kind"] == "test":
            target = ev.get("child")
            row["token"] = visible(decode(ev["token"])) if ev.get("token") is not None else f"(stop at {where(target)})"
            row["accept prob"] = round(ev["prob"], 4)
            row["uniform draw"] = round(ev["u"], 4)
            row["outcome"] = "accepted" if ev["accepted"] else "rejected"
        elif ev["kind"] == "residual":
            row["token"] = ", ".join(f"{visible(decode(t))} {p:.2f}" for t, p in ev["top"])
            row["outcome"] = "residual after a rejection" + (f" (weight {ev['weight']:.3f})" if "weight" in ev else "")
        elif ev["kind"] == "sample":
            row["token"] = visible(decode(ev["token"]))
            row["outcome"] = f"drawn from {'the target p' if ev['source'] == 'p' else 'the residual'}"
        else:  # greedy
            row["token"] = visible(decode(ev["token"]))
            row["outcome"] = "matches a child: accepted" if ev.get("child") is not None else "no child: bonus, stop"
        rows.append(row)
    return rows


def acceptance_figure(rows: list[dict], *, height: int = 300) -> go.Figure:
    fig = go.Figure()
    depths = [r["depth"] for r in rows]
    fig.add_bar(x=depths, y=[r["expected"] for r in rows], name="expected (verifier's exact law)")
    fig.add_bar(x=depths, y=[r["realised"] for r in rows], name="realised")
    fig.update_layout(
        barmode="group",
        height=height,
        margin=dict(l=10, r=10, t=30, b=10),
        xaxis_title="depth d",
        yaxis_title="P(accepted length >= d)",
        yaxis_range=[0, 1],
        legend=dict(orientation="h"),
    )
    return fig


def why_figure(points: list, records: list[IterationRecord], *, height: int = 340) -> go.Figure:
    """The target's forward latency against tokens per forward (the device's profile) with this
    run's verification forwards on top: where on the curve the trees land."""
    fig = go.Figure()
    target = sorted((p.new_tokens, p.ms) for p in points if p.model == "target")
    draft = sorted((p.new_tokens, p.ms) for p in points if p.model == "draft")
    for name, pts, dash in (("target forward (profile)", target, None), ("draft forward (profile)", draft, "dot")):
        if pts:
            fig.add_scatter(
                x=[n for n, _ in pts], y=[ms for _, ms in pts], mode="lines+markers", name=name, line=dict(dash=dash)
            )
    fig.add_scatter(
        x=[len(r.order) - 1 + r.chain_len for r in records],
        y=[r.verify_ms for r in records],
        mode="markers",
        name="this run's verifications",
        marker=dict(size=7, opacity=0.5),
    )
    fig.update_layout(
        height=height,
        xaxis_title="tokens in one forward",
        yaxis_title="ms",
        xaxis_type="log",
        margin=dict(l=10, r=10, t=30, b=10),
        legend=dict(orientation="h", y=1.12),
    )
    return fig


def first_token_figure(rows: list[dict]) -> go.Figure:
    """The Verification Lab's histogram: the target's probability and the observed frequency of
    the first committed token (rows of LabResult.table)."""
    fig = go.Figure()
    labels = [f"{r['token']} ({r['id']})" for r in rows]
    fig.add_bar(x=labels, y=[r["target p"] for r in rows], name="target p")
    fig.add_bar(x=labels, y=[r["observed"] for r in rows], name="observed frequency")
    fig.update_layout(barmode="group", height=360, margin=dict(l=10, r=10, t=30, b=10), legend=dict(orientation="h"))
    return fig
