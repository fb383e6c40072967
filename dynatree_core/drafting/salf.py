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
from dynatree_core.drafting.search import CUM, DEPTH, PARENT, Pool
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
    """Algorithm 2's state over every candidate drafted so far (search.Pool): masks say which are in
    Q and which were popped; G's nodes are kept in popped order (of equal probabilities the latest
    leaves first); the root is row 0, always in G."""

    def __init__(self, nodes: int, batch: int, th: float, max_depth: int, device: torch.device):
        self.n, self.b, self.th, self.cap = nodes, batch, th, max_depth
        self.masses = [1.0]  # the root's step: D = {root}, whose mass is 1
        self.pool = Pool(device)
        self.in_q = self.popped = torch.zeros(0, dtype=torch.bool, device=device)
        self.g = torch.zeros(0, dtype=torch.long, device=device)
        self.stop, self.leaves = Reason.BUDGET, {}  # why the search ended; candidate -> leaf code of D left unexpanded

    def add(self, logp: torch.Tensor) -> Level:
        """The last forward's rows' children (each row's N most probable: what Q could keep of them)
        joined to the pool and to Q (line 20), Q cut to its capacity N; the forward's `Level`."""
        lp, tokens = logp.topk(min(self.n, logp.shape[-1]), dim=-1)
        level = self.pool.add(lp.float(), tokens)  # float32: what a level records, and what pr is made of
        fresh = torch.ones_like(level.tokens, dtype=torch.bool)
        self.in_q, self.popped = torch.cat([self.in_q, fresh]), torch.cat([self.popped, ~fresh])
        self.in_q[self.pool.ranked(self.in_q)[self.n :]] = False  # capacity N: the least probable leave Q for good
        return level

    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Pop up to B candidates from Q into G (lines 5-9: a candidate whose parent left G cannot
        enter it and is passed over), cut G to N nodes (the least probable leave it, latest first),
        keep of the batch the nodes that stay in G (lines 10-12), record its mass and stop below th
        (line 13). Returns the next forward's rows (Drafter.expand_rows: the batch's tokens, parent
        rows, depths; those at the depth cap are leaves), None once the tree is final; a batch wholly
        at the cap pops again with no forward."""
        table = self.pool.table
        cum = table[:, CUM]
        while True:
            queue = self.pool.ranked(self.in_q)
            alive = self.pool.nodes_of_rows(self.g)[table[queue, PARENT].long()]
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
            values = to_list(torch.cat([cum[d], d.double(), table[d, DEPTH]]))  # one read a step
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
                return self.pool.run(d[torch.tensor(deeper, device=d.device)])

    def _eps(self) -> float | torch.Tensor:
        """Lines 10-11: the least probability in G once it holds N nodes, else -inf."""
        return self.pool.table[self.g, CUM].min() if self.g.shape[0] + 1 >= self.n else -math.inf

    def decide(self, levels: list[Level]) -> None:
        """Every candidate's fate, written on its level: G's nodes admitted (leaves unless a forward
        ran them: SALF's stop, the depth cap, else the budget); popped and out of G: pruned (budget);
        left in Q, probable enough to fit and under a node of G: pruned with the search's stop
        reason; the rest are no nodes."""
        table, ran = self.pool.table, self.pool.row_of >= 0
        under_g = self.pool.nodes_of_rows(self.g)[table[:, PARENT].long()]
        fits = self.in_q & (table[:, CUM] > self._eps()) & under_g
        fate = torch.full_like(self.pool.row_of, PADDING)
        fate[fits] = STOPPED if self.stop == Reason.SALF_STOP else BUDGET
        fate[self.popped] = BUDGET
        fate[self.g] = ADMITTED
        leaf = torch.where(ran, EXPANDED, OVER_BUDGET)
        leaf[list(self.leaves)] = torch.tensor(list(self.leaves.values()), dtype=torch.long, device=leaf.device)
        self.pool.write(levels, fate, leaf)


def _through_last(taken: torch.Tensor) -> int:
    """How many of a ranked queue's candidates a pop of `taken` removes: through the last one taken,
    every one when none is (the queue ran out of candidates that can enter)."""
    where = taken.nonzero()
    return int(where[-1, 0]) + 1 if where.shape[0] else taken.shape[0]
