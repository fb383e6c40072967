"""SALF: optimal tree search with stopping at low further gains (salf-talf-tree-loss-and-stopping.md,
Algorithm 2; th=0 is the SpecExec-style optimal search)."""

from __future__ import annotations

import heapq
import math

from dynatree_core.core.tree import DraftTree, Reason, Status
from dynatree_core.drafting.common import NEG_INF, drafter_of
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest, level_top


# ----- SALF --------------------------------------------------------------------------------------
@register_policy
class Salf(Policy):
    """Optimal tree search with stopping at low further gains (SALF paper, Algorithm 2).

    G (the tree) keeps the N most probable nodes found so far (root included); Q keeps the N
    most probable candidate children not yet in G. Each step pops B candidates from Q into G
    (lines 5-9), ignores those that cannot stay in G (pr <= epsilon, lines 10-12), stops when
    the batch's probability mass is below th (line 13; th = 0 never stops early: the
    SpecExec-style optimal search), and expands the batch in ONE draft forward (lines 14-20).
    The mass of every step is recorded in `tree.notes["salf_mass"]` (it decreases: Theorem 1).
    """

    name = "salf"
    summary = "SALF: capacity-N optimal tree search, B nodes per forward, stop when mass < th"
    params = (
        # N 6, B 4, th 0.8: the measured best on the OOD tuning prompts with the shipped draft on CPU
        # (benchmarks/ood_defaults.py; BENCHMARKS, "Defaults fitted on OOD prompts")
        Param("nodes", int, 6, 2, 256, "N: tree nodes kept, root included"),
        Param("batch", int, 4, 1, 64, "B: nodes expanded per draft forward"),
        Param("th", float, 0.8, 0.0, 0.999, "SALF threshold: stop when the batch's probability mass is below it"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        drafter, c = drafter_of(request), self.config
        n_max, batch, th = c["nodes"], c["batch"], c["th"]
        tree = DraftTree.with_root(request.root_token)
        masses: list[float] = []
        tree.notes = {"salf_mass": masses}
        cap = request.max_depth
        g = {0: 0.0}  # node -> log pr: the output tree
        queue: list[tuple[float, int, int, int, float]] = []  # (-log pr, seq, parent, token, logp)
        seq, why, stop = 0, {}, Reason.BUDGET
        batch_nodes = [0]
        while True:
            eps = min(g.values()) if len(g) >= n_max else NEG_INF  # lines 10-11
            batch_nodes = [n for n in batch_nodes if n in g and g[n] > eps]  # line 12
            mass = sum(math.exp(g[n]) for n in batch_nodes)
            masses.append(mass)
            if not batch_nodes:  # nothing popped can stay in G: the tree is final
                break
            if mass < th:  # line 13: SALF
                stop = Reason.SALF_STOP
                for node in batch_nodes:
                    why[node] = Reason.SALF_STOP
                break
            expand = [n for n in batch_nodes if tree.depths[n] < cap]
            for node in batch_nodes:
                if tree.depths[node] >= cap:
                    why[node] = Reason.LENGTH_LIMIT
            if expand:
                logp = drafter.expand(tree, expand)  # ONE forward for the batch (lines 14-20)
                lp_rows, tok_rows = level_top(logp, n_max)
                for row, node in enumerate(expand):
                    tree.mark_expanded(node)
                    for lp, tok in zip(lp_rows[row], tok_rows[row], strict=True):
                        heapq.heappush(queue, (-(g[node] + lp), seq, node, tok, lp))
                        seq += 1
                queue = heapq.nsmallest(n_max, queue)  # capacity N: drop the least probable
                heapq.heapify(queue)
            batch_nodes = []
            while queue and len(batch_nodes) < batch:  # lines 5-9
                neg, _, parent, tok, lp = heapq.heappop(queue)
                if tree.status[parent] == Status.PRUNED:  # its parent left G: it cannot enter
                    continue
                node = tree.add(parent, tok, lp)
                g[node] = -neg
                batch_nodes.append(node)
                while len(g) > n_max:  # G keeps N nodes: drop the least probable, latest first
                    victim = min((n for n in g if n), key=lambda n: (g[n], -n))
                    tree.prune(victim, Reason.BUDGET)
                    del g[victim]
            if not batch_nodes:
                break
        for node in g:
            if node and tree.status[node] == Status.NOT_EXPANDED:
                tree.mark_leaf(node, why.get(node, Reason.BUDGET))
        if tree.status[0] == Status.NOT_EXPANDED:
            tree.mark_leaf(0, why.get(0, Reason.LENGTH_LIMIT))
        eps = min(g.values()) if len(g) >= n_max else NEG_INF
        for neg, _, parent, tok, lp in sorted(queue):  # candidates that would have fitted
            if -neg > eps and tree.status[parent] != Status.PRUNED:
                tree.add(parent, tok, lp, status=Status.PRUNED, reason=stop)
        return tree
