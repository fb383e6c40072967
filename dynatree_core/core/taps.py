"""Which of the target's hidden states a feature draft reads: its "taps".

A hidden state is named by transformers' `output_hidden_states` index: tap i < L is the INPUT of
decoder layer i (the pre-norm residual stream; tap 0 is the token embeddings), and a draft that
reads the FINAL state (after the target's final norm, what its LM head reads: EAGLE-1 and this
project's first feature draft) says so with `FINAL`. The fused kind (EAGLE-3, Li et al. 2025,
sec. 3.2) reads a low, a middle and a high layer: `eagle3_taps(L)` = (2, L // 2, L - 3), the
layers SafeAILab's code hard-codes and vLLM and SGLang default to (docs/published-heads.md;
SGLang and SpecForge count the OUTPUT of layer i, i.e. tap i + 1: `from_output_ids`).

The same forward that verifies a tree (or labels training data) hands these states out: no
second pass (`stack_taps` lays them out for every forward in core). Nothing here knows a draft's weights.
"""

from __future__ import annotations

import torch

FINAL = -1  # the final (post-norm) hidden state, not a layer input


def eagle3_taps(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high taps for a target of `n_layers` decoder layers."""
    if n_layers < 4:
        raise ValueError(f"a fused-feature draft needs a target of at least 4 layers, not {n_layers}")
    return (2, n_layers // 2, n_layers - 3)


def from_output_ids(ids: list[int]) -> tuple[int, ...]:
    """Taps of layer ids in the "output of layer i" convention (SGLang, SpecForge)."""
    return tuple(int(i) + 1 for i in ids)


def check_taps(taps: tuple[int, ...], n_layers: int) -> tuple[int, ...]:
    """`taps` as a tuple of ints, each FINAL or a layer input 0 .. n_layers - 1 (ValueError if not)."""
    out = tuple(int(t) for t in taps)
    bad = [t for t in out if t != FINAL and not 0 <= t < n_layers]
    if bad:
        raise ValueError(f"tap(s) {bad} are outside the target's {n_layers} layers")
    return out


def stack_taps(taps: tuple[int, ...], inputs: dict[int, torch.Tensor], final: torch.Tensor) -> torch.Tensor:
    """(..., q, len(taps), hidden): the layer inputs `inputs[i]` (..., q, hidden) in the taps' order,
    FINAL read as the final post-norm states `final` (..., q, hidden)."""
    return torch.stack([final if t < 0 else inputs[t] for t in taps], dim=-2)
