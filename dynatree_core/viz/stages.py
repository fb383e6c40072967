"""One iteration, stage by stage: what the tree, the mask and the cache looked like after each step.

An iteration's record holds its outcome; the order of events is the lesson. `iteration_stages`
cuts a record into the stages a reader follows, each with one sentence and its numbers:

    draft depth 1..D   the tree as it stood once the draft had proposed that depth (one draft
                       forward per level), with each new node's draft probability
    prune              the nodes withdrawn before verification, and why
    mask               the verified nodes in the order sent to the target, each seeing its ancestors
    verify             one target forward scored every node: does each token equal the target's
                       choice at its parent?
    accept             the longest path of matches from the root
    bonus              the target's own token after that path, free with every iteration
    commit             the cache keeps the prefix and the accepted path's slots, drops the rest

`stage_categories` colours the tree at a stage (viz/tree.py draws it); `cache_slots` lists the
slots of the iteration's target forward and which ones commit keeps. Pure functions of a record:
live, imported and replayed runs alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from dynatree_core.core.tree import Status
from dynatree_core.runs.records import IterationRecord
from dynatree_core.viz.tree import node_categories, visible


@dataclasses.dataclass(frozen=True)
class Stage:
    kind: str  # draft, prune, mask, verify, accept, bonus, commit
    depth: int = 0  # for "draft": the deepest level proposed so far
    label: str = ""


def iteration_stages(rec: IterationRecord) -> list[Stage]:
    """The stages of one iteration, in order (a prefill-only iteration has no draft stages)."""
    tree = rec.tree
    deepest = max(tree.depths, default=0)
    out = [Stage("draft", d, f"draft depth {d}") for d in range(1, deepest + 1)]
    if any(s == Status.PRUNED for s in tree.status):
        out.append(Stage("prune", deepest, "prune"))
    out += [Stage("mask", deepest, "mask"), Stage("verify", deepest, "verify"), Stage("accept", deepest, "accept")]
    if rec.bonus_token is not None:
        out.append(Stage("bonus", deepest, "bonus"))
    out.append(Stage("commit", deepest, "commit"))
    return out


def stage_categories(rec: IterationRecord, stage: Stage) -> dict[int, str]:
    """Category of every node shown at `stage` (nodes not yet drafted are left out)."""
    tree = rec.tree
    if stage.kind == "draft":
        return {n: "root" if n == 0 else "drafted" for n in range(len(tree)) if tree.depths[n] <= stage.depth}
    if stage.kind in ("prune", "mask"):
        return {n: "root" if n == 0 else "pruned" if not tree.is_verified(n) else "drafted" for n in range(len(tree))}
    if stage.kind == "verify":
        choice = dict(zip(rec.order, rec.target_tokens, strict=True))
        out = {}
        for n in range(len(tree)):
            if n == 0:
                out[n] = "root"
            elif not tree.is_verified(n):
                out[n] = "pruned"
            else:
                out[n] = "match" if choice.get(tree.parents[n]) == tree.tokens[n] else "mismatch"
        return out
    return node_categories(rec)  # accept, bonus, commit: the outcome


def cache_slots(rec: IterationRecord) -> list[dict]:
    """The target's cache slots this iteration wrote, and what commit does with each: the chain
    (committed tokens the target had not read yet, root last) and one slot per verified node in
    the order sent. Kept: the chain and the accepted nodes; dropped: every other node's slot."""
    accepted = set(rec.accepted)
    first = rec.prefix_len + 1 - rec.chain_len  # slot of the chain's first token
    slots = [{"slot": first + i, "what": "chain", "node": None, "kept": True} for i in range(rec.chain_len)]
    for i, node in enumerate(rec.order[1:], 1):
        slots.append({"slot": rec.prefix_len + i, "what": "node", "node": node, "kept": node in accepted})
    return slots


def stage_caption(rec: IterationRecord, stage: Stage, decode: Callable[[int], str] = str) -> str:
    """The stage's caption above the tree (markdown): its label once, in bold, then what happened."""
    return f"**{stage.label.capitalize()}.** {stage_sentence(rec, stage, decode)}"


def stage_sentence(rec: IterationRecord, stage: Stage, decode: Callable[[int], str] = str) -> str:
    """What just happened at `stage`, with its numbers; it does not repeat the stage's label, which
    stands before it in the caption (`stage_caption`)."""
    tree = rec.tree
    say = lambda tok: f"'{visible(decode(tok))}'"  # noqa: E731
    if stage.kind == "draft":
        new = [n for n in range(1, len(tree)) if tree.depths[n] == stage.depth]
        best = sorted(new, key=lambda n: -tree.logp[n])[:3]
        probs = ", ".join(f"{say(tree.tokens[n])} p={math.exp(tree.logp[n]):.2f}" for n in best)
        return f"Forward pass {stage.depth} proposed {len(new)} token(s), the likeliest {probs}."
    if stage.kind == "prune":
        pruned = [n for n in range(len(tree)) if not tree.is_verified(n)]
        reasons = sorted({tree.reason[n] or "unspecified" for n in pruned})
        return (
            f"{len(pruned)} node(s) withdrawn before verification ({', '.join(reasons)}): the target never sees them."
        )
    if stage.kind == "mask":
        n = len(rec.order) - 1
        return (
            f"{n} verified node(s) go to the target in one forward, each at position root + depth and "
            f"seeing only its ancestors, after {rec.chain_len} committed token(s) the target had not read."
        )
    if stage.kind == "verify":
        cats = stage_categories(rec, stage)
        hits = sum(1 for c in cats.values() if c == "match")
        rows = len(rec.order)
        return f"One target forward scored all {rows} rows: {hits} node(s) equal the target's choice at their parent."
    if stage.kind == "accept":
        path = " ".join(say(tree.tokens[n]) for n in rec.accepted) or "none"
        return f"The longest path of matches from the root: {len(rec.accepted)} token(s) accepted ({path})."
    if stage.kind == "bonus":
        return f"The target's own choice after that path, {say(rec.bonus_token)}, comes free with the same forward."
    slots = cache_slots(rec)
    kept = sum(1 for s in slots if s["what"] == "node" and s["kept"])
    dropped = sum(1 for s in slots if s["what"] == "node" and not s["kept"])
    return (
        f"{len(rec.committed)} token(s) join the text; the cache keeps the accepted path's {kept} "
        f"slot(s) in place and drops {dropped}, recomputing nothing."
    )


def slot_figure(rec: IterationRecord, decode: Callable[[int], str] = str, *, height: int = 150):
    """The cache slots the iteration's target forward wrote, as a strip: the chain's (kept), then
    one per verified node, green where commit keeps it in place and grey where it is dropped."""
    import plotly.graph_objects as go

    slots = cache_slots(rec)
    colours = {"chain": "#1f77b4", True: "#2ca02c", False: "#c7c7c7"}
    fig = go.Figure()
    for name, key in (("committed chain (kept)", "chain"), ("accepted node (kept)", True), ("dropped", False)):
        chosen = [
            s for s in slots if (s["what"] == "chain") == (key == "chain") and (key == "chain" or s["kept"] == key)
        ]
        tokens = [rec.tree.tokens[s["node"]] if s["node"] is not None else None for s in chosen]
        fig.add_trace(
            go.Bar(
                x=[str(s["slot"]) for s in chosen],
                y=[1] * len(chosen),
                marker_color=colours[key],
                name=name,
                text=["" if t is None else visible(decode(t)) for t in tokens],
                hovertemplate="slot %{x}<extra>" + name + "</extra>",
            )
        )
    fig.update_layout(
        height=height,
        barmode="stack",
        bargap=0.05,
        margin=dict(l=10, r=10, t=30, b=10),
        yaxis=dict(visible=False),
        xaxis=dict(title="cache slot", type="category"),
        legend=dict(orientation="h", y=1.3),
    )
    return fig
