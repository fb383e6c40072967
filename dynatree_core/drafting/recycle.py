"""Token Recycling (Luo et al., "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling", ACL 2025): a draft tree that costs no draft forward.

Every verify forward already computes, at every row it verifies (accepted or not), the target's
distribution of the token that follows that row's token. Token Recycling keeps the top `k` of it
in an adjacency matrix (token -> its `k` most likely successors; the latest forward that saw the
token wins) and builds the next tree from the root by a walk of the matrix. Two walks:
- the paper's (`ranked` off): breadth first over a static tree template: a node's children are
  the first successors its token has in the matrix, as many as the template's width at their
  depth (`branch` at depth 1, halved each level, at least 1), up to the node budget;
- best first (`ranked`, the default): the `budget` nodes of highest path probability under the
  recycled log-probs, within `depth` levels (Recycler.ranked): the tree a template approximates
  offline, chosen per iteration from the matrix's own probabilities (on the OOD tuning prompts,
  1.90 tokens an iteration at 10 nodes against the template's 1.74; BENCHMARKS).
A token the matrix has not seen yet has no successors: its node is a leaf. The tree is verified
like any other, so greedy output is the target's, token for token.

The matrix is filled from every row the target reads: the prefill's (the whole prompt) and each
verify forward's. The matrix and the walk are drafting/sources.Recycler (shared with joined trees):
tensors on the models' device (vocab x k), refreshed where the logits are, the walk a few ops a
template level, and the tree read to the host once.
"""

from __future__ import annotations

import torch

from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.drafting.common import leaf_reason
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest
from dynatree_core.drafting.sources import Recycler


@register_policy
class TokenRecycling(Policy):
    """Token Recycling: the target's own top-k successors from earlier forwards, walked as a tree."""

    name = "recycle"
    family = "recycled"
    summary = "Token Recycling: the target's own top-k successors from earlier forwards, walked as a tree (no draft)"
    needs_draft_model = False
    reads_target = True  # the engine hands it every verified row's logits (observe_target)
    params = (
        # ranked, depth 6, budget 10: the measured best on the OOD tuning prompts on CPU, where a
        # wider tree's verify forward costs more than its extra tokens (benchmarks/ood_defaults.py;
        # BENCHMARKS, "Candidates that cost no draft forward")
        Param("k", int, 8, 1, 32, "Successors kept per token (the adjacency matrix's columns)"),
        Param("depth", int, 6, 1, 16, "Tree depth (levels)"),
        Param("branch", int, 2, 1, 16, "Template: children of the root; halved each level below, at least 1"),
        Param("budget", int, 10, 1, 256, "Node budget"),
        Param("ranked", bool, True, help="Best first by the recycled log-probs (off: the paper's static template)"),
    )

    def __init__(self, **values):
        super().__init__(**values)
        self.matrix = Recycler(self.config["k"])

    def reset(self) -> None:
        self.matrix = Recycler(self.config["k"])

    def observe_target(self, tokens: list[int], logits: torch.Tensor) -> None:
        """Refresh the matrix from one forward: `logits[i]` is the target's distribution of the
        token after `tokens[i]` (every row it read: the prefill's, then each tree's, accepted or not)."""
        self.matrix.observe(tokens, logits)

    def widths(self, depth: int) -> list[int]:
        """The template's children a node has at each level (1: the root's children)."""
        return [max(1, self.config["branch"] >> level) for level in range(depth)]

    def draft(self, request: DraftRequest) -> DraftTree:
        c = self.config
        depth = min(c["depth"], request.max_depth)
        if depth <= 0:
            tree = DraftTree.with_root(request.root_token)
            tree.mark_leaf(0, Reason.LENGTH_LIMIT)
            return tree
        if c["ranked"]:
            tree = self.matrix.ranked(request.root_token, depth, c["budget"])
        else:
            tree = self.matrix.walk(request.root_token, self.widths(depth), c["budget"])
        for node in range(len(tree)):  # the template's last level
            if tree.depths[node] == depth:
                tree.mark_leaf(node, leaf_reason(depth, c["depth"]))
        return tree
