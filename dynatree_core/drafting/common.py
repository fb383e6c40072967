"""Helpers every tree policy shares: the drafter of a request, a new tree with its depth cap, leaf
reasons and DySpec's sibling value. One module, imported by every policy."""

from __future__ import annotations

import math

from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.drafting.request import DraftRequest
from dynatree_core.drafts.session import Drafter
from dynatree_core.errors import DynaTreeError

NEG_INF = -math.inf


def drafter_of(request: DraftRequest) -> Drafter:
    if request.drafter is None:
        raise DynaTreeError("this policy needs a draft model")
    return request.drafter


def safe_log(x: float) -> float:
    return math.log(x) if x > 0 else NEG_INF


def start_tree(request: DraftRequest, depth: int) -> tuple[DraftTree, int]:
    """A new tree and its depth cap; with no room at all the root is already a leaf."""
    tree = DraftTree.with_root(request.root_token)
    cap = min(depth, request.max_depth)
    if cap <= 0:
        tree.mark_leaf(0, Reason.LENGTH_LIMIT)
    return tree, cap


def leaf_reason(depth_cap: int, policy_depth: int) -> Reason:
    return Reason.DEPTH_LIMIT if depth_cap == policy_depth else Reason.LENGTH_LIMIT


# ----- DySpec ------------------------------------------------------------------------------------
def sibling_value(parent_value: float, probs: list[float], rank: int) -> float:
    """DySpec's estimated acceptance of the rank-th draw at a node (App. A.1): the parent's value,
    times the probability that the earlier draws there were all rejected, times the acceptance
    estimate of this draw under the residual distribution (Hypothesis 1: acceptance ~ draft p).
    With the residual r_i = q_i / (1 - sum_{j<i} q_j) the product telescopes to parent * q_i."""
    rejected, mass_left = 1.0, 1.0
    for j in range(rank):
        r_j = probs[j] / mass_left if mass_left > 0 else 0.0
        rejected *= 1.0 - r_j
        mass_left -= probs[j]
    r_i = probs[rank] / mass_left if mass_left > 0 else 0.0
    return parent_value * rejected * r_i
