"""What the engine hands a policy each iteration (`DraftRequest`), and the per-level helpers every
policy uses to read a level's draft distributions: the top-k of every row in one host copy, the
adjusted distribution for sampled drafting, and the children of one node."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from dynatree_core.core.sampling_config import adjust
from dynatree_core.core.transfer import to_host, to_list
from dynatree_core.core.tree import SampledDraw
from dynatree_core.drafts.session import Drafter


@dataclasses.dataclass(kw_only=True)
class DraftRequest:
    """What the engine hands a policy each iteration (built by keyword: every field is named)."""

    root_token: int
    max_depth: int  # deepest level that max_new_tokens and the context window allow
    drafter: Drafter | None
    context: list[int] = dataclasses.field(default_factory=list)  # committed tokens, root last (read only)
    vocab: int = 0  # the target's vocabulary size (0: unknown): retrieval from a static corpus stays below it
    # Sampled drafting: "top" (deterministic top-k), "iid" or "without_replacement", with the
    # adjusted draft distribution (temperature / top-k / top-p, as the target's) and a generator
    draw: str = "top"
    sampling: Any = None
    gen: torch.Generator | None = None
    # greedy drafting's levels (drafting/device.py) the GPU's way: at fixed widths, read late and
    # once per tree; off: each level's count read at once, the next rows exactly the children to expand
    on_device: bool = False
    # the engine's verify forward, queued from the tree's rows on the device before the host reads
    # the tree (decoding/batch.EarlyVerify; drafting/tensor_tree.TensorTree.read calls it); None: the
    # engine builds the verify batch from the tree on the host
    early: Any = None


def level_top(logp: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """The top-k log-probabilities and tokens of every row of a level, in ONE copy to the host
    (a per-row `.tolist()` of a GPU tensor is a host sync per node). Token ids ride along as
    float32, exact below 2^24 (every vocabulary we load)."""
    top_lp, top_tok = logp.topk(min(k, logp.shape[-1]), dim=-1)
    both = to_list(torch.cat([top_lp.float(), top_tok.float()], dim=-1))
    width = top_lp.shape[-1]
    return [row[:width] for row in both], [[int(t) for t in row[width:]] for row in both]


def level_q(request: DraftRequest, logp: torch.Tensor) -> torch.Tensor | None:
    """Sampled drafting: the adjusted draft distribution of every row of a level on the host, in
    ONE copy (the per-node draws need it there); None for top-k drafting."""
    if request.draw == "top":
        return None
    return to_host(adjust(logp, request.sampling).to(torch.float16))  # rounded once: what a draw records


class SampledLevels:
    """Sampled drafting's reading of a level (drafting/device.admitted_levels' `draw`): each row's
    children drawn from its adjusted draft distribution, on the host with the run's generator, row
    by row in the level's order (what the papers' loops do node by node). A row's q is rounded to
    float16 once (`level_q`) and drawn from as recorded (SampledDraw.dense: what the verifier and an
    export read); `rows` keeps every row's (q, draws), level by level, for the tree view
    (TensorTree.view records them on the rows' nodes)."""

    def __init__(self, request: DraftRequest):
        self.request, self.rows = request, []

    def __call__(self, logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities (rows, k) float64, tokens (rows, k)) of each row's distinct draws in
        drawing order, logp = log q_adjusted(token); NaN after the last (not a candidate: iid draws
        that repeat, fewer nonzero entries than k)."""
        request = self.request
        rows = level_q(request, logp)
        lp = torch.full((rows.shape[0], k), math.nan, dtype=torch.float64)
        tokens = torch.zeros(rows.shape[0], k, dtype=torch.long)
        for r, q16 in enumerate(rows):
            q = SampledDraw.of(q16).dense()  # the recorded q, exactly as the verifier will read it
            n = min(k, int((q > 0).sum())) if request.draw == "without_replacement" else k
            drawn = torch.multinomial(q, n, replacement=request.draw == "iid", generator=request.gen).tolist()
            self.rows.append((q16, drawn))
            distinct = list(dict.fromkeys(drawn))
            tokens[r, : len(distinct)] = torch.tensor(distinct)
            lp[r, : len(distinct)] = torch.tensor([math.log(float(q[t])) for t in distinct], dtype=torch.float64)
        return lp, tokens
