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
        search = _Search(c["nodes"], c["batch"], c["th"], request.max_depth, drafter.steps.device)
        tree.notes = {"salf_mass": search.masses}
        if search.cap <= 0:
            tree.mark_leaf(0, Reason.LENGTH_LIMIT)
            return tree
        grown, rows = TensorTree(request.root_token), (None, None, 0)  # the root's forward first
        while rows is not None:
            logp = drafter.expand_level(*rows) if rows[0] is None else drafter.expand_rows(*rows)  # ONE forward
            grown.levels.append(search.add(logp))
            rows = search.step()  # lines 5-20: the next batch's rows, None once the tree is final
        search.decide(grown.levels)
        grown.view(tree, grown.read(None, drafter.steps, 0), drafter)
        return tree


class _Search:
    """Algorithm 2's state over every candidate drafted so far, in the order the forwards proposed
    them (a candidate's index is its push order: Q's tie-break): `pool`'s columns are each one's
    token, float32 draft log-probability, path log-probability, parent row and depth (float64 holds
    them exactly); masks say which are in Q, which were popped, the row each became (-1: none). G's
    nodes are kept in popped order (of equal probabilities the latest leaves first); the root is
    row 0, always in G."""

    TOKEN, LOGP, CUM, PARENT, DEPTH = range(5)

    def __init__(self, nodes: int, batch: int, th: float, max_depth: int, device: torch.device):
        self.n, self.b, self.th, self.cap = nodes, batch, th, max_depth
        self.masses = [1.0]  # the root's step: D = {root}, whose mass is 1
        self.pool = torch.zeros(0, 5, dtype=torch.float64, device=device)
        self.in_q = self.popped = torch.zeros(0, dtype=torch.bool, device=device)
        self.row_of = self.g = torch.zeros(0, dtype=torch.long, device=device)
        self.rows = torch.zeros(1, 2, dtype=torch.float64, device=device)  # each row's cum and depth, the root's first
        self.batches: list[torch.Tensor] = []  # the candidates each forward after the root's ran, in row order
        self.stop, self.leaves = Reason.BUDGET, {}  # why the search ended; candidate -> leaf code of D left unexpanded

    def add(self, logp: torch.Tensor) -> Level:
        """The last forward's rows' children (each row's N most probable: what Q could keep of them)
        joined to the pool and to Q (line 20), Q cut to its capacity N; the forward's `Level`."""
        lp, tokens = logp.topk(min(self.n, logp.shape[-1]), dim=-1)
        lp = lp.float()  # what a level records (Level.logp), and what pr is made of
        (p, k), first = lp.shape, self.rows.shape[0] - lp.shape[0]  # the forward's first row
        own = torch.arange(p, device=lp.device).repeat_interleave(k)
        parent = self.rows[first:][own]
        cum = parent[:, 0] + lp.flatten().double()  # a child's pr: its parent's times its p
        new = torch.stack(
            [tokens.flatten().double(), lp.flatten().double(), cum, (own + first).double(), parent[:, 1] + 1], 1
        )
        self.pool = torch.cat([self.pool, new])
        self.in_q = torch.cat([self.in_q, torch.ones_like(own, dtype=torch.bool)])
        self.popped = torch.cat([self.popped, torch.zeros_like(own, dtype=torch.bool)])
        self.row_of = torch.cat([self.row_of, torch.full_like(own, -1)])
        self.in_q[self._ranked(self.in_q)[self.n :]] = False  # capacity N: the least probable leave Q for good
        return Level(tokens.flatten(), lp.flatten(), own, fate=None, leaf=None, selected=None, cum=cum, reach=True)

    def _ranked(self, mask: torch.Tensor) -> torch.Tensor:
        """The candidates in `mask`, most probable first, ties in push order (a stable sort)."""
        index = mask.nonzero()[:, 0]
        return index[torch.sort(self.pool[index, self.CUM], descending=True, stable=True).indices]

    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Pop up to B candidates from Q into G (lines 5-9: a candidate whose parent left G cannot
        enter it and is passed over), cut G to N nodes (the least probable leave it, latest first),
        keep of the batch the nodes that stay in G (lines 10-12), record its mass and stop below th
        (line 13). Returns the next forward's rows (Drafter.expand_rows: the batch's tokens, parent
        rows, depths; those at the depth cap are leaves), None once the tree is final; a batch wholly
        at the cap pops again with no forward."""
        cum = self.pool[:, self.CUM]
        while True:
            queue = self._ranked(self.in_q)
            alive = self._alive()[self.pool[queue, self.PARENT].long()]
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
            values = to_list(torch.cat([cum[d], d.double(), self.pool[d, self.DEPTH]]))  # one read a step
            m = d.shape[0]
            mass = sum(math.exp(v) for v in values[:m])
            self.masses.append(mass)
            nodes, deeper = [int(v) for v in values[m : 2 * m]], [v < self.cap for v in values[2 * m :]]
            if mass < self.th or not nodes:
                self.stop = Reason.SALF_STOP if nodes else self.stop
                self.leaves.update(dict.fromkeys(nodes, SALF_STOPPED))
                return None
            self.leaves.update({n: AT_LENGTH for n, ok in zip(nodes, deeper, strict=True) if not ok})
            if any(deeper):
                return self._rows(d[torch.tensor(deeper, device=d.device)])

    def _rows(self, expand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's candidates as rows numbered after every row so far, and the forward's inputs."""
        first = self.rows.shape[0]
        self.row_of[expand] = torch.arange(first, first + expand.shape[0], device=expand.device)
        self.rows = torch.cat([self.rows, self.pool[expand][:, [self.CUM, self.DEPTH]]])
        self.batches.append(expand)
        tokens, parents, depths = self.pool[expand][:, [self.TOKEN, self.PARENT, self.DEPTH]].long().unbind(1)
        return tokens, parents, depths

    def _alive(self) -> torch.Tensor:
        """Per drafted row, whether its node is in G (the root's always is)."""
        alive = torch.zeros(self.rows.shape[0], dtype=torch.bool, device=self.g.device)
        alive[0] = True
        rows = self.row_of[self.g]
        alive[rows[rows >= 0]] = True
        return alive

    def _eps(self) -> float | torch.Tensor:
        """Lines 10-11: the least probability in G once it holds N nodes, else -inf."""
        return self.pool[self.g, self.CUM].min() if self.g.shape[0] + 1 >= self.n else -math.inf

    def decide(self, levels: list[Level]) -> None:
        """Every candidate's fate, written on its level: G's nodes admitted (leaves unless a forward
        ran them: SALF's stop, the depth cap, else the budget); popped and out of G: pruned (budget);
        left in Q, probable enough to fit and under a node of G: pruned with the search's stop
        reason; the rest are no nodes. Each level's next rows: the candidates the next forward ran."""
        ran = self.row_of >= 0
        fits = self.in_q & (self.pool[:, self.CUM] > self._eps()) & self._alive()[self.pool[:, self.PARENT].long()]
        fate = torch.full_like(self.row_of, PADDING)
        fate[fits] = STOPPED if self.stop == Reason.SALF_STOP else BUDGET
        fate[self.popped] = BUDGET
        fate[self.g] = ADMITTED
        leaf = torch.where(ran, EXPANDED, OVER_BUDGET)
        leaf[list(self.leaves)] = torch.tensor(list(self.leaves.values()), dtype=torch.long, device=leaf.device)
        sizes = [lv.tokens.shape[0] for lv in levels]
        nexts = [*self.batches, self.row_of[:0]]  # the last forward's candidates ran nowhere
        for lv, f, code, selected in zip(levels, fate.split(sizes), leaf.split(sizes), nexts, strict=True):
            lv.fate, lv.leaf, lv.selected = f, code, selected


def _through_last(taken: torch.Tensor) -> int:
    """How many of a ranked queue's candidates a pop of `taken` removes: through the last one taken,
    every one when none is (the queue ran out of candidates that can enter)."""
    where = taken.nonzero()
    return int(where[-1, 0]) + 1 if where.shape[0] else taken.shape[0]
