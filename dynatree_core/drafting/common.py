"""Helpers every tree policy shares: the drafter of a request, level admission under a threshold
and a node budget (with the pruning reasons), a new tree with its depth cap, leaf reasons, the
ranked children of a node and DySpec's sibling value. One module, imported by every policy."""

from __future__ import annotations

import math

import torch

from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.drafting.request import DraftRequest, level_q, level_top
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


def level_rows(request: DraftRequest, logp, m: int) -> list:
    """Per row of a draft forward, what `ranked_children` reads, copied to the host in one go:
    (probabilities, tokens) of the top m, or for sampled drafting (the adjusted distribution, m)."""
    if request.draw == "top":
        lp_rows, tok_rows = level_top(logp, m)
        return [([math.exp(lp) for lp in lps], toks) for lps, toks in zip(lp_rows, tok_rows, strict=True)]
    return [(q, m) for q in level_q(request, logp)]


def ranked_children(request: DraftRequest, tree: DraftTree, node: int, row) -> tuple[list[float], list[int]]:
    """(probabilities, tokens) of a node's candidate children in rank order, from its `level_rows`
    row: the draft's top m, or, for sampled drafting, m draws without replacement from the
    adjusted draft distribution (DySpec's sampled tree; the draw order is the rank)."""
    if request.draw == "top":
        return row
    q, m = row
    q = tree.record_draws(node, q).dense()  # the draws are listed once the tree is built (dyspec.py)
    toks = torch.multinomial(q, min(m, int((q > 0).sum())), replacement=False, generator=request.gen).tolist()
    return [float(q[t]) for t in toks], toks
