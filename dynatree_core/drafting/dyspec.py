"""DySpec (dyspec-dynamic-token-tree.md): greedy expansion by estimated acceptance (§4.1-4.2,
App. A.1) and the layer-by-layer construction with a threshold (§4.4, App. A.2)."""

from __future__ import annotations

import heapq
import math

import torch

from dynatree_core.core.tree import DraftTree, Reason, Status
from dynatree_core.drafting.admission import budget_gate
from dynatree_core.drafting.common import (
    NEG_INF,
    drafter_of,
    leaf_reason,
    level_rows,
    ranked_children,
    safe_log,
    sibling_value,
    start_tree,
)
from dynatree_core.drafting.device import admitted_levels, children
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest


@register_policy
class DySpec(Policy):
    """DySpec greedy expansion: a heap of expandable draws ordered by estimated value (§4.2).

    Each step adds the draw with the highest estimated acceptance (`sibling_value`); adding the
    rank-i child of u makes two new draws expandable: u's rank-(i+1) child and the new node's
    first child (App. A.1). The paper's algorithm runs the draft once per added node. We batch
    what the algorithm allows without changing its result: a node's value bounds its children's,
    so the best known draw is taken while it beats every unexpanded node; when a forward is
    needed, it also runs the best waiting draws ahead of their turn (up to `batch` nodes per
    forward). Draws run ahead but never taken are pruned (reason budget), so the verified tree is
    exactly the node-by-node algorithm's. `dyspec_threshold` is the layer-by-layer variant (§4.4).
    """

    name = "dyspec"
    draws = ("top", "without_replacement")  # sampled: each node's children are draws without replacement
    summary = "DySpec: greedy heap expansion by estimated acceptance, up to a node budget"
    params = (
        # budget 3: the measured best on the OOD tuning prompts with the shipped draft on CPU
        # (benchmarks/ood_defaults.py, then budgets 2-8; BENCHMARKS, "Defaults fitted on OOD prompts")
        Param("budget", int, 3, 1, 256, "Drafted nodes in the tree (the speculative budget)"),
        Param("depth", int, 12, 1, 32, "Depth cap"),
        Param("max_children", int, 8, 1, 64, "Children looked at per node (top of the draft distribution)"),
        Param("batch", int, 8, 1, 64, "Nodes per draft forward: the node needed now plus the best draws, run ahead"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        drafter, c = drafter_of(request), self.config
        tree, cap = start_tree(request, c["depth"])
        if cap <= 0:
            return tree
        value = {0: 1.0}
        children: dict[int, tuple[list[float], list[int]]] = {}  # expanded node -> (probs, tokens)
        heap: list[tuple[float, int, int]] = []  # (-value, parent, rank): draws that may be taken next
        ahead: dict[tuple[int, int], int] = {}  # (parent, rank) -> node run through the draft early
        pending = [0]  # taken, expandable, not yet run through the draft
        row_of, level = {0: 0}, 0  # node -> its row, counted over the iteration's forwards; forwards after the root's
        taken = 0
        order: list[float] = []
        tree.notes = {"taken": order}  # node ids in the order the heap gave them

        def take_children(node: int) -> None:
            heapq.heappush(heap, (-sibling_value(value[node], children[node][0], 0), node, 0))

        while taken < c["budget"]:
            bound = max((value[n] for n in pending), default=NEG_INF)
            if pending and (not heap or -heap[0][0] < bound):  # a pending node's child may be next
                run = list(pending)
                for _neg, parent, rank in heapq.nsmallest(c["batch"], heap):
                    if len(run) >= c["batch"]:
                        break
                    if (parent, rank) not in ahead and tree.depths[parent] + 1 < cap:
                        probs, toks = children[parent]
                        ahead[(parent, rank)] = tree.add(parent, toks[rank], math.log(probs[rank]))
                        run.append(ahead[(parent, rank)])
                level += run != [0]
                logp = _forward(drafter, tree, run, row_of, level)  # ONE forward: needed nodes + draws run ahead
                rows = level_rows(request, logp, c["max_children"])  # one copy for the forward's rows
                for row, node in enumerate(run):
                    tree.mark_expanded(node)
                    children[node] = ranked_children(request, tree, node, rows[row])
                for node in pending:
                    take_children(node)
                pending = []
                continue
            if not heap:
                break
            neg, parent, rank = heapq.heappop(heap)
            probs, toks = children[parent]
            node = ahead.pop((parent, rank), None)
            if node is None:
                node = tree.add(parent, toks[rank], math.log(probs[rank]))
            value[node], taken = -neg, taken + 1
            order.append(float(node))
            if rank + 1 < len(probs):
                heapq.heappush(heap, (-sibling_value(value[parent], probs, rank + 1), parent, rank + 1))
            if tree.depths[node] >= cap:
                tree.mark_leaf(node, leaf_reason(cap, c["depth"]))
            elif node in children:  # already run ahead: its first child is known
                take_children(node)
            else:
                pending.append(node)
        for node in pending:
            tree.mark_leaf(node, Reason.BUDGET)
        for node in ahead.values():  # run ahead, never taken
            tree.prune(node, Reason.BUDGET)
        left = [(n, p, r) for n, p, r in sorted(heap) if (p, r) not in ahead]
        if request.draw == "top":
            left = left[: c["max_children"]]
        for _neg, parent, rank in left:  # the best draws left out
            probs, toks = children[parent]
            tree.add(parent, toks[rank], math.log(probs[rank]), status=Status.PRUNED, reason=Reason.BUDGET)
        if request.draw != "top":
            # each node's draws are its children in rank (= drawing) order: the taken ones and the
            # next draw, always kept (pruned) so that whether a draw is listed never depends on
            # its own value, which keeps the without-replacement verifier lossless
            for child in range(1, len(tree)):  # node ids grow in rank order under each parent
                tree.sampled[tree.parents[child]].tokens.append(tree.tokens[child])
        return tree


def _forward(drafter, tree: DraftTree, run: list[int], row_of: dict[int, int], level: int) -> torch.Tensor:
    """The draft's log-probabilities after each node of `run` in ONE forward: the root's alone, or
    nodes of any depths whose parents ran earlier (Drafter.expand_rows), each bound to its row as
    the `level`-th forward after the root's."""
    if run == [0]:
        return drafter.expand_level(None, None, 0)
    device = drafter.steps.device
    fields = [[tree.tokens[n] for n in run], [row_of[tree.parents[n]] for n in run], [tree.depths[n] for n in run]]
    logp = drafter.expand_rows(*(torch.tensor(f, device=device) for f in fields))
    for row, node in enumerate(run):
        row_of[node] = len(row_of)
        drafter.bind(node, level, row)
    return logp


@register_policy
class DySpecThreshold(Policy):
    """DySpec with a threshold (§4.4, App. A.2): level by level, keep every draw whose estimated
    value (`sibling_value`, the path product under greedy drafting) is at least `threshold`, up
    to the node budget. One draft forward per level. Under greedy drafting this equals threshold
    pruning on the cumulative probability with unbounded branching (up to max_children)."""

    name = "dyspec_threshold"
    summary = "DySpec layer by layer: every draw with estimated value >= threshold"
    params = (
        # threshold 0.05, budget 12: the measured best on the OOD tuning prompts with the shipped draft on CPU
        # (benchmarks/ood_defaults.py; BENCHMARKS, "Defaults fitted on OOD prompts")
        Param("threshold", float, 0.05, 0.0, 1.0, "Keep draws whose estimated acceptance >= threshold", log_scale=True),
        Param("budget", int, 12, 1, 256, "Node budget: most drafted nodes sent to the target"),
        Param("depth", int, 12, 1, 32, "Depth cap"),
        Param("max_children", int, 8, 1, 64, "Children looked at per node"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        c = self.config
        tree, cap = start_tree(request, c["depth"])
        if cap <= 0:
            return tree
        # what _propose reads is in the key; budget_gate: the leaves at the cap and past the budget
        return admitted_levels(
            request,
            tree,
            cap,
            log_tau=safe_log(c["threshold"]),
            k=c["max_children"],
            propose=self._propose,
            gate=budget_gate(cap, c["depth"], c["budget"]),
            key_of=("dyspec_threshold", c["max_children"], c["threshold"], cap, c["depth"]),
        )

    def _propose(self, level: int, top, cum):
        """A level's candidates (device.admitted_levels): each row's draws in rank order up to and
        including the first below the threshold (values fall with rank: the rest are lower still,
        and not real: NaN). The rank-th draw's value (sibling_value, App. A.1) telescopes under
        greedy drafting to the parent's value times the draw's probability: log v = cum + lp, the
        candidate's `cum`."""
        k = self.config["max_children"]
        tokens, lp, cum_c = children(top, cum, k)
        below = cum_c.view(cum.shape[0], -1) < safe_log(self.config["threshold"])
        after_below = torch.cat([torch.zeros_like(below[:, :1]), below[:, :-1]], dim=1)  # the draw before it is below
        return tokens, lp, torch.where(after_below.flatten(), math.nan, cum_c)
