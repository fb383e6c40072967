"""Figures of one iteration, as pure functions of its IterationRecord (no Streamlit here).

  tree_figure   the draft tree in a tidy layout (parents centred over their children, children
                most probable first), nodes coloured by what happened to them
  mask_figure   the attention mask the target received: prefix collapsed to one column, then
                the tree block in the order sent, with token labels
  block_count   non-zero 32x32 blocks of a mask (DySpec appendix C: BFS vs DFS order)

Node categories (colour): root, accepted, bonus (the target's own token after the accepted path,
drawn as an extra child), rejected (verified; the target chose another token at its parent),
unreached (verified, below a rejected node: never compared), pruned (not sent to the target;
one legend entry and marker shape per reason: threshold, budget, ...). A verified node the policy
did not expand is drawn as an open circle; its reason is in the hover.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable

import plotly.graph_objects as go

from dynatree_core.trace import IterationRecord
from dynatree_core.tree import DraftTree, Status

COLOURS = {
    "root": "#4c4c4c",
    "accepted": "#2ca02c",
    "bonus": "#1f77b4",
    "rejected": "#d62728",
    "unreached": "#b0b0b0",
    "pruned": "#ff9f1c",
}
BONUS = -2  # pseudo node id of the bonus token in layouts and figures


def visible(text: str) -> str:
    """Token text with whitespace made visible (space, newline, tab)."""
    return text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥") or "∅"


def tidy_layout(children: dict[int, list[int]], root: int = 0) -> dict[int, tuple[float, int]]:
    """(x, depth) per node: leaves side by side in child order, each parent centred over its
    children's extent. `children` lists each node's children in display order."""
    pos: dict[int, tuple[float, int]] = {}
    next_leaf = 0.0
    stack: list[tuple[int, int, bool]] = [(root, 0, False)]
    while stack:  # iterative post-order: deep trees must not hit the recursion limit
        node, depth, done = stack.pop()
        kids = children.get(node, [])
        if not kids:
            pos[node] = (next_leaf, depth)
            next_leaf += 1.0
        elif done:
            pos[node] = ((pos[kids[0]][0] + pos[kids[-1]][0]) / 2, depth)
        else:
            stack.append((node, depth, True))
            stack.extend((kid, depth + 1, False) for kid in reversed(kids))
    return pos


def node_categories(record: IterationRecord) -> dict[int, str]:
    """Category of every tree node (see the module docstring)."""
    tree = record.tree
    accepted = set(record.accepted)
    on_path = {0} | accepted
    out: dict[int, str] = {}
    for node in range(len(tree)):  # parents precede children
        parent = tree.parents[node]
        if node == 0:
            out[node] = "root"
        elif not tree.is_verified(node):
            out[node] = "pruned"
        elif node in accepted:
            out[node] = "accepted"
        elif parent in on_path:
            out[node] = "rejected"
        else:
            out[node] = "unreached"
    return out


PRUNED_SYMBOLS = {"threshold": "x", "budget": "square", "branch_limit": "diamond", "depth_limit": "triangle-down"}


def _symbol(tree: DraftTree, node: int) -> str:
    """Marker shape: open circle for a verified leaf the policy did not expand, one shape per
    pruning reason (so the reasons stay apart without the hover), filled circle otherwise."""
    if tree.status[node] == Status.PRUNED:
        return PRUNED_SYMBOLS.get(tree.reason[node] or "", "triangle-up")
    return "circle-open" if tree.status[node] == Status.NOT_EXPANDED and node else "circle"


def _display_children(tree: DraftTree, record: IterationRecord) -> dict[int, list[int]]:
    kids = tree.child_map(verified_only=False)
    if record.bonus_token is not None:
        last = record.accepted[-1] if record.accepted else 0
        kids = {k: list(v) for k, v in kids.items()}
        kids.setdefault(last, []).insert(0, BONUS)  # leftmost under the last accepted node
    return kids


def tree_figure(
    record: IterationRecord,
    decode: Callable[[int], str] = str,
    *,
    selected: int | None = None,
    height: int = 420,
) -> go.Figure:
    """The draft tree of one iteration. `decode` maps a token id to its text.

    Node markers carry customdata [node id, draft p, cumulative p, depth] (the bonus has id -2).
    """
    tree = record.tree
    kids = _display_children(tree, record)
    pos = tidy_layout(kids)
    cats = node_categories(record)
    target_at = dict(zip(record.order, record.target_tokens, strict=True))
    fig = go.Figure()
    edges_x: list[float | None] = []
    edges_y: list[float | None] = []
    path_x: list[float | None] = []
    path_y: list[float | None] = []
    path_nodes = {0, *record.accepted, BONUS}
    for parent, children in kids.items():
        for child in children:
            xs, ys = (path_x, path_y) if child in path_nodes and parent in path_nodes else (edges_x, edges_y)
            xs += [pos[parent][0], pos[child][0], None]
            ys += [-pos[parent][1], -pos[child][1], None]
    fig.add_trace(
        go.Scatter(
            x=edges_x, y=edges_y, mode="lines", line=dict(color="#cccccc", width=1), hoverinfo="skip", showlegend=False
        )
    )
    fig.add_trace(
        go.Scatter(
            x=path_x,
            y=path_y,
            mode="lines",
            line=dict(color=COLOURS["accepted"], width=4),
            hoverinfo="skip",
            name="accepted path",
        )
    )
    groups: dict[str, list[int]] = {}  # legend entry -> nodes; pruned nodes split by reason
    for node, cat in cats.items():
        name = f"pruned: {tree.reason[node] or 'unspecified'}" if cat == "pruned" else cat
        groups.setdefault(name, []).append(node)
    if record.bonus_token is not None:
        groups["bonus"] = [BONUS]
    order = {cat: i for i, cat in enumerate(COLOURS)}
    for name in sorted(groups, key=lambda g: (order[g.split(":")[0]], g)):
        nodes, cat = groups[name], name.split(":")[0]
        text, hover, custom, symbols = [], [], [], []
        for n in nodes:
            if n == BONUS:
                token, p, cum, depth = record.bonus_token, None, None, pos[BONUS][1]
                detail = "the target's own next token (free with every iteration)"
                symbols.append("star")
            else:
                token, depth = tree.tokens[n], tree.depths[n]
                p, cum = math.exp(tree.logp[n]), math.exp(tree.cum_logp[n])
                reason = tree.reason[n] or ""
                detail = f"status {tree.status[n]}" + (
                    f" ({reason})" if reason and tree.status[n] != Status.KEPT else ""
                )
                if n in target_at:
                    detail += f"<br>target predicts next: {visible(decode(target_at[n]))}"
                symbols.append(_symbol(tree, n))
            label = visible(decode(token))
            text.append(label)
            probs = "" if p is None else f"<br>p {p:.3f} · cumulative p {cum:.3g}"
            hover.append(f"<b>{label}</b> (id {token})<br>{cat} · depth {depth}{probs}<br>{detail}")
            custom.append([n, p, cum, depth])
        fig.add_trace(
            go.Scatter(
                x=[pos[n][0] for n in nodes],
                y=[-pos[n][1] for n in nodes],
                mode="markers+text",
                text=text,
                textposition="bottom center",
                marker=dict(
                    color=COLOURS[cat],
                    size=[18 if n == selected else 12 for n in nodes],
                    symbol=symbols,
                    line=dict(color=COLOURS[cat], width=2),
                ),
                customdata=custom,
                hovertext=hover,
                hoverinfo="text",
                name=name,
            )
        )
    fig.update_layout(
        height=height,
        margin=dict(l=10, r=10, t=30, b=10),
        xaxis=dict(visible=False),
        yaxis=dict(
            title="depth",
            tickvals=[-d for d in range(max(p[1] for p in pos.values()) + 1)],
            ticktext=[str(d) for d in range(max(p[1] for p in pos.values()) + 1)],
        ),
        legend=dict(orientation="h", y=1.08),
        uirevision="tree",
        clickmode="event+select",
    )
    return fig


def node_details(record: IterationRecord, node: int, decode: Callable[[int], str] = str) -> dict[str, str]:
    """What the app shows for a clicked node: its path as text, probabilities, what happened to
    it and why, and the target's predictions at its parent and at the node itself."""
    tree = record.tree
    target_at = dict(zip(record.order, record.target_tokens, strict=True))
    if node == BONUS:
        if record.bonus_token is None:
            raise ValueError("this iteration has no bonus token")
        last = record.accepted[-1] if record.accepted else 0
        path = [decode(tree.tokens[n]) for n in tree.path(last)] + [decode(record.bonus_token)]
        return {
            "token": f"{visible(decode(record.bonus_token))} (id {record.bonus_token})",
            "path": visible("".join(path[1:])) + f"  (after the root {visible(path[0])})",
            "status": "bonus: the target's own next token after the accepted path, committed for free",
            "depth": str(len(path) - 1),
        }
    if not 0 <= node < len(tree):
        raise ValueError(f"no node {node} in this tree ({len(tree)} nodes)")
    path = [decode(tree.tokens[n]) for n in tree.path(node)]
    cat = node_categories(record)[node]
    status = f"{cat} ({tree.status[node]}"
    status += f": {tree.reason[node]})" if tree.reason[node] and tree.status[node] != Status.KEPT else ")"
    out = {
        "token": f"{visible(path[-1])} (id {tree.tokens[node]})",
        "path": (visible("".join(path[1:])) if node else "(the root itself)")
        + f"  (after the root {visible(path[0])})",
        "status": status,
        "depth": str(tree.depths[node]),
    }
    if node:
        out["draft p"] = f"{math.exp(tree.logp[node]):.4f}"
        out["cumulative p"] = f"{math.exp(tree.cum_logp[node]):.4g}"
        parent = tree.parents[node]
        if parent in target_at:
            chose = target_at[parent]
            verdict = "same as this node" if chose == tree.tokens[node] else "not this node"
            out["target at the parent"] = f"{visible(decode(chose))} ({verdict})"
    if node in target_at:
        out["target after this node"] = visible(decode(target_at[node]))
    else:
        out["target after this node"] = "not computed (the node was not sent to the target)"
    info = record.analysis.get(str(node))
    if info is not None:  # sampled runs: the verifier's exact law on this drawn tree
        out["reach probability"] = f"{info['reach']:.4f} (P(the {record.verifier} verifier accepts it), this tree)"
        if "expected_acceptance" in info:
            out["expected acceptance here"] = f"{info['expected_acceptance']:.4f} (closed form over the draws, App. C)"
    return out


def clicked_node(selection: dict | None) -> int | None:
    """Node id of the clicked tree marker, from the chart's selection state (its customdata[0]);
    None for no click, an edge or an empty area."""
    points = ((selection or {}).get("selection") or {}).get("points") or []
    data = points[0].get("customdata") if points else None
    return int(data[0]) if data else None


def block_count(mask: list[str], block: int = 32) -> int:
    """Non-zero block x block tiles of a 0/1 mask given as row strings."""
    tiles = set()
    for i, row in enumerate(mask):
        for j, c in enumerate(row):
            if c == "1":
                tiles.add((i // block, j // block))
    return len(tiles)


def order_block_counts(tree: DraftTree, block: int = 32) -> dict[str, int]:
    """Non-zero block counts of the tree mask in BFS and in DFS order (DySpec appendix C)."""
    out = {}
    for kind in ("bfs", "dfs"):
        mask = tree.ancestor_mask(tree.order(kind)).tolist()
        out[kind] = block_count(["".join("1" if v else "0" for v in row) for row in mask], block)
    return out


def mask_figure(record: IterationRecord, decode: Callable[[int], str] = str, *, height: int = 420) -> go.Figure:
    """The tree block of the attention mask as sent, with the committed prefix as one column."""
    n = len(record.order)
    labels = [visible(decode(record.tree.tokens[node])) for node in record.order]
    z = [[1] + [int(c) for c in row] for row in record.mask]  # every node sees the whole prefix
    x_labels = [f"prefix ({record.prefix_len})"] + labels
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n + 1)),
            y=list(range(n)),
            colorscale=[[0, "#f4f4f4"], [1, "#1f4e79"]],
            showscale=False,
            xgap=1,
            ygap=1,
            hovertemplate="query %{y} attends key %{x}: %{z}<extra></extra>",
        )
    )
    fig.update_layout(
        height=height,
        margin=dict(l=10, r=10, t=10, b=10),
        xaxis=dict(tickvals=list(range(n + 1)), ticktext=x_labels, side="top", tickangle=-60),
        yaxis=dict(
            tickvals=list(range(n)),
            ticktext=[f"{lab} @{p}" for lab, p in zip(labels, record.position_ids, strict=True)],
            autorange="reversed",
        ),
        uirevision="mask",
    )
    return fig


def text_html(records: list[IterationRecord], decode: Callable[[int], str] = str) -> str:
    """The generated text: accepted draft tokens and bonus tokens marked, iterations separated."""
    parts = []
    for rec in records:
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


# ----- verification ---------------------------------------------------------------------------------
def verification_rows(record: IterationRecord, decode: Callable[[int], str] = str) -> list[dict]:
    """The verifier's steps as table rows: where it was, which child it tried with what
    acceptance probability, the uniform draw, the residual after a rejection, what it drew last."""
    tree, rows = record.tree, []

    def where(node: int | None) -> str:
        if node is None:
            return ""
        return visible("".join(decode(tree.tokens[n]) for n in tree.path(node)[1:])) or "(root)"

    for step, ev in enumerate(record.verification, 1):
        row = {"step": step, "at node": where(ev.get("node")), "event": ev["kind"]}
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


def acceptance_by_depth(records: list[IterationRecord]) -> list[dict]:
    """Per depth d: expected P(the walk accepts >= d drafts) from the per-node analysis (the sum
    of the reach probabilities of depth-d nodes), against the realised fraction of iterations."""
    expected: dict[int, list[float]] = {}
    realised: dict[int, list[float]] = {}
    for rec in records:
        if not rec.analysis:
            continue
        deepest = max(rec.tree.depths[n] for n in rec.order)
        for d in range(1, deepest + 1):
            reach = sum(v["reach"] for k, v in rec.analysis.items() if rec.tree.depths[int(k)] == d)
            expected.setdefault(d, []).append(reach)
            realised.setdefault(d, []).append(float(len(rec.accepted) >= d))
    return [
        {
            "depth": d,
            "expected": sum(expected[d]) / len(expected[d]),
            "realised": sum(realised[d]) / len(realised[d]),
            "iterations": len(expected[d]),
        }
        for d in sorted(expected)
    ]


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


# ----- policy comparison ------------------------------------------------------------------------------
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
    for fig in figures.values():  # legend above the plot: below it, it covers the x-axis title
        fig.update_layout(
            height=height,
            margin=dict(l=10, r=10, t=70, b=10),
            legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1),
        )
    throughput.update_yaxes(range=[0, 1.2 * max((e.throughput_tps + e.throughput_std for e in entries), default=1)])
    return figures


def speed_breakdown(records: list[IterationRecord], step_ms: float | None = None) -> dict[str, float]:
    """Where an iteration's time goes, against plain decoding's cost per token (`step_ms`: a
    one-token target forward from the latency profile, or an AR run's time per token).

    speedup ~= tokens per iteration x step_ms / iteration_ms: speculation pays only when the
    tokens an iteration commits outweigh what drafting and the wider verification cost."""
    n = len(records)
    if n == 0:
        return {}

    def mean(values: list[float]) -> float:
        return sum(values) / n

    out = {
        "iterations": n,
        "tokens_per_iteration": mean([len(r.committed) for r in records]),
        "draft_ms": mean([r.draft_ms for r in records]),
        "draft_forwards": mean([r.draft_forwards for r in records]),
        "verify_ms": mean([r.verify_ms for r in records]),
        "other_ms": mean([r.commit_ms + r.overhead_ms for r in records]),
        "tokens_verified": mean([len(r.order) - 1 + r.chain_len for r in records]),  # one target forward's width
    }
    out["iteration_ms"] = out["draft_ms"] + out["verify_ms"] + out["other_ms"]
    if step_ms:
        out["step_ms"] = step_ms
        out["verify_vs_step"] = out["verify_ms"] / step_ms
        out["break_even_tokens"] = out["iteration_ms"] / step_ms
        out["expected_speedup"] = out["tokens_per_iteration"] * step_ms / out["iteration_ms"]
    return out


def why_text(b: dict[str, float]) -> str:
    """The breakdown in words, with what would change the outcome."""
    if not b:
        return "No iterations yet."
    lines = [
        f"Each iteration commits **{b['tokens_per_iteration']:.2f}** tokens and takes **{b['iteration_ms']:.0f} ms**: "
        f"{b['draft_ms']:.0f} ms drafting ({b['draft_forwards']:.1f} draft forwards), {b['verify_ms']:.0f} ms for one "
        f"target forward over {b['tokens_verified']:.1f} tokens, {b['other_ms']:.1f} ms outside the forwards."
    ]
    if "step_ms" not in b:
        lines.append("Measure the latency profile (or the AR reference) to compare with plain decoding.")
        return "\n\n".join(lines)
    verdict = "faster" if b["expected_speedup"] > 1 else "slower"
    lines.append(
        f"Plain decoding pays **{b['step_ms']:.0f} ms** per token, so this run breaks even at "
        f"**{b['break_even_tokens']:.2f}** tokens per iteration; it commits {b['tokens_per_iteration']:.2f}, "
        f"so it is expected to be **{b['expected_speedup']:.2f}x** ({verdict} than plain decoding)."
    )
    tips = []
    if b["verify_vs_step"] > 1.5:
        tips.append(
            f"verifying {b['tokens_verified']:.0f} tokens costs {b['verify_vs_step']:.1f}x a one-token step on this "
            "device (see the curve): a smaller node budget or tree keeps the verification near the flat part"
        )
    if b["draft_ms"] > 0.35 * b["iteration_ms"]:
        tips.append(
            f"drafting is {b['draft_ms'] / b['iteration_ms']:.0%} of the iteration: fewer levels (depth) or an earlier "
            "stop (thresholds) save draft forwards"
        )
    if b["tokens_per_iteration"] < b["break_even_tokens"] + 0.3:
        tips.append("the draft's proposals are accepted too rarely: a better-matched draft model is the real lever")
    if tips:
        lines.append("What would help: " + "; ".join(tips) + ".")
    return "\n\n".join(lines)


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


STOP_TEXT = {
    "eos": "the model ended its answer (an end-of-sequence token)",
    "max_new_tokens": "it reached the max new tokens setting",
    "context_limit": "the prompt and the output filled the model's context window; it can take no more tokens",
}


def stop_text(stop: str | None) -> str:
    """Why a finished run stopped, in words."""
    return "Finished: " + STOP_TEXT.get(stop or "", f"stopped ({stop or 'no reason recorded'})") + "."
