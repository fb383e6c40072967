"""The pieces of batched decoding (decode_batch.py) besides its forward (forward/batched.py): the
rows' sampling, and the compact teacher kept from their logits.

Contract: knows models, never trees, policies, prompt sources or the batch's bookkeeping.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

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
