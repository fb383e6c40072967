"""Sampling settings applied identically to the target and the draft.

`adjust(logits, config)` turns logits into the distribution that sampling draws from:
temperature, then top-k, then top-p (nucleus) truncation, renormalised. Speculative sampling is
lossless with respect to this adjusted target distribution only if the draft's proposals are
drawn from the draft's distribution adjusted the same way, so both go through this function.
Temperature 0 means greedy (the argmax, as a one-hot distribution).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dynatree_core.errors import DynaTreeError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k truncation

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise DynaTreeError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DynaTreeError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DynaTreeError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def adjust(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """(..., V) logits -> (..., V) float64 probabilities after temperature, top-k and top-p."""
    logits = logits.double()
    if config.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    logits = logits / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = logits.topk(config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1:
        sorted_p, index = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= config.top_p, 0.0)  # keep the smallest nucleus
        probs = torch.zeros_like(probs).scatter(-1, index, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
