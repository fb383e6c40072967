"""Lossless top-down verification for sampling (delayed-tree-expansion paper §3.2).

At each node from the root: p is the target's adjusted distribution there, q the draft's
adjusted distribution its children were drawn from, and `draws` those children with
multiplicity, in drawing order. The node solver (verify/otlp.py) returns Y ~ p; if Y is a
verified child the walk moves there, otherwise Y is committed as the correction token. At a
node without draws (a leaf) Y is sampled from p: the bonus token. A pruned child that the solver
returns is committed and ends the walk (its subtree was never verified), which keeps Y ~ p.
"""

from __future__ import annotations

import dataclasses

import torch

from dynatree_core.sampling import SamplingConfig, adjust
from dynatree_core.tree import DraftTree
from dynatree_core.verify.greedy import Outcome, verified_children
from dynatree_core.verify.otlp import SOLVERS


@dataclasses.dataclass(frozen=True)
class VerifierSpec:
    name: str
    draw: str  # how the tree's children must be drawn: "iid", "without_replacement" or "any"
    summary: str


VERIFIERS = {
    "greedy": VerifierSpec("greedy", "any", "temperature 0: the longest path matching the target's argmax"),
    "nss": VerifierSpec("nss", "any", "sample from the target, follow the tree while it matches (any tree)"),
    "naive": VerifierSpec("naive", "iid", "speculative sampling on the first child, residual (p - q)+ otherwise"),
    "spectr": VerifierSpec("spectr", "iid", "SpecTr K-SEQ with the division factor rho*"),
    "specinfer": VerifierSpec("specinfer", "iid", "recursive rejection over i.i.d. children, residual updates"),
    "without_replacement": VerifierSpec(
        "without_replacement",
        "without_replacement",
        "recursive rejection for children drawn without replacement (DySpec / Sequoia)",
    ),
}


def verify_sampling(
    tree: DraftTree,
    order: list[int],
    logits: torch.Tensor,
    sampling: SamplingConfig,
    solver: str,
    gen: torch.Generator | None,
) -> Outcome:
    sample, _ = SOLVERS[solver]
    target_tokens = logits.argmax(dim=-1).tolist()
    row = {node: i for i, node in enumerate(order)}
    children = verified_children(tree, order)
    accepted, node = [], 0
    while True:
        p = adjust(logits[row[node]], sampling).cpu()
        draws = tree.draws.get(node)
        if draws:
            y, _ = sample(p, tree.draft_q[node], draws, gen)
        else:
            y = int(torch.multinomial(p, 1, generator=gen))
        nxt = children.get(node, {}).get(y)
        if nxt is None:
            return Outcome(accepted=accepted, bonus_token=y, target_tokens=target_tokens, order=order)
        accepted.append(nxt)
        node = nxt
