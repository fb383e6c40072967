"""A batch of sequences, each with its own cache: the recipes' forward (training/answers), called as
every forward is, `run(rows) -> Forward` (kv.KVState.run's contract over a batch).

`SequenceCaches` holds one model's per-layer key/value buffers (B, kv_heads, capacity, head_dim),
row b the cache of sequence b, and the lean forward every run takes (fastpath.LeanForward, a
Llama-family model). Its rows (`rows.Rows` with a batch dimension):

    ids              (B, T)
    positions, seen  (B, T) and (B, T, L) bool: each row sees the first L slots of its own
                     sequence's cache, its own included; or (T,) and (T, L), the same for every
                     sequence (a prefill)
    slots            None: the rows' keys go to slots 0 .. T (a prefill); else (B, 1): one row a
                     sequence, at that sequence's slot

`rows.Rows.batch` builds them (a batch of chains: `Rows.chain(ids, 0)` for a prefill, a step's at
its fixed width from each sequence's length).
    hidden           True: the post-norm states (B, T, H); a tuple of taps (core/taps.py): (B, T,
                     len(taps), H). The recipes read states; the LM head is theirs (logits None).

Contract: knows sequences, slots and the lean forward, never trees, policies or prompt sources.
"""

from __future__ import annotations

import torch

from dynatree_core.errors import DynaTreeError
from dynatree_core.forward.fastpath import LeanForward, lean_forward_for
from dynatree_core.forward.reference import Forward, additive
from dynatree_core.forward.rows import Rows


def lean_or_fail(model: torch.nn.Module) -> LeanForward:
    """The lean forward of `model` (built with the fused projections), or a DynaTreeError naming its type."""
    lean = lean_forward_for(model, fast=True)
    if lean is None:
        raise DynaTreeError(
            f"batched draft data needs a Llama-family target (llama, qwen2, mistral); this one is "
            f"{model.config.model_type!r}"
        )
    return lean


class SequenceCaches:
    """B sequences' caches of one model and its lean forward (module docstring)."""

    def __init__(self, lean: LeanForward, buffers: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype):
        self.lean, self.buffers, self.dtype = lean, buffers, dtype

    @classmethod
    def empty(cls, model: torch.nn.Module, lean: LeanForward, rows: int, capacity: int) -> SequenceCaches:
        """Zeroed buffers for `rows` sequences of up to `capacity` slots, in the model's dtype, on its device."""
        block, device = lean.blocks[0], model.get_input_embeddings().weight.device
        shape = (rows, block.qk_heads - block.heads, capacity, block.head_dim)
        zeros = lambda: torch.zeros(shape, dtype=model.dtype, device=device)  # noqa: E731
        return cls(lean, [(zeros(), zeros()) for _ in lean.blocks], model.dtype)

    def run(self, rows: Rows) -> Forward:
        """ONE forward over `rows` (module docstring), its keys and values written to the sequences'
        caches. Returns the rows' states."""
        ids, positions, seen = rows.ids, rows.positions, rows.seen
        if seen.dim() == 2:  # one visibility for every sequence (a prefill's): one mask
            mask = additive(seen[None, None], self.dtype).expand(ids.shape[0], -1, -1, -1)
            positions = positions.expand(ids.shape)
        else:
            mask = additive(seen[:, None], self.dtype)  # (B, 1, T, L)
        slots = rows.slots[:, 0] if rows.slots is not None else None
        layers = [_SequenceLayer(buffers, slots, mask.shape[-1]) for buffers in self.buffers]
        states = self.lean(ids, positions, mask, layers, 0, hidden=rows.hidden).states
        return Forward(None, states[None] if rows.ids.shape[0] == 1 else states)  # the lean forward drops B = 1

    def part(self, first: int, end: int) -> SequenceCaches:
        """Sequences first .. end - 1 (views of the same buffers)."""
        return SequenceCaches(self.lean, [(k[first:end], v[first:end]) for k, v in self.buffers], self.dtype)

    def select(self, index: torch.Tensor) -> SequenceCaches:
        """The sequences `index` names, copied (a batch cut to its live rows)."""
        kept = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.buffers]
        return SequenceCaches(self.lean, kept, self.dtype)

    def put(self, index: torch.Tensor, other: SequenceCaches) -> None:
        """`other`'s sequences (their first slots) become the sequences `index` names (a refill)."""
        for (k, v), (ok, ov) in zip(self.buffers, other.buffers, strict=True):
            width = ok.shape[2]
            k[index, :, :width] = ok
            v[index, :, :width] = ov


class _SequenceLayer:
    """One layer's buffers as the lean forward sees a cache layer: `update` writes the rows' keys and
    values (a prefill's at slots 0 .. T; a step's, one a sequence, at its slot in `slots`) and
    returns the first `length` slots, which the mask covers."""

    def __init__(self, buffers: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor | None, length: int):
        self.buffers, self.slots, self.length = buffers, slots, length

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kbuf, vbuf = self.buffers
        if self.slots is None:
            kbuf[:, :, : k.shape[2]] = k
            vbuf[:, :, : v.shape[2]] = v
        else:
            rows = torch.arange(k.shape[0], device=k.device)
            kbuf[rows, :, self.slots] = k[:, :, 0]
            vbuf[rows, :, self.slots] = v[:, :, 0]
        return kbuf[:, :, : self.length], vbuf[:, :, : self.length]
