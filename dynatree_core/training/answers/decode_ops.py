"""The pieces of batched decoding (decode_batch.py): the forward of a batch of rows over
preallocated per-row key/value buffers through the target's lean blocks (forward/fastpath.py), the
rows' sampling, and the compact teacher kept from their logits.

Attention: every row attends over its own slots; slots past a row's length are masked per row. The
forward is the lean forward every run takes (fastpath.LeanForward), over a batch of B sequences.

Contract: knows models, never trees, policies, prompt sources or the batch's bookkeeping.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dynatree_core.core.taps import FINAL
from dynatree_core.errors import DynaTreeError
from dynatree_core.forward.fastpath import LeanForward, lean_forward_for

TOP_K = 64  # sampled rows draw from the top-k (then top-p) of the tempered distribution
TEACHER_K = 32  # the teacher's top-k kept per loss position (the rest of its mass is renormalised away)


def compact_teacher(logits: torch.Tensor, k: int = TEACHER_K) -> dict[str, torch.Tensor]:
    """The target's next-token distribution at n positions, kept small: its top-k token ids
    ("ids", (n, k) int64) and logits ("logits", (n, k) float32) and the log-sum-exp over its whole
    vocabulary ("lse", (n,) float32), so p(top-k) = exp(logits - lse) and the mass they cover is known.
    A training step then needs no target LM head at all (SpecForge's compact teacher keeps the
    draft vocabulary's slice; the top-k is smaller still, and any token map can be applied later)."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return {"ids": top.indices, "logits": top.values.float(), "lse": torch.logsumexp(logits.float(), dim=-1)}


@dataclasses.dataclass
class Decoded:
    """One finished row: ids = prompt + answer (EOS included when it came), features (len(ids) - 1, H)
    and, when asked for, the compact teacher at every answer position (`compact_teacher`'s keys,
    host arrays of len(ids) - prompt_len rows: the logits each answer token was drawn from)."""

    ids: np.ndarray
    prompt_len: int
    features: np.ndarray
    teacher: dict[str, np.ndarray] | None = None


def lean_or_fail(model: torch.nn.Module) -> LeanForward:
    lean = lean_forward_for(model, fast=True)
    if lean is None:
        raise DynaTreeError(
            f"batched draft data needs a Llama-family target (llama, qwen2, mistral); this one is "
            f"{model.config.model_type!r}"
        )
    return lean


class _RowCache:
    """One layer's per-row buffers (B, kv_heads, capacity, d) as the lean forward sees a cache layer:
    `update` writes the rows' keys/values (a prefill's at slots 0 .. T; a step's, one a row, at each
    row's slot in `slots`) and returns the first `length` slots, which the mask covers."""

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


def forward_rows(
    lean: LeanForward,
    ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    slots: torch.Tensor | None = None,
    *,
    taps: tuple[int, ...] = (),
    tapped: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rows ids (B, T) at `positions` (B, T), reading the first L cache slots through `mask`
    (B, 1, T, L), by the lean forward every run's forwards take (fastpath.LeanForward, a batch of B
    sequences): keys/values go to slots 0 .. T (slots None: a prefill) or, for one token per row
    (T = 1), to each row's slot in `slots` (B,). Returns the post-norm states (B, T, H); the
    inputs of the layers in `taps` (core/taps.py) are appended to `tapped`, in layer order."""
    layers = [_RowCache(buffers, slots, mask.shape[-1]) for buffers in caches]
    out = lean(ids, positions, mask, layers, 0, hidden=(*taps, FINAL) if taps else True).states
    if ids.shape[0] == 1:  # the lean forward hands one sequence's rows without the batch dimension
        out = out[None]
    if not taps:
        return out
    tapped.extend(out.unbind(-2)[:-1])
    return out[..., -1, :]


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    generator: torch.Generator,
    *,
    top_p: float = 0.95,
    hot: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next tokens for logits (B, V): argmax where temperature is 0, else a draw from the tempered
    top-k (TOP_K) distribution cut to top-p. `hot`: the indices of the rows that draw, when the caller
    knows them (None: the rows with temperature > 0, found by reading the device)."""
    pick = logits.argmax(-1)
    if hot is None:
        hot = torch.nonzero(temperature > 0)[:, 0]
    if len(hot) == 0:
        return pick
    top = logits.index_select(0, hot).topk(min(TOP_K, logits.shape[-1]), dim=-1)
    probs = torch.softmax(top.values / temperature[hot, None], dim=-1)
    before = probs.cumsum(-1) - probs  # mass of the better tokens
    probs = probs.masked_fill(before >= top_p, 0.0)
    draw = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator)
    return pick.index_copy_(0, hot, top.indices.gather(1, draw)[:, 0])


def host_f16(states: torch.Tensor) -> np.ndarray:
    return states.float().cpu().numpy().astype(np.float16)
