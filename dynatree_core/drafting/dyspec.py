"""DySpec (dyspec-dynamic-token-tree.md): greedy expansion by estimated acceptance (§4.1-4.2,
App. A.1) and the layer-by-layer construction with a threshold (§4.4, App. A.2)."""

from __future__ import annotations

import math

import torch

from dynatree_core.core.transfer import to_list
from dynatree_core.core.tree import DraftTree
from dynatree_core.drafting.admission import budget_gate
from dynatree_core.drafting.common import drafter_of, leaf_reason, safe_log, start_tree
from dynatree_core.drafting.device import admitted_levels, children
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest, SampledLevels
from dynatree_core.drafting.search import CUM, DEPTH, PARENT, RANK, TOKEN, Pool
from dynatree_core.drafting.tensor_tree import (
    ADMITTED,
    BUDGET,
    EXPANDED,
    LEAF_REASONS,
    OVER_BUDGET,
    PADDING,
    Level,
    TensorTree,
)


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
    exactly the node-by-node algorithm's. The heap is a mask over the iteration's tensor tree
    (`_Greedy`; tests/reference_drafting.py keeps the heap, node by node, that it is checked
    against). `dyspec_threshold` is the layer-by-layer variant (§4.4).
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
        m, draw = c["max_children"], None if request.draw == "top" else SampledLevels(request)
        code = LEAF_REASONS.index(leaf_reason(cap, c["depth"]))
        greedy = _Greedy(c["budget"], c["batch"], cap, code, draw is None, drafter.steps.device)
        grown, rows = TensorTree(request.root_token), (None, None, 0)  # the root's forward first
        while rows is not None:
            logp = drafter.expand_level(*rows) if rows[0] is None else drafter.expand_rows(*rows)  # ONE forward
            lp, tokens = draw(logp, m) if draw else logp.topk(min(m, logp.shape[-1]), dim=-1)
            grown.levels.append(greedy.add(lp.to(greedy.pool.table.device), tokens.to(greedy.pool.table.device)))
            rows = greedy.step()  # the draws taken until a forward is needed: its rows, None once done
        nodes = greedy.decide(grown.levels, left=m if draw is None else None)
        grown.view(tree, grown.read(None, drafter.steps, 0), drafter, draws=greedy.draws(draw, grown.levels))
        nodes = to_list(nodes)
        tree.notes = {"taken": [float(nodes[n]) for n in greedy.order]}  # node ids in the order they were taken
        return tree


class _Greedy:
    """DySpec's greedy expansion over every candidate drafted so far (search.Pool): which are taken
    (in `order`), and which were run. The heap of expandable draws is a mask (`_frontier`: each run
    node's lowest-ranked draw not taken, under a taken node or the root); a draw's value is its path
    probability (the sibling value telescopes to it: common.sibling_value), compared as its log, ties
    to the draw pushed first. Between forwards the draws are taken in value order: the heap's best is
    always the best draw not taken (a draw's value bounds its children's and its later siblings'), so
    the takes until a forward is needed are a prefix of one sorted list: through the first taken
    node that has not run and can grow (it must run before anything below its value is taken), and
    any draw of equal value after it."""

    def __init__(self, budget: int, batch: int, cap: int, at_cap: int, ranked: bool, device: torch.device):
        self.budget, self.batch, self.cap, self.at_cap, self.ranked = budget, batch, cap, at_cap, ranked
        self.pool = Pool(device)
        self.real = self.taken = torch.zeros(0, dtype=torch.bool, device=device)
        self.order: list[int] = []  # the candidates taken, in order

    def add(self, lp: torch.Tensor, tokens: torch.Tensor) -> Level:
        level = self.pool.add(lp, tokens)
        self.real = torch.cat([self.real, level.cum == level.cum])  # NaN: a sampled row drew fewer
        self.taken = torch.cat([self.taken, torch.zeros_like(level.tokens, dtype=torch.bool)])
        return level

    def _frontier(self) -> torch.Tensor:
        """The heap: draws not taken whose parent's node is taken (or the root) and whose previous
        sibling is taken (or that are first)."""
        table = self.pool.table
        under = self.pool.nodes_of_rows(self.taken)[table[:, PARENT].long()]
        before = torch.cat([self.taken.new_ones(1), self.taken[:-1]]) | (table[:, RANK] == 0)
        return self.real & ~self.taken & under & before

    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Take draws until a forward is needed (or the budget is spent, or nothing is left); returns
        that forward's rows (the taken nodes waiting for it, then the best draws of the heap that have
        not run and can grow, up to `batch`), None once the tree is final."""
        table, ran = self.pool.table, self.pool.row_of >= 0
        took = self._sorted_takes(ran) if self.ranked else self._heap_takes(ran)
        self.taken[took] = True
        self.order += to_list(took)  # one read a step
        pending = took[~ran[took] & (table[took, DEPTH] < self.cap)]  # taken, and must run to grow
        if len(self.order) >= self.budget or pending.shape[0] == 0:
            return None
        heap = self.pool.ranked(self._frontier())[: self.batch]
        ahead = heap[~ran[heap] & (table[heap, DEPTH] < self.cap)][: max(self.batch - pending.shape[0], 0)]
        return self.pool.run(torch.cat([pending, ahead]))

    def _sorted_takes(self, ran: torch.Tensor) -> torch.Tensor:
        """The takes where each row's draws are most probable first (top-k drafting): the heap's best is
        the best draw not taken, so the takes are a prefix of the draws not taken, most probable first:
        through the first that has not run and can grow, and those of equal value after it."""
        table = self.pool.table
        queue = self.pool.ranked(self.real & ~self.taken)
        waits = ~ran[queue] & (table[queue, DEPTH] < self.cap)
        cum = table[queue, CUM]
        if queue.shape[0]:
            n = torch.where(waits.any(), (cum >= cum[waits.int().argmax()]).sum(), queue.shape[0])
            queue = queue[: min(int(n), self.budget - len(self.order))]
        return queue

    def _heap_takes(self, ran: torch.Tensor) -> torch.Tensor:
        """The takes where a row's draws come in drawing order (sampled drafting), one at a time: the
        heap's best, until one that has not run and can grow is taken and the heap's best is worth
        less (App. A.1's loop)."""
        table, took, bound = self.pool.table, [], None
        while len(self.order) + len(took) < self.budget:
            heap = self.pool.ranked(self._frontier())[:1]
            if heap.shape[0] == 0:
                break
            cum, depth, node = to_list(torch.cat([table[heap, CUM], table[heap, DEPTH], heap.double()]))
            if bound is not None and cum < bound:
                break
            took.append(int(node))
            self.taken[heap] = True
            if not ran[int(node)] and depth < self.cap:
                bound = cum if bound is None else max(bound, cum)
        return torch.tensor(took, dtype=torch.long, device=table.device)

    def decide(self, levels: list[Level], left: int | None) -> torch.Tensor:
        """Every candidate's fate and leaf code, written on its level: the taken ones admitted (a leaf
        at the depth cap, or over the budget where it never ran); run ahead and never taken, pruned;
        the heap's best draws left out (`left` of them, None: all), pruned: reason budget. Returns each
        candidate's node in the view."""
        table, ran = self.pool.table, self.pool.row_of >= 0
        fate = torch.full_like(self.pool.row_of, PADDING)
        left_out = self.pool.ranked(self._frontier() & ~ran)
        fate[left_out[:left] if left is not None else left_out] = BUDGET
        fate[ran & ~self.taken] = BUDGET
        fate[self.taken] = ADMITTED
        leaf = torch.full_like(fate, OVER_BUDGET)
        leaf[table[:, DEPTH] >= self.cap] = self.at_cap
        leaf[ran] = EXPANDED
        return self.pool.write(levels, fate, leaf)

    def draws(self, draw: SampledLevels | None, levels: list[Level]) -> list:
        """Sampled drafting: each drafted row's (q, draws) for the tree's view (TensorTree.view), the
        rows whose node stays in the tree: its children listed in rank order, taken or not (each
        node's next draw is kept, pruned, so whether a draw is listed never depends on its own value:
        the without-replacement verifier stays lossless)."""
        if draw is None:
            return ()
        table = self.pool.table
        fate = torch.cat([lv.fate for lv in levels])
        c = fate.shape[0]
        values = to_list(torch.cat([fate.double(), table[:, PARENT], table[:, TOKEN], self.pool.row_of.double()]))
        fates, parents, tokens, rows = (values[i * c : (i + 1) * c] for i in range(4))
        listed: list[list[int]] = [[] for _ in draw.rows]
        for f, parent, token in zip(fates, parents, tokens, strict=True):
            if f != PADDING:
                listed[int(parent)].append(int(token))
        stays = [True] * len(draw.rows)  # a row run ahead and never taken is pruned: the view skips it
        for f, row in zip(fates, rows, strict=True):
            if row >= 0:
                stays[int(row)] = f != BUDGET
        return [(q16, listed[r]) for r, (q16, _drawn) in enumerate(draw.rows) if stays[r]]


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
