"""A tree node's details as text (what the live page shows for a clicked node) and the click itself."""

from __future__ import annotations

import math
from collections.abc import Callable

from dynatree_core.core.tree import Status
from dynatree_core.runs.records import IterationRecord
from dynatree_core.viz.tree import BONUS, SOURCE_WORDS, node_categories, visible


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
        out["source"] = SOURCE_WORDS[tree.source(node)]
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
