"""A forward's rows: what every forward reads, in one form, and the one way their visibility is built.

Every forward the engine runs (the prefill, a chain of pending tokens, a draft level, the verify
batch; the recipes' batched answers too) is `Rows`: the new tokens' ids and positions, which
cache slots each row sees, the logits to keep, and optionally input vectors and the states to
hand back. `KVState.run(rows)` (kv.py) runs it.

Which slots a row sees is said one way (`visibility`): every slot below a bound, plus a few slots
named, the row's lineage (its ancestors' slots and its own):

    prefill, a chain    row i after `past` cached entries: every slot below past + i + 1
    a draft level       every committed slot, and its ancestors' slots in the tree's earlier
                        levels and its own (drafts/session.py)
    the verify batch    the chain's rows as a chain; a tree row every slot below past + chain
                        (the cache, the pending chain, the root last), and its tree ancestors'
                        slots and its own (`tree_seen`)
    a padding row       nothing below; its own slot
    batched answers     row b of a batch: every slot up to its own length (training/answers)

A row's ancestors come from parent pointers (`lineage`): one gather per level of depth, on the
host or the device alike; their closure as a boolean matrix (`closure`) is what the records show.

Contract: knows slots and rows, never trees, policies or models.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Rows:
    """One forward's q new rows (module docstring).

    Attributes:
        ids, positions: (q,) token ids and positions: host lists or device tensors.
        seen: (q, length + q) bool, row i may attend to slot j (`visibility`); in a captured
            step (forward/filled.py) (width, span) over the first `span` slots.
        keep: the logits of the last `keep` rows are returned.
        embeds: (q, hidden) input vectors instead of the ids' embeddings (a feature draft's).
        hidden: also return the final states of every row; a tuple of taps (core/taps.py)
            returns (q, len(taps), hidden) states.
        most_keys: a bound on the keys any row sees, where `seen` is on a GPU (reading it there
            would wait; width-invariant forwards size their span by it).
        slots: (q,) the cache slots the rows' keys go to, in a captured step (made there from the
            cache's length on the device); None: right after the cache's entries.
    """

    ids: torch.Tensor | list[int]
    positions: torch.Tensor | list[int]
    seen: torch.Tensor
    keep: int = 1
    embeds: torch.Tensor | None = None
    hidden: bool | tuple[int, ...] = False
    most_keys: int | None = None
    slots: torch.Tensor | None = None

    @classmethod
    def chain(cls, tokens: list[int], past: int, keep: int = 1, **fields) -> Rows:
        """A chain of tokens after `past` cached entries (a prefill: past 0), causal, at positions
        past, past + 1, ..."""
        n = len(tokens)
        return cls(tokens, list(range(past, past + n)), causal(past, n), keep, **fields)


def visibility(before, lineage: torch.Tensor | None, span: int, real: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, span) bool: row r sees every slot below `before` (an int, a device scalar, or (rows,)
    per row) and the slots `lineage` (rows, d) names (padded by repeating one of them; None: no
    slot named). A row that is not `real` ((rows,) bool: padding) sees only its lineage."""
    device = lineage.device if lineage is not None else getattr(before, "device", None)
    cols = torch.arange(span, device=device)
    below = cols < (before[:, None] if isinstance(before, torch.Tensor) and before.dim() else before)
    if below.dim() == 1:
        below = below.expand(lineage.shape[0] if lineage is not None else real.shape[0], span)
    if real is not None:
        below = below & real[:, None]
    return below if lineage is None else below.scatter(1, lineage, True)


def causal(past: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(n, past + n): n chain rows after `past` cached entries, each seeing every slot up to its own."""
    return visibility(torch.arange(past + 1, past + n + 1, device=device), None, past + n)


def lineage(parents: torch.Tensor | list[int], hops: int | None = None) -> torch.Tensor:
    """(n, hops + 1): each row, then its parent's row, its parent's parent's, ... `hops` times
    (`parents` (n,) long: a row's parent row; a root is its own parent, so a shallow row repeats
    its root). On the device one gather a hop. A host list whose parents come before their
    children (a tree's bfs or dfs order, root first) is followed in Python, `hops` the deepest
    row's depth, and made one tensor."""
    if hops is None:
        lines = [[0]]
        for i in range(1, len(parents)):
            lines.append([i, *lines[parents[i]]])
        deepest = max(map(len, lines))
        return torch.tensor([line + [0] * (deepest - len(line)) for line in lines])
    out = [torch.arange(parents.shape[0], device=parents.device), parents]
    for _ in range(hops - 1):
        out.append(parents[out[-1]])
    return torch.stack(out[: hops + 1], dim=1)


def closure(lineage: torch.Tensor) -> torch.Tensor:
    """(n, n) bool: [i, j] row j is row i or one of its ancestors (the records' mask)."""
    n = lineage.shape[0]
    return torch.zeros(n, n, dtype=torch.bool, device=lineage.device).scatter(1, lineage, True)


def tree_seen(past, chain: int, lines: torch.Tensor, span: int | None = None, width: int | None = None):
    """The verify batch's visibility: `chain` pending rows (causal after `past` cached entries, the
    root last), then a tree's rows whose `lines` ((n + 1, d) `lineage` over the tree's rows, the
    root's row first) name their ancestors: each sees the cache and the chain, and its ancestors'
    slots and its own. (chain + n, span or past + chain + n). At a fixed `width` (a captured
    step's: `past` may then be a device scalar) the rows after chain + n are padding: each sees
    its own slot alone."""
    n, device, top = lines.shape[0] - 1, lines.device, past + chain  # the cache and the chain, the root last
    if n == 0 and span is None and width is None:  # no tree rows (`ar`'s batch): a chain
        return causal(past, chain, device)
    span = span if span is not None else top + n
    real = None
    if width is not None and width > chain + n:  # padding rows: each its own lineage, nothing below
        own = torch.arange(n + 1, width - chain + 1, device=device)
        lines = torch.cat([lines, own[:, None].expand(-1, lines.shape[1])])
        real = torch.arange(lines.shape[0], device=device) <= n
    seen = visibility(top, lines + (top - 1), span, real)  # the root's row and the tree's
    if chain > 1:  # the chain's rows before the root's, causal
        seen = torch.cat([visibility(past + torch.arange(1, chain, device=device), None, span), seen])
    return seen


def batch_lines(chain: int, lines: list[list[int]], width: int) -> list[int]:
    """A host-built verify batch's rows as `visibility` reads them, counted from the batch's first
    row, at a fixed `width` (a captured step's): each row's bound (a chain row sees the chain up to
    itself, a tree row all of it), then each row's lineage, `width` slots (a chain row itself, a
    tree row its ancestors' rows and its own, the root's being the chain's last; a padding row
    after chain + n its own; repeating the row's own). Host lists in, one flat list out (one upload)."""
    q = chain + len(lines) - 1
    before = [min(r + 1, chain) for r in range(width)]
    every = [[r] for r in range(chain - 1)] + [[j + chain - 1 for j in line] for line in lines]
    every += [[r] for r in range(q, width)]
    return before + [j for line in every for j in line + line[:1] * (width - len(line))]
