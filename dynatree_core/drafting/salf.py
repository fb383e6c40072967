"""SALF: optimal tree search with stopping at low further gains (salf-talf-tree-loss-and-stopping.md,
Algorithm 2; th=0 is the SpecExec-style optimal search), as tensors: the candidates of every draft
forward (one `Level` each of the iteration's `TensorTree`), Q and G masks over them, the view made once."""

from __future__ import annotations

import math

import torch

from dynatree_core.core.transfer import to_list
from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.drafting.common import drafter_of
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest
from dynatree_core.drafting.tensor_tree import (
    ADMITTED,
    AT_LENGTH,
    BUDGET,
    EXPANDED,
    OVER_BUDGET,
    PADDING,
    SALF_STOPPED,
    STOPPED,
    Level,
    TensorTree,
)


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
        tree = DraftTree.with_root(request.root_token)
        search = _Search(c["nodes"], c["batch"], c["th"], request.max_depth)
        tree.notes = {"salf_mass": search.masses}
        if search.cap <= 0:
            tree.mark_leaf(0, Reason.LENGTH_LIMIT)
            return tree
        logp = drafter.expand_level(None, None, 0)  # the root's forward
        grown = TensorTree(request.root_token)
        while True:
            rows = search.add(logp)
            grown.levels.append(rows)
            expand = search.step()
            if expand is None:
                break
            logp = drafter.expand_rows(*search.rows(expand))  # ONE forward for the batch (lines 14-20)
        search.decide(grown.levels)
        grown.view(tree, grown.read(None, drafter.steps, 0), drafter)
        return tree


class _Search:
    """Algorithm 2's state over every candidate drafted so far (the pool, in the order the forwards
    proposed them: a candidate's index is its push order, Q's tie-break): each one's token, float32
    draft log-probability, float64 path log-probability, parent row and depth, and masks: in Q,
    popped, the row it became. G's nodes are kept in the order they were popped (its tie-break: of
    equal probabilities the latest leaves first). The root is row 0, always in G."""

    def __init__(self, nodes: int, batch: int, th: float, max_depth: int):
        self.n, self.b, self.th, self.cap = nodes, batch, th, max_depth
        self.masses = [1.0]  # the root's step: D = {root}, whose mass is 1
        self.fields: list[torch.Tensor] = []  # tokens, logp, cum, parent row, depth: one entry a candidate
        self.in_q = self.popped = self.row_of = self.g = None  # g: G's nodes but the root, in popped order
        self.rows_cum: torch.Tensor | None = None  # each drafted row's cum and depth, the root's first
        self.rows_depth: torch.Tensor | None = None
        self.batches: list[torch.Tensor] = []  # the candidates each forward after the root's ran, in row order
        self.stop, self.leaves = Reason.BUDGET, {}  # why the search ended; candidate -> leaf code of D left unexpanded

    def add(self, logp: torch.Tensor) -> Level:
        """The last forward's rows' children (each row's N most probable: what Q could keep of them)
        joined to the pool and to Q (line 20), Q cut to its capacity N; the forward's `Level`."""
        lp, tokens = logp.topk(min(self.n, logp.shape[-1]), dim=-1)
        lp = lp.float()  # what a level records (Level.logp), and what pr is made of
        (p, k), device = lp.shape, lp.device
        if self.rows_cum is None:  # the root's forward
            self.rows_cum = torch.zeros(1, dtype=torch.float64, device=device)
            self.rows_depth = torch.zeros(1, dtype=torch.long, device=device)
            self.g = self.rows_depth[:0]
        first = self.rows_cum.shape[0] - p  # the forward's first row
        cum = (self.rows_cum[first:, None] + lp.double()).flatten()  # a child's pr: its parent's times its p
        own = torch.arange(p, device=device).repeat_interleave(k)
        fields = [tokens.flatten(), lp.flatten().float(), cum, own + first, self.rows_depth[first:][own] + 1]
        self.fields = [torch.cat(pair) for pair in zip(self.fields, fields, strict=True)] if self.fields else fields
        fresh = torch.ones(p * k, dtype=torch.bool, device=device)
        self.in_q = fresh if self.in_q is None else torch.cat([self.in_q, fresh])
        self.popped = ~fresh if self.popped is None else torch.cat([self.popped, ~fresh])
        unrun = torch.full_like(own, -1)
        self.row_of = unrun if self.row_of is None else torch.cat([self.row_of, unrun])
        self.in_q[self._ranked(self.in_q)[self.n :]] = False  # capacity N: the least probable leave Q for good
        return Level(fields[0], fields[1], own, fate=None, leaf=None, selected=None, cum=cum, reach=True)

    def _ranked(self, mask: torch.Tensor) -> torch.Tensor:
        """The candidates in `mask`, most probable first, ties in push order (a stable sort)."""
        index = mask.nonzero()[:, 0]
        return index[torch.sort(self.fields[2][index], descending=True, stable=True).indices]

    def step(self) -> torch.Tensor | None:
        """Pop up to B candidates from Q into G (lines 5-9: a candidate whose parent left G cannot
        enter it and is passed over), cut G to N nodes (the least probable leave it, latest first),
        keep of the batch the nodes that stay in G (lines 10-12), record its mass and stop below th
        (line 13). Returns the batch's candidates to expand (those at the depth cap are leaves), None
        once the tree is final; a batch wholly at the cap pops again with no forward."""
        cum = self.fields[2]
        while True:
            queue = self._ranked(self.in_q)
            alive = self._alive()[self.fields[3][queue]]
            taken = alive & (alive.cumsum(0) <= self.b)
            batch = queue[taken]
            self.in_q[queue[: _through_last(taken)]] = False  # popped, or passed over on the way
            if batch.shape[0] == 0:
                return None
            self.popped[batch] = True
            g = torch.cat([self.g, batch])
            kept = torch.sort(cum[g], descending=True, stable=True).indices[: self.n - 1]
            self.g = g[kept.sort().values]  # G keeps N nodes, the root included, in popped order
            d = batch[torch.isin(batch, self.g) & (cum[batch] > self._eps())]
            values = to_list(torch.cat([cum[d], d.double(), self.fields[4][d].double()]))  # one read a step
            m = d.shape[0]
            mass = sum(math.exp(v) for v in values[:m])
            self.masses.append(mass)
            nodes, depths = [int(v) for v in values[m : 2 * m]], values[2 * m :]
            if not nodes:
                return None
            if mass < self.th:
                self.stop = Reason.SALF_STOP
                self.leaves.update(dict.fromkeys(nodes, SALF_STOPPED))
                return None
            deeper = [depth < self.cap for depth in depths]
            self.leaves.update({n: AT_LENGTH for n, ok in zip(nodes, deeper, strict=True) if not ok})
            if any(deeper):
                return d[torch.tensor(deeper, device=d.device)]

    def _alive(self) -> torch.Tensor:
        """Per drafted row, whether its node is in G (the root's always is)."""
        alive = torch.zeros_like(self.rows_cum, dtype=torch.bool)
        alive[0] = True
        rows = self.row_of[self.g]
        alive[rows[rows >= 0]] = True
        return alive

    def _eps(self) -> float | torch.Tensor:
        """Lines 10-11: the least probability in G once it holds N nodes, else -inf."""
        return self.fields[2][self.g].min() if self.g.shape[0] + 1 >= self.n else -math.inf

    def rows(self, expand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next forward's rows (Drafter.expand_rows): the batch's tokens, parent rows and depths;
        they are numbered after every row so far."""
        first = self.rows_cum.shape[0]
        self.row_of[expand] = torch.arange(first, first + expand.shape[0], device=expand.device)
        self.rows_cum = torch.cat([self.rows_cum, self.fields[2][expand]])
        self.rows_depth = torch.cat([self.rows_depth, self.fields[4][expand]])
        self.batches.append(expand)
        return self.fields[0][expand], self.fields[3][expand], self.fields[4][expand]

    def decide(self, levels: list[Level]) -> None:
        """Every candidate's fate, written on its level: G's nodes admitted (leaves unless a forward
        ran them: SALF's stop, the depth cap, else the budget); popped and out of G: pruned (budget);
        left in Q, probable enough to fit and under a node of G: pruned with the search's stop
        reason; the rest are no nodes. Each level's next rows: the candidates the next forward ran."""
        cum = self.fields[2]
        in_g = torch.zeros_like(self.in_q)
        in_g[self.g] = True
        ran = self.row_of >= 0
        fits = self.in_q & (cum > self._eps()) & self._alive()[self.fields[3]]
        fate = torch.full_like(self.row_of, PADDING)
        fate[fits] = STOPPED if self.stop == Reason.SALF_STOP else BUDGET
        fate[self.popped] = BUDGET
        fate[in_g] = ADMITTED
        leaf = torch.where(ran, EXPANDED, OVER_BUDGET)
        for node, code in self.leaves.items():
            leaf[node] = code
        sizes = [lv.tokens.shape[0] for lv in levels]
        nexts = [*self.batches, self.row_of[:0]]  # the last forward's candidates ran nowhere
        for lv, f, code, selected in zip(levels, fate.split(sizes), leaf.split(sizes), nexts, strict=True):
            lv.fate, lv.leaf, lv.selected = f, code, selected


def _through_last(taken: torch.Tensor) -> int:
    """How many of a ranked queue's candidates a pop of `taken` removes: through the last one taken,
    every one when none is (the queue ran out of candidates that can enter)."""
    where = taken.nonzero()
    return int(where[-1, 0]) + 1 if where.shape[0] else taken.shape[0]
