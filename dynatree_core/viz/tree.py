"""The draft tree of one iteration: tidy layout (parents centred over their children, children most
probable first), node categories and colours, the clickable figure; a node's details as text.

Node categories (colour): root, accepted, bonus (the target's own token after the accepted path,
drawn as an extra child), rejected (verified; the target chose another token at its parent),
unreached (verified, below a rejected node: never compared), pruned (not sent to the target;
one legend entry and marker shape per reason: threshold, budget, ...). A verified node the policy
did not expand is drawn as an open circle; its reason is in the hover. A node that did not come
from the draft model (core/tree.Source: recycled, retrieved) wears a ring of its source's colour,
one legend entry per source (`SOURCE_RINGS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import plotly.graph_objects as go

from dynatree_core.core.tree import DraftTree, Status
from dynatree_core.runs.records import IterationRecord

COLOURS = {
    "root": "#4c4c4c",
    "accepted": "#2ca02c",
    "bonus": "#1f77b4",
    "rejected": "#d62728",
    "unreached": "#b0b0b0",
    "pruned": "#ff9f1c",
    # the stage view (viz/stages.py): before the outcome is known
    "drafted": "#9467bd",
    "match": "#98df8a",
    "mismatch": "#ff9896",
}


# A ring around the nodes of each source other than the draft model (drawn under the markers)
SOURCE_RINGS = {"recycled": ("#8c564b", "hexagon-open"), "retrieved": ("#17becf", "square-open")}

BONUS = -2  # pseudo node id of the bonus token in layouts and figures
TREE_HEIGHT_PX = 330  # the tree figure's height, and its picture's at most (ui/live_view.py): at 1366x768 the
# first screen holds the whole chart below the title, controls and stage caption


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


def _display_children(tree: DraftTree, record: IterationRecord, bonus: bool, shown=None) -> dict[int, list[int]]:
    kids = tree.child_map(verified_only=False)
    if shown is not None:
        kids = {k: [c for c in v if c in shown] for k, v in kids.items() if k in shown}
    if bonus and record.bonus_token is not None:
        last = record.accepted[-1] if record.accepted else 0
        kids = {k: list(v) for k, v in kids.items()}
        kids.setdefault(last, []).insert(0, BONUS)  # leftmost under the last accepted node
    return kids


def tree_figure(
    record: IterationRecord,
    decode: Callable[[int], str] = str,
    *,
    selected: int | None = None,
    height: int = TREE_HEIGHT_PX,
    categories: dict[int, str] | None = None,
    bonus: bool = True,
    compact_px: int | None = None,
) -> go.Figure:
    """The draft tree of one iteration. `decode` maps a token id to its text. `categories` (the
    stage view, viz/stages.py): draw only these nodes, coloured so; `bonus`: draw the bonus token.
    `compact_px`: a small multiple about this many pixels wide (the compare page's columns): no
    legend (the page draws one for the row, `legend_html`), token labels only where they fit
    beside their neighbours (`fitting_labels`), every token still in the hover.

    Node markers carry customdata [node id, draft p, cumulative p, depth] (the bonus has id -2).
    """
    cats = node_categories(record) if categories is None else categories
    bonus = bonus and record.bonus_token is not None
    kids = _display_children(record.tree, record, bonus, None if categories is None else set(categories))
    pos = tidy_layout(kids)
    path_nodes = {0, *record.accepted, BONUS} if categories is None or "accepted" in cats.values() else set()
    fig = go.Figure(_edge_traces(kids, pos, path_nodes))
    groups = _legend_groups(record.tree, cats, bonus)
    order = {cat: i for i, cat in enumerate(COLOURS)}
    shown = (
        None if compact_px is None else fitting_labels(pos, lambda n: visible(decode(_token(record, n))), compact_px)
    )
    target_at = dict(zip(record.order, record.target_tokens, strict=True))
    fig.add_traces(_source_rings(record.tree, pos))
    for name in sorted(groups, key=lambda g: (order[g.split(":")[0]], g)):
        fig.add_trace(_node_trace(record, name, groups[name], pos, decode, target_at, selected=selected, shown=shown))
    if compact_px is not None:
        fig.update_traces(showlegend=False)
    _lay_out(fig, pos, height=height, depth_title=compact_px is None)
    return fig


def _edge_traces(
    kids: dict[int, list[int]], pos: dict[int, tuple[float, int]], path_nodes: set[int]
) -> list[go.Scatter]:
    """The tree's edges, thin and grey, and the accepted path's (between two `path_nodes`), thick
    and green: one line trace each, segments separated by None."""
    edges_x: list[float | None] = []
    edges_y: list[float | None] = []
    path_x: list[float | None] = []
    path_y: list[float | None] = []
    for parent, children in kids.items():
        for child in children:
            xs, ys = (path_x, path_y) if child in path_nodes and parent in path_nodes else (edges_x, edges_y)
            xs += [pos[parent][0], pos[child][0], None]
            ys += [-pos[parent][1], -pos[child][1], None]
    edges = go.Scatter(
        x=edges_x, y=edges_y, mode="lines", line=dict(color="#cccccc", width=1), hoverinfo="skip", showlegend=False
    )
    path = go.Scatter(
        x=path_x,
        y=path_y,
        mode="lines",
        line=dict(color=COLOURS["accepted"], width=4),
        hoverinfo="skip",
        name="accepted path",
    )
    return [edges, path]


def _source_rings(tree: DraftTree, pos: dict[int, tuple[float, int]]) -> list[go.Scatter]:
    """One trace of rings per source other than the draft model, around its drawn nodes."""
    out = []
    for source, (colour, symbol) in SOURCE_RINGS.items():
        nodes = [n for n, s in tree.sources.items() if s == source and n in pos]
        if nodes:
            out.append(
                go.Scatter(
                    x=[pos[n][0] for n in nodes],
                    y=[-pos[n][1] for n in nodes],
                    mode="markers",
                    marker=dict(symbol=symbol, size=22, color=colour, line=dict(color=colour, width=2)),
                    hoverinfo="skip",
                    name=f"source: {source}",
                )
            )
    return out


def _legend_groups(tree: DraftTree, cats: dict[int, str], bonus: bool) -> dict[str, list[int]]:
    """Legend entry -> its nodes: one entry per category, pruned nodes split by reason."""
    groups: dict[str, list[int]] = {}
    for node, cat in cats.items():
        name = f"pruned: {tree.reason[node] or 'unspecified'}" if cat == "pruned" else cat
        groups.setdefault(name, []).append(node)
    if bonus:
        groups["bonus"] = [BONUS]
    return groups


def _node_trace(
    record: IterationRecord,
    name: str,
    nodes: list[int],
    pos: dict[int, tuple[float, int]],
    decode: Callable[[int], str],
    target_at: dict[int, int],
    *,
    selected: int | None,
    shown: set[int] | None,
) -> go.Scatter:
    """One legend entry's markers: label (where `shown` allows), hover text, shape and customdata
    [node id, draft p, cumulative p, depth] per node; the `selected` node drawn larger."""
    tree, cat = record.tree, name.split(":")[0]
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
            detail = f"status {tree.status[n]}" + (f" ({reason})" if reason and tree.status[n] != Status.KEPT else "")
            detail += f"<br>source {tree.source(n)}" if n else ""
            if n in target_at:
                detail += f"<br>target predicts next: {visible(decode(target_at[n]))}"
            symbols.append(_symbol(tree, n))
        label = visible(decode(token))
        text.append(label if shown is None or n in shown else "")
        probs = "" if p is None else f"<br>p {p:.3f} · cumulative p {cum:.3g}"
        hover.append(f"<b>{label}</b> (id {token})<br>{cat} · depth {depth}{probs}<br>{detail}")
        custom.append([n, p, cum, depth])
    return go.Scatter(
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


def _lay_out(fig: go.Figure, pos: dict[int, tuple[float, int]], *, height: int, depth_title: bool) -> None:
    """Height, margins, the depth axis (ticks 0..deepest, drawn downwards) and the legend above."""
    deepest = max(p[1] for p in pos.values())
    fig.update_layout(
        height=height,
        margin=dict(l=10, r=10, t=10, b=10),  # plotly widens the top margin to hold the legend
        xaxis=dict(visible=False),
        yaxis=dict(
            title="depth" if depth_title else None,
            tickvals=[-d for d in range(deepest + 1)],
            ticktext=[str(d) for d in range(deepest + 1)],
        ),
        legend=LEGEND_ABOVE,
        uirevision="tree",
        clickmode="event+select",
    )


# The legend stands above the plotting area, its bottom edge on the area's top (a horizontal legend
# at y > 2/3 would hang from its top edge into the area, over the root); rows it wraps into widen
# the figure's top margin (plotly's automargin), so no node can lie under it, whatever the tree.
LEGEND_ABOVE = dict(
    orientation="h", x=0, xanchor="left", y=1.02, yanchor="bottom", yref="paper", font=dict(size=10), itemwidth=30
)


def _token(record: IterationRecord, node: int) -> int:
    return record.bonus_token if node == BONUS else record.tree.tokens[node]


CHAR_PX = 7.5  # a token label's width per character at the figure's font size
SIDE_PX = 60  # a figure's margins and depth axis, not available to the tree


def fitting_labels(pos: dict[int, tuple[float, int]], label: Callable[[int], str], width_px: int) -> set[int]:
    """The nodes whose label fits between its neighbours on the same level when the tree is drawn
    `width_px` wide: the gap to each neighbour holds half of both labels (as if all were shown)."""
    xs = [x for x, _ in pos.values()]
    px = max(width_px - SIDE_PX, 1) / max(max(xs) - min(xs), 1.0)
    levels: dict[int, list[int]] = {}
    for node, (_, depth) in pos.items():
        levels.setdefault(depth, []).append(node)
    fits = set()
    for nodes in levels.values():
        nodes.sort(key=lambda n: pos[n][0])
        half = [len(label(n)) * CHAR_PX / 2 + 2 for n in nodes]
        for i, n in enumerate(nodes):
            left = i == 0 or (pos[n][0] - pos[nodes[i - 1]][0]) * px >= half[i] + half[i - 1]
            right = i == len(nodes) - 1 or (pos[nodes[i + 1]][0] - pos[n][0]) * px >= half[i] + half[i + 1]
            if left and right:
                fits.add(n)
    return fits


LEGEND = {
    "root": ("●", "the committed text so far"),
    "accepted": ("●", "the target agreed"),
    "bonus": ("★", "the target's own next token"),
    "rejected": ("●", "the target chose another token"),
    "unreached": ("●", "verified, below a rejection"),
    "pruned": ("✕", "not sent to the target"),
}


SOURCE_WORDS = {
    "model": "the draft model",
    "recycled": "recycled: the target's top-k at an earlier forward (Token Recycling)",
    "retrieved": "retrieved: what followed an earlier match of the context's suffix",
}


def legend_html(sources: bool = False) -> str:
    """One legend for a row of small trees (`tree_figure(compact_px=...)`): the outcome colours,
    and with `sources` the rings of the nodes that did not come from the draft model."""
    items = [
        f'<span title="{what}" style="margin-right:1.1em;white-space:nowrap">'
        f'<span style="color:{COLOURS[cat]};font-size:1.1em">{mark}</span> {cat}</span>'
        for cat, (mark, what) in LEGEND.items()
    ]
    if sources:
        items += [
            f'<span title="{SOURCE_WORDS[source]}" style="margin-right:1.1em;white-space:nowrap">'
            f'<span style="color:{colour};font-size:1.1em">{"⬡" if "hexagon" in symbol else "□"}</span> {source}</span>'
            for source, (colour, symbol) in SOURCE_RINGS.items()
        ]
    return f'<div style="font-size:0.85rem;line-height:1.8">{"".join(items)}</div>'
