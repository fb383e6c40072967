"""Greedy verification (DynaTree §3.5, Alg. 1 SELECTCOMMIT).

Walk down from the root: at each node take the target's argmax; if a verified child carries
that token, accept it and continue from it; otherwise stop. The target's argmax at the last
accepted node (or at the root) is the bonus token. Every committed token therefore equals what
target-only greedy decoding would produce, whatever the draft proposed.
"""

from __future__ import annotations

import dataclasses

import torch

from dynatree_core.core.transfer import to_list
from dynatree_core.core.tree import DraftTree


@dataclasses.dataclass
class Outcome:
    """The result of verifying one tree."""

    accepted: list[int]  # accepted node ids, root excluded, root-to-leaf order
    bonus_token: int  # the target's own token after the last accepted node
    target_tokens: list[int]  # the target's choice at each verified node, aligned with `order`
    order: list[int]  # verified node ids in the order they were sent to the target
    trace: list[dict] = dataclasses.field(default_factory=list)  # what the verifier did, step by step


def verified_children(tree: DraftTree, order: list[int]) -> dict[int, dict[int, int]]:
    """parent -> {token: child} over the verified nodes."""
    children: dict[int, dict[int, int]] = {}
    for node in order[1:]:
        children.setdefault(tree.parents[node], {})[tree.tokens[node]] = node
    return children


def verify_greedy(tree: DraftTree, order: list[int], logits: torch.Tensor) -> Outcome:
    """Args: order: verified node ids (root first); logits: (len(order), vocab) target logits.

    Returns the longest path whose every token is the target's argmax at its parent, plus the
    bonus token.
    """
    target_tokens = to_list(logits.argmax(dim=-1))  # the iteration's one read of the target's choices
    row = {node: i for i, node in enumerate(order)}
    children = verified_children(tree, order)
    accepted, node, trace = [], 0, []
    while True:
        nxt = children.get(node, {}).get(target_tokens[row[node]])
        trace.append({"kind": "argmax", "node": node, "token": target_tokens[row[node]], "child": nxt})
        if nxt is None:
            break
        accepted.append(nxt)
        node = nxt
    return Outcome(
        accepted=accepted, bonus_token=target_tokens[row[node]], target_tokens=target_tokens, order=order, trace=trace
    )
