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
from dynatree_core.core.tree import DraftTree
from dynatree_core.drafts.session import Drafter


@dataclasses.dataclass(kw_only=True)
class DraftRequest:
    """What the engine hands a policy each iteration (built by keyword: every field is named)."""

    root_token: int
    max_depth: int  # deepest level that max_new_tokens and the context window allow
    drafter: Drafter | None
    context: list[int] = dataclasses.field(default_factory=list)  # committed tokens, root last (read only)
    # Sampled drafting: "top" (deterministic top-k), "iid" or "without_replacement", with the
    # adjusted draft distribution (temperature / top-k / top-p, as the target's) and a generator
    draw: str = "top"
    sampling: Any = None
    gen: torch.Generator | None = None
    # greedy drafting's levels (drafting/device.py) the GPU's way: at fixed widths, read late and
    # once per tree; off: each level's count read at once, the next rows exactly the children to expand
    on_device: bool = False
    # the engine's verify forward, queued from the tree's rows on the device before the host reads
    # the tree (decoding/batch.EarlyVerify; drafting/levels.read_verifying calls it); None: the
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


def sampled_children(request: DraftRequest, tree: DraftTree, node: int, q: torch.Tensor, k: int) -> list[tuple]:
    """Sampled drafting: (token, logp) of `node`'s children, from k draws from the adjusted draft
    distribution `q` (the node's row of `level_q`; recorded on the tree for the verifier), their
    distinct tokens in drawing order, logp = log q_adjusted(token). Greedy trees are tensor levels
    (device.py)."""
    draw = tree.record_draws(node, q)
    q = draw.dense()  # the recorded q, exactly as the verifier and an export will read it
    k = min(k, int((q > 0).sum())) if request.draw == "without_replacement" else k
    draw.tokens.extend(torch.multinomial(q, k, replacement=request.draw == "iid", generator=request.gen).tolist())
    return [(tok, math.log(float(q[tok]))) for tok in dict.fromkeys(draw.tokens)]
