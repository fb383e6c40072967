"""Verification Lab: repeat one speculative step many times on a fixed context and compare the
first committed token's empirical law with the target's own next-token distribution.

Each repetition drafts a fresh tree (its own seed) and verifies it with one target forward, as
the engine does, so the histogram tests the whole draft -> verify path, not just a solver.

`lab_report` keeps a result as a report a page reads with no model loaded (`lab --out`, the
Verification Lab's opening experiment); `lab_from_report` reads it back with the same statistic.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import torch

from dynatree_core.core.sampling_config import adjust
from dynatree_core.core.tree import Reason
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.engine import DecodeConfig, decode, iterate, replace_root, start_run
from dynatree_core.drafting.policy import Policy
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.metrics import acceptance_by_depth
from dynatree_core.runs.records import IterationRecord

LAB_VERSION = 1
LAW_KEPT = 1000  # a report keeps the law's likeliest tokens (and every drawn one); the rest is one mass


@dataclasses.dataclass
class LabResult:
    target_law: torch.Tensor  # the target's adjusted next-token distribution at the context
    first_tokens: list[int]  # the first committed token of every repetition
    records: list[IterationRecord]  # every repetition's iteration (trace and analysis included)
    by_depth: list[dict] | None = None  # read from a report (no records): acceptance by depth

    def depth_rows(self) -> list[dict]:
        """Expected vs realised acceptance by depth (runs.metrics.acceptance_by_depth)."""
        return acceptance_by_depth(self.records) if self.records else list(self.by_depth or [])

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
        """The `top` tokens by the larger of target probability and observed frequency, most likely
        first, then one row for all the others (id -1): target p vs frequency, each summing to 1."""
        counts, n = Counter(self.first_tokens), len(self.first_tokens)
        weight = self.target_law.clone()
        for tok, c in counts.items():
            weight[tok] = max(float(weight[tok]), c / n)
        tokens = weight.topk(min(top, weight.numel())).indices.tolist()
        rows = [
            {"token": decode_token(t), "id": t, "target p": float(self.target_law[t]), "observed": counts[t] / n}
            for t in tokens
        ]
        rows.sort(key=lambda r: -r["target p"])
        rest_p = max(1.0 - sum(r["target p"] for r in rows), 0.0)
        rest_seen = (n - sum(counts[t] for t in tokens)) / n
        if rest_p > 1e-9 or rest_seen > 0:
            rows.append({"token": "(all others)", "id": -1, "target p": rest_p, "observed": rest_seen})
        return rows


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
    firsts, records, warm = [], [], False
    for i in range(trials):
        step = dataclasses.replace(config, seed=i, analyze=True)
        rec = _step(target, context, policy, step, draft, draft_token_map, warm)
        if i == 0 and rec.tree.reason[0] == Reason.NO_FEATURES.value and len(context) > 1:
            warm = True  # a feature draft: every step from the warmed state, this one again
            rec = _step(target, context, policy, step, draft, draft_token_map, warm)
        firsts.append(rec.committed[0])
        records.append(rec)
        if progress:
            progress(i + 1)
    return LabResult(law, firsts, records)


def _step(target, context, policy, config, draft, draft_token_map, warm: bool) -> IterationRecord:
    """One draft -> verify step whose first committed token follows `context`. `warm`: a draft
    that reads the target's features (a feature draft has none before the target's first forward,
    so a run's first iteration is the prefill alone) gets them from a prefill of all but the last
    token; the token that prefill commits is then replaced by the context's last, so the step's
    tree is rooted at it with the features of the tokens before, as every later iteration is. The
    verification is lossless whatever the draft proposed, so the law under test is the target's."""
    if not warm:
        return next(decode(target, context, policy, draft=draft, config=config, draft_token_map=draft_token_map))
    config = dataclasses.replace(config, max_new_tokens=config.max_new_tokens + 1, eos_token_ids=frozenset())
    state = start_run(target, context[:-1], policy, draft=draft, config=config, draft_token_map=draft_token_map)
    steps = iterate(state)
    if len(next(steps).committed) != 1:  # the prefill alone commits the one token replaced here
        raise RuntimeError("the warming prefill drafted a tree; only a feature draft is warmed")
    replace_root(state, context[-1])
    return next(steps)


def lab_report(result: LabResult, decode: Callable[[int], str], about: dict) -> dict:
    """`result` as a report: the law's LAW_KEPT likeliest tokens and every drawn token, with their
    texts; the draws; acceptance by depth; and `about` (verifier, policy, params, sampling, context,
    models, environment, date, command). The tokens left out each hold less than 1/LAW_KEPT, so
    below 2,000 draws each expects fewer than 5 and falls in the merged bin: the statistic reads back
    unchanged (`lab_from_report`)."""
    law = result.target_law
    kept = sorted(set(law.topk(min(LAW_KEPT, law.numel())).indices.tolist()) | set(result.first_tokens))
    return {
        "version": LAB_VERSION,
        **about,
        "vocab": law.numel(),
        "law": {str(t): float(law[t]) for t in kept},
        "texts": {str(t): decode(t) for t in kept},
        "first_tokens": list(result.first_tokens),
        "by_depth": result.depth_rows(),
    }


def lab_from_report(data: dict) -> LabResult:
    """A report back as a LabResult (no records: its acceptance by depth as stored); the law's
    left-out mass spread evenly over the tokens left out."""
    try:
        vocab, kept = int(data["vocab"]), {int(t): float(p) for t, p in data["law"].items()}
        law = torch.zeros(vocab)
        law[list(kept)] = torch.tensor(list(kept.values()))
        if vocab > len(kept):
            rest = torch.ones(vocab, dtype=torch.bool)
            rest[list(kept)] = False
            law[rest] = max(1.0 - float(law.sum()), 0.0) / (vocab - len(kept))
        return LabResult(law, [int(t) for t in data["first_tokens"]], [], by_depth=list(data.get("by_depth", [])))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise DynaTreeError(f"not a lab report: {exc}") from None
