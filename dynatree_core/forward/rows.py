"""A forward's rows: what every forward reads, in one form, built by one function.

Every forward the engine runs (the prefill, a chain of pending tokens, a draft level, the verify
batch; the recipes' batched answers too) is `Rows`: the new tokens' ids and positions, which
cache slots each row sees, the logits to keep, and optionally input vectors and the states to
hand back. `KVState.run(rows)` (kv.py) runs it. `Rows.batch` builds every forward's rows, on
the host or inside a captured step at a fixed width (forward/filled.py) alike: a chain of pending
tokens, then node rows with their lineages, then padding.

Which slots a row sees is said one way (`visibility`): every slot below a bound, plus a few slots
named, the row's lineage (its ancestors' slots and its own):

    prefill, a chain    row i after `past` cached entries: every slot below past + i + 1
    a draft level       every committed slot, and its ancestors' slots in the tree's earlier
                        levels and its own (drafts/session.py)
    the verify batch    the chain's rows as a chain; a tree row every slot below past + chain
                        (the cache, the pending chain, the root last), and its tree ancestors'
                        slots and its own
    a padding row       nothing below; its own slot
    batched answers     row b of a batch: every slot up to its own length (training/answers): a
                        chain a sequence, past and first one a sequence
    training windows    a depth-k node of a window: the window's slots up to its root, and its
                        ancestors' in the stacked levels (training/feature/depth.py, packed/data.py)

A row's ancestors come from parent pointers (`lineage`): one gather per level of depth, on the
host or the device alike; their closure as a boolean matrix (`closure`) is what the records show.

Contract: knows slots and rows, never trees, policies or models.
"""

from __future__ import annotations

import dataclasses

import torch

_COUNTS: dict[torch.device, torch.Tensor] = {}  # 0, 1, 2, ... per device (`counting`)
_MADE: list[torch.Tensor] = []  # every one made, kept: a captured graph may read an outgrown one


def counting(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """0 .. n - 1 (long) on `device`, as a view of one arange kept per device (made once a size,
    a power of two, never written: the builders below launch nothing for it). Under a CUDA graph's
    capture a size not made yet is made fresh (what a capture allocates belongs to its graph)."""
    device = torch.device(device if device is not None else "cpu")
    made = _COUNTS.get(device)
    if made is None or made.shape[0] < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.arange(n, device=device)
        made = _COUNTS[device] = torch.arange(max(64, 1 << max(n - 1, 0).bit_length()), device=device)
        _MADE.append(made)
    return made[:n]


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
    def chain(cls, tokens, past: int, keep: int = 1, **fields) -> Rows:
        """A chain of tokens after `past` cached entries (a prefill: past 0), causal, at positions
        past, past + 1, ... (`batch` with no node rows)."""
        return cls.batch(past, tokens, past, keep=keep, **fields)

    @classmethod
    def tree(cls, past, chain, first, tokens, positions, lines: torch.Tensor, **fields) -> Rows:
        """A verify batch (`batch`): the `chain`, then a tree's rows whose `lines` (w + 1, d), the
        root's first (`lineage`), count rows from the root's, the chain's last."""
        return cls.batch(past, chain, first, tokens, positions, lines + (past + len(chain) - 1), **fields)

    @classmethod
    def batch(
        cls, past, chain, first, tokens=(), positions=(), lines=None, *, below=None, width=None, span=None, real=None,
        keep: int = 1, **fields,
    ) -> Rows:  # fmt: skip
        """THE builder of a forward's rows (every forward's: the module docstring's table). Its
        slots are past, past + 1, ...: first `chain` (n,) pending tokens at positions first,
        first + 1, ..., causal after the `past` cached entries; then node rows, `tokens` (w,) at
        `positions`, each seeing every slot below `below` (default past + n: the cache and the
        whole chain, the root last) and the slots `lines` names (its ancestors' and its own):
        (w + 1, d) after a chain, the chain's last row's (the root's: its own slot) first; (w, d)
        with no chain (a draft level, whose root is committed).

        Host lists and an int `past` give host lists and a mask over past + q slots, for the forward
        right after the cache. At a fixed `width` (a captured step's, forward/filled.py: `past`
        and `below` may be device scalars, the ids device tensors) the mask spans `span` slots, the
        rows' slots are named, and the rows after `real` (default n + w; a device scalar where the
        node rows come padded) are padding: each sees its own slot alone, and nothing sees it.

        A batch of sequences' chains (the recipes' batched answers, forward/batched.py): `chain`
        (B, n), `past` and `first` 0 (a prefill: one visibility and positions for every sequence)
        or (B, 1), each sequence's own (a step at a fixed width)."""
        n, w = (chain.shape[-1] if isinstance(chain, torch.Tensor) else len(chain)), len(tokens)
        q = n + w
        device = next((x.device for x in (tokens, chain, lines, past) if isinstance(x, torch.Tensor)), None)
        fixed = width is not None
        width, span = (width, span) if fixed else (q, past + q)
        top, pad = past + n if below is None else below, width - q if real is None else 0
        # each row's slot, where the rows' slots are named or a chain's rows before the root's are causal
        rows = counting(width, device) if fixed or (n > 1 and w) else None
        slots = past + rows if rows is not None else None
        if w == 0:  # a chain: causal
            before = slots + 1 if fixed else counting(past + q + 1, device)[past + 1 :]
            every = slots[:, None] if pad else None
        else:  # the chain's one row (the root) sees what the nodes see
            before = top if n == 0 or (n == 1 and below is None) else torch.where(rows < n, slots + 1, top)
            d = lines.shape[1]
            parts = [slots[: n - 1, None].expand(n - 1, d)] if n > 1 else []
            parts += [lines, slots[q:, None].expand(pad, d)] if pad else [lines]
            every = torch.cat(parts) if len(parts) > 1 else lines
        mask = rows < real if real is not None else (rows < q if pad else None)
        seen = visibility(before, every, span, mask)
        if n == 0 or isinstance(chain, (list, tuple, range)) and not isinstance(first, torch.Tensor):
            counted = list(range(first, first + n))  # the chain's positions: a host chain's on the host
        else:
            counted = first + rows[:n] if rows is not None else counting(first + n, device)[first:]
        positions = _joined(counted, positions, pad, device, fixed)
        ids, slots = _joined(chain, tokens, pad, device, fixed), slots if fixed else None
        return cls(ids, positions, seen, keep, slots=slots, **fields)


def _joined(head, tail, pad: int, device, tensor: bool):
    """head then tail then `pad` zeros: host lists stay a list unless a `tensor` is asked for or
    either part is one; else one tensor on `device`."""
    if not tensor and not any(isinstance(x, torch.Tensor) for x in (head, tail)):
        return [*head, *tail] + [0] * pad
    parts = [torch.as_tensor(x, dtype=torch.long, device=device) for x in (head, tail) if len(x)]
    if pad:
        parts.append(torch.zeros(pad, dtype=torch.long, device=device))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def visibility(
    before, lineage: torch.Tensor | None, span: int, real: torch.Tensor | None = None, start=None
) -> torch.Tensor:
    """(..., rows, span) bool: row r sees every slot below `before` (an int, a device scalar, or one
    per row) from `start` on (default 0: a packed training window's first slot) and the slots
    `lineage` (..., rows, d) names (padded by repeating one of them; None: no slot named). A row
    that is not `real` ((..., rows) bool: padding) sees only its lineage. Leading dimensions (a
    training batch's) broadcast."""
    device = lineage.device if lineage is not None else getattr(before, "device", None)
    cols = counting(span, device)
    below = cols < (before[..., None] if isinstance(before, torch.Tensor) and before.dim() else before)
    if start is not None:
        below = below & (cols >= start[..., None])
    if real is not None:
        below = below & real[..., None]
    if lineage is None:
        return below if below.dim() >= 2 else below.expand(real.shape[0], span)
    return below.expand(*lineage.shape[:-1], span).scatter(-1, lineage, True)


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
    out = [counting(parents.shape[0], parents.device), parents]
    for _ in range(hops - 1):
        out.append(parents[out[-1]])
    return torch.stack(out[: hops + 1], dim=1)


def closure(lineage: torch.Tensor) -> torch.Tensor:
    """(n, n) bool: [i, j] row j is row i or one of its ancestors (the records' mask)."""
    n = lineage.shape[0]
    return torch.zeros(n, n, dtype=torch.bool, device=lineage.device).scatter(1, lineage, True)
