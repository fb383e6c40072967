"""Token Recycling (Luo et al., "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling", ACL 2025): a draft tree that costs no draft forward.

Every verify forward already computes, at every row it verifies (accepted or not), the target's
distribution of the token that follows that row's token. Token Recycling keeps the top `k` of it
in an adjacency matrix (token -> its `k` most likely successors; the latest forward that saw the
token wins) and builds the next tree by a breadth-first walk of the matrix from the root over a
static tree template: a node's children are the first successors its token has in the matrix, as
many as the template's width at their depth (`branch` at depth 1, halved each level, at least 1),
up to the node budget. A token the matrix has not seen yet has no successors: its node is a leaf.
The tree is verified like any other, so greedy output is the target's, token for token.

The matrix here is filled from the verify forwards only: the prefill's forward keeps its last
row (the root's), so the first trees are small and grow as the run's forwards fill it.
"""

from __future__ import annotations

import torch

from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.drafting.common import leaf_reason
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest


@register_policy
class TokenRecycling(Policy):
    """Token Recycling: the target's own top-k successors from earlier forwards, walked as a tree."""

    name = "recycle"
    summary = "Token Recycling: the target's own top-k successors from earlier forwards, walked as a tree (no draft)"
    needs_draft_model = False
    reads_target = True  # the engine hands it every verified row's logits (observe_target)
    params = (
        Param("k", int, 8, 1, 32, "Successors kept per token (the adjacency matrix's columns)"),
        Param("depth", int, 6, 1, 16, "Tree depth (the template's levels)"),
        Param("branch", int, 4, 1, 16, "Children of the root; halved each level below, at least 1"),
        Param("budget", int, 32, 1, 256, "Node budget"),
    )

    def __init__(self, **values):
        super().__init__(**values)
        self.successors: dict[int, tuple[list[int], list[float]]] = {}  # token -> (ids, log-probs), most likely first

    def reset(self) -> None:
        self.successors = {}

    def observe_target(self, tokens: list[int], logits: torch.Tensor) -> None:
        """Refresh the matrix from one verify forward: `logits[i]` is the target's distribution of
        the token after `tokens[i]` (every verified row, accepted or not)."""
        lp, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(self.config["k"], logits.shape[-1]), dim=-1)
        for token, row_ids, row_lp in zip(tokens, ids.tolist(), lp.tolist(), strict=True):
            self.successors[token] = (row_ids, row_lp)

    def width(self, level: int) -> int:
        """The template's children a node has at `level` (1: the root's children)."""
        return max(1, self.config["branch"] >> (level - 1))

    def draft(self, request: DraftRequest) -> DraftTree:
        c = self.config
        tree = DraftTree.with_root(request.root_token)
        depth = min(c["depth"], request.max_depth)
        if depth <= 0:
            tree.mark_leaf(0, Reason.LENGTH_LIMIT)
            return tree
        frontier, drafted = [0], 0
        for level in range(1, depth + 1):
            grown = []
            for node in frontier:
                known = self.successors.get(tree.tokens[node])
                if known is None:
                    tree.mark_leaf(node, "no_successors")  # a token no forward has verified yet
                    continue
                if drafted >= c["budget"]:
                    tree.mark_leaf(node, Reason.BUDGET)
                    continue
                tree.mark_expanded(node)
                for token, lp in list(zip(*known, strict=True))[: min(self.width(level), c["budget"] - drafted)]:
                    grown.append(tree.add(node, token, lp))
                    drafted += 1
            frontier = grown
        for node in frontier:  # the template's last level
            tree.mark_leaf(node, leaf_reason(depth, c["depth"]))
        return tree
