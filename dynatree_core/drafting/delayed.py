"""Delayed tree expansion (delayed-tree-expansion-and-verification-algorithms.md §5, Def. 5.2)
and a model-free prompt-lookup tree.

  delayed        a trunk of L1 draft tokens, then K branches of L2 tokens each. Greedy drafting
                 makes the paper's K i.i.d. branches identical, so the branches start from the
                 draft's top-K tokens at the trunk's end and continue with the top token. One
                 draft forward per level: L1 + L2 forwards.
  ngram          prompt lookup as a tree: the continuations that followed earlier occurrences of
                 the context's last n tokens, merged into a trie (no draft model).
"""

from __future__ import annotations

import math

from dynatree_core.drafting.base import DraftRequest, Param, Policy, register_policy
from dynatree_core.drafting.dynamic import _drafter, _leaf_reason
from dynatree_core.tree import DraftTree, Reason


def grow_delayed(request: DraftRequest, k: int, l1: int, l2: int) -> DraftTree:
    """The (K, L1, L2) delayed tree, greedy-drafted, cut at the request's max depth."""
    drafter = _drafter(request)
    tree = DraftTree.with_root(request.root_token)
    cap = min(l1 + l2, request.max_depth)
    reason = _leaf_reason(cap, l1 + l2)
    frontier = [0]
    for level in range(cap):
        logp = drafter.expand(tree, frontier)  # ONE draft forward per level
        width = k if level == l1 else 1  # the branch point is the trunk's last node
        top_lp, top_tok = logp.topk(width, dim=-1)
        new = []
        for row, node in enumerate(frontier):
            tree.mark_expanded(node)
            for lp, tok in zip(top_lp[row].tolist(), top_tok[row].tolist(), strict=True):
                new.append(tree.add(node, tok, lp, reason=reason))
        frontier = new
    if cap <= 0:
        tree.mark_leaf(0, reason)
    return tree


@register_policy
class Delayed(Policy):
    """Static delayed tree: trunk of L1 tokens, then K branches of L2 tokens (§5, Def. 5.2)."""

    name = "delayed"
    summary = "Delayed expansion: a trunk of L1 tokens, then K branches of L2 tokens"
    params = (
        Param("k", int, 2, 1, 8, "K: branches at the end of the trunk"),
        Param("l1", int, 2, 0, 16, "L1: trunk length before branching"),
        Param("l2", int, 3, 0, 16, "L2: length of each branch"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        c = self.config
        return grow_delayed(request, c["k"], c["l1"], c["l2"])


@register_policy
class NGramLookup(Policy):
    """Prompt lookup as a tree (model-free): for n from max_n down to min_n, find earlier
    occurrences of the context's last n tokens (most recent first) and collect the tokens that
    followed them, up to `branches` distinct continuations of `depth` tokens; merge them into a
    trie. A node's p is the share of its parent's continuations that pass through it."""

    name = "ngram"
    summary = "Prompt lookup tree: continuations of earlier matches of the last n tokens (no draft)"
    needs_draft_model = False
    params = (
        Param("max_n", int, 3, 1, 8, "Longest suffix to match"),
        Param("min_n", int, 1, 1, 8, "Shortest suffix to match"),
        Param("depth", int, 6, 1, 32, "Tokens per continuation"),
        Param("branches", int, 3, 1, 16, "Distinct continuations merged into the tree"),
        Param("budget", int, 32, 1, 256, "Node budget"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        c = self.config
        tree = DraftTree.with_root(request.root_token)
        depth = min(c["depth"], request.max_depth)
        conts = self.continuations(request.context, depth) if depth > 0 else []
        if not conts:
            tree.mark_leaf(0, "no_match" if depth > 0 else Reason.LENGTH_LIMIT)
            return tree
        counts: dict[tuple[int, ...], int] = {}
        for cont in conts:
            for i in range(1, len(cont) + 1):
                counts[cont[:i]] = counts.get(cont[:i], 0) + 1
        node_of: dict[tuple[int, ...], int] = {(): 0}
        for path in sorted(counts, key=lambda p: (len(p), -counts[p])):  # parents first, then by support
            if len(node_of) > c["budget"]:
                break
            parent = node_of[path[:-1]]
            tree.mark_expanded(parent)
            share = counts[path] / (counts[path[:-1]] if path[:-1] else len(conts))
            node_of[path] = tree.add(parent, path[-1], math.log(share), reason=Reason.DEPTH_LIMIT)
        for path, node in node_of.items():
            if not node or any(len(q) == len(path) + 1 and q[:-1] == path for q in node_of):
                continue  # the root, or an inner node
            if len(path) >= depth:
                why = _leaf_reason(depth, c["depth"])
            elif any(len(q) == len(path) + 1 and q[:-1] == path for q in counts):
                why = Reason.BUDGET
            else:
                why = "context_end"  # the continuation reached the end of the context
            tree.mark_leaf(node, why)
        return tree

    def continuations(self, context: list[int], depth: int) -> list[tuple[int, ...]]:
        """Distinct continuations after earlier matches of the context's suffix, best n first."""
        c, found = self.config, []
        for n in range(min(c["max_n"], len(context) - 1), c["min_n"] - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # most recent match first
                if context[start : start + n] == suffix:
                    cont = tuple(context[start + n : start + n + depth])
                    if cont and cont not in found:
                        found.append(cont)
                        if len(found) >= c["branches"]:
                            return found
        return found
