"""The attention mask the target received (prefix collapsed, the tree block in the order sent), and
DySpec's block count of a mask (appendix C: BFS vs DFS order)."""

from __future__ import annotations

from collections.abc import Callable

import plotly.graph_objects as go

from dynatree_core.core.tree import DraftTree
from dynatree_core.forward.rows import closure, lineage
from dynatree_core.runs.records import IterationRecord
from dynatree_core.viz.tree import visible


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
        order = tree.order(kind)
        mask = closure(lineage(tree.parent_rows(order))).tolist()
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
