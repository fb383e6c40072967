"""A best-first search's candidates as tensors: what salf.py and dyspec.py grow the iteration's
`TensorTree` with, where a forward's rows may be any earlier candidates, not the last level's.

`Pool` keeps every candidate the forwards proposed, in the order they proposed them (forward, row,
rank: a candidate's index is its push order, the searches' tie-break), as one float64 table (token,
draft log-probability, path log-probability, parent row, depth, rank; float64 holds them exactly);
the row each became (-1: none); and the rows drafted so far, the root's first. Each forward's
candidates are one `Level` (`reach`: its next rows are counted over every level); the search writes
every candidate's fate and leaf code once it ends (`write`), and the tree's view is made from that.
"""

from __future__ import annotations

import torch

from dynatree_core.drafting.tensor_tree import PADDING, Level

TOKEN, LOGP, CUM, PARENT, DEPTH, RANK = range(6)


class Pool:
    """Every candidate of a best-first search (module docstring)."""

    def __init__(self, device: torch.device):
        self.table = torch.zeros(0, 6, dtype=torch.float64, device=device)
        self.row_of = torch.zeros(0, dtype=torch.long, device=device)
        self.rows = torch.zeros(1, 2, dtype=torch.float64, device=device)  # each row's cum and depth, the root's first
        self.batches: list[torch.Tensor] = []  # the candidates each forward after the root's ran, in row order

    def add(self, lp: torch.Tensor, tokens: torch.Tensor) -> Level:
        """The last forward's rows' children, (P, k) log-probabilities (NaN: no candidate) and tokens,
        joined to the pool: a child's path log-probability is its parent row's plus its own. Returns
        the forward's `Level` (its fates and next rows written by `write`)."""
        (p, k), first = lp.shape, self.rows.shape[0] - lp.shape[0]  # the forward's first row
        own = torch.arange(p, device=lp.device).repeat_interleave(k)
        parent = self.rows[first:][own]
        flat = lp.flatten().double()
        rank = torch.arange(k, device=lp.device).repeat(p)
        columns = [tokens.flatten(), flat, parent[:, 0] + flat, own + first, parent[:, 1] + 1, rank]
        new = torch.stack([c.double() for c in columns], 1)
        self.table = torch.cat([self.table, new])
        self.row_of = torch.cat([self.row_of, torch.full_like(own, -1)])
        return Level(tokens.flatten(), lp.flatten(), own, None, None, None, cum=new[:, CUM], reach=True)

    def ranked(self, mask: torch.Tensor) -> torch.Tensor:
        """The candidates in `mask`, most probable first, ties in push order (a stable sort)."""
        index = mask.nonzero()[:, 0]
        return index[torch.sort(self.table[index, CUM], descending=True, stable=True).indices]

    def run(self, expand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`expand`'s candidates as the next forward's rows, numbered after every row so far: their
        tokens, parent rows and depths (Drafter.expand_rows)."""
        first = self.rows.shape[0]
        self.row_of[expand] = torch.arange(first, first + expand.shape[0], device=expand.device)
        self.rows = torch.cat([self.rows, self.table[expand][:, [CUM, DEPTH]]])
        self.batches.append(expand)
        tokens, parents, depths = self.table[expand][:, [TOKEN, PARENT, DEPTH]].long().unbind(1)
        return tokens, parents, depths

    def nodes_of_rows(self, nodes: torch.Tensor) -> torch.Tensor:
        """Per drafted row, whether its candidate is in `nodes` (a mask over the pool; the root's row is)."""
        alive = torch.zeros(self.rows.shape[0], dtype=torch.bool, device=nodes.device)
        alive[0] = True
        rows = self.row_of[nodes]
        alive[rows[rows >= 0]] = True
        return alive

    def write(self, levels: list[Level], fate: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        """Every candidate's fate and leaf code on its level, each level's next rows (the candidates
        the next forward ran); returns each candidate's node in the tree's view (0: none)."""
        sizes = [lv.tokens.shape[0] for lv in levels]
        nexts = [*self.batches, self.row_of[:0]]  # the last forward's candidates ran nowhere
        for lv, f, code, selected in zip(levels, fate.split(sizes), leaf.split(sizes), nexts, strict=True):
            lv.fate, lv.leaf, lv.selected = f, code, selected
        shown = fate != PADDING
        return torch.where(shown, shown.cumsum(0), 0)  # the view adds them in pool order, after the root
