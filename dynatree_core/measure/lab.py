"""Verification Lab: repeat one speculative step many times on a fixed context and compare the
first committed token's empirical law with the target's own next-token distribution.

Each repetition drafts a fresh tree (its own seed) and verifies it with one target forward, as
the engine does, so the histogram tests the whole draft -> verify path, not just a solver.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import torch

from dynatree_core.core.sampling_config import adjust
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.engine import DecodeConfig, decode
from dynatree_core.drafting.policy import Policy
from dynatree_core.runs.records import IterationRecord


@dataclasses.dataclass
class LabResult:
    target_law: torch.Tensor  # the target's adjusted next-token distribution at the context
    first_tokens: list[int]  # the first committed token of every repetition
    records: list[IterationRecord]  # every repetition's iteration (trace and analysis included)

    def chi_square(self) -> tuple[float, int]:
        """Statistic and degrees of freedom; bins expected below 5 are merged into one."""
        counts = torch.zeros_like(self.target_law)
        for tok, n in Counter(self.first_tokens).items():
            counts[tok] = n
        expected = self.target_law * len(self.first_tokens)
        big = expected >= 5
        obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
        exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
        keep = exp > 0
        return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), max(int(keep.sum()) - 1, 1)

    def table(self, decode_token: Callable[[int], str] = str, top: int = 15) -> list[dict]:
        """The target's likeliest tokens (and any token drawn), target probability vs frequency."""
        counts, n = Counter(self.first_tokens), len(self.first_tokens)
        tokens = self.target_law.topk(min(top, self.target_law.numel())).indices.tolist()
        tokens += [t for t in counts if t not in tokens]
        rows = [
            {"token": decode_token(t), "id": t, "target p": float(self.target_law[t]), "observed": counts[t] / n}
            for t in tokens
        ]
        return sorted(rows, key=lambda r: -r["target p"])


def chi_square_critical(dof: int, z: float = 3.0902) -> float:
    """Chi-square quantile at significance 0.001 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@torch.inference_mode()
def run_lab(
    target: torch.nn.Module,
    context: list[int],
    policy: Policy,
    config: DecodeConfig,
    trials: int,
    *,
    draft: torch.nn.Module | None = None,
    draft_token_map: TokenMap | None = None,
    progress: Callable[[int], None] | None = None,
) -> LabResult:
    """`trials` independent single steps (seeds 0..trials-1) of `policy` + config.verifier."""
    device = target.get_input_embeddings().weight.device
    logits = target(torch.tensor([context], device=device)).logits[0, -1]
    law = adjust(logits, config.sampling).cpu()
    firsts, records = [], []
    for i in range(trials):
        step = dataclasses.replace(config, seed=i, analyze=True)
        rec = next(decode(target, context, policy, draft=draft, config=step, draft_token_map=draft_token_map))
        firsts.append(rec.committed[0])
        records.append(rec)
        if progress:
            progress(i + 1)
    return LabResult(law, firsts, records)
