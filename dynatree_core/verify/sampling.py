"""Lossless verification for sampling (delayed-tree-expansion paper §3) and its registry.

Top-down (OT-based, §3.2): at each node from the root, p is the target's adjusted distribution,
q the draft's adjusted distribution its children were drawn from, and `draws` those children
with multiplicity, in drawing order. The node solver (verify/otlp.py) returns Y ~ p; if Y is a
verified child the walk moves there, otherwise Y is committed as the correction token. At a
node without draws (a leaf) Y is sampled from p: the bonus token. A pruned child that the solver
returns is committed and ends the walk (its subtree was never verified), which keeps Y ~ p.

Bottom-up (verify/traversal.py): Traversal verification, and block verification on a path.

Every verifier leaves a trace (which child was tried at each node, its acceptance probability,
the uniform draw, the residual after a rejection, where the walk stopped) and, on request, the
per-node analysis the app compares with what happened: the closed-form acceptance rate of the
OT solvers (App. C) and the branching probability of every child given the draws (App. D).
"""

from __future__ import annotations

import torch

from dynatree_core.core.sampling_config import SamplingConfig, adjust
from dynatree_core.core.transfer import to_host, to_list
from dynatree_core.core.tree import DraftTree
from dynatree_core.errors import DynaTreeError
from dynatree_core.verify.greedy import Outcome, verified_children
from dynatree_core.verify.otlp import SOLVERS, acceptance
from dynatree_core.verify.registry import IID, VERIFIERS, WITHOUT_REPLACEMENT
from dynatree_core.verify.traversal import WalkSpec, walk, walk_law


def target_distributions(order: list[int], logits: torch.Tensor, sampling: SamplingConfig) -> dict[int, torch.Tensor]:
    probs = adjust(logits, sampling).cpu()
    return {node: probs[i] for i, node in enumerate(order)}


def walk_spec(tree: DraftTree, order: list[int], p: dict[int, torch.Tensor], draw: str) -> WalkSpec:
    q = {n: d.dense() for n, d in tree.sampled.items()}
    draws = {n: d.tokens for n, d in tree.sampled.items() if d.tokens}
    return WalkSpec(p, q, draws, verified_children(tree, order), draw == WITHOUT_REPLACEMENT)


def verify_sampling(
    tree: DraftTree,
    order: list[int],
    logits: torch.Tensor,
    sampling: SamplingConfig,
    verifier: str,
    gen: torch.Generator | None,
    draw: str = IID,
) -> Outcome:
    target_tokens = to_list(logits.argmax(dim=-1))
    trace: list[dict] = []
    if VERIFIERS[verifier].direction == "bottom-up":
        if verifier == "block" and any(len(d.tokens) > 1 for d in tree.sampled.values()):
            raise DynaTreeError("block verification needs a single path: every node may draw one child")
        p = target_distributions(order, logits, sampling)  # the walk may visit every node
        accepted, token = walk(walk_spec(tree, order, p, draw), gen, trace)
        return Outcome(accepted=accepted, bonus_token=token, target_tokens=target_tokens, order=order, trace=trace)
    sample, _ = SOLVERS[verifier]
    children = verified_children(tree, order)
    row = {n: i for i, n in enumerate(order)}
    accepted, node = [], 0
    while True:
        start = len(trace)
        draws = tree.draws(node)
        p = to_host(adjust(logits[row[node]], sampling))  # only the nodes the walk reaches
        if draws:
            y, _ = sample(p, tree.sampled[node].dense(), draws, gen, trace)
        else:
            y, _ = SOLVERS["nss"][0](p, None, [], gen, trace)
        for event in trace[start:]:
            event["node"] = node
            if event["kind"] == "test":
                event["child"] = children.get(node, {}).get(event["token"])
        nxt = children.get(node, {}).get(y)
        if nxt is None:
            return Outcome(accepted=accepted, bonus_token=y, target_tokens=target_tokens, order=order, trace=trace)
        accepted.append(nxt)
        node = nxt


def analyze(
    tree: DraftTree, order: list[int], logits: torch.Tensor, sampling: SamplingConfig, verifier: str, draw: str
) -> dict[str, dict]:
    """Per verified node: the probability that this verification reaches it given the drawn tree
    ("reach"; the root's is 1) and, at nodes with draws, the expected acceptance averaged over the
    draws (closed form, App. C; Khisti's is a lower bound) — what the app sets against what
    happened. Keys are node ids as strings (JSON)."""
    p = target_distributions(order, logits, sampling)
    reach = {0: 1.0}
    if VERIFIERS[verifier].direction == "bottom-up":
        for prob, nodes, _ in walk_law(walk_spec(tree, order, p, draw)):
            for n in nodes:
                reach[n] = reach.get(n, 0.0) + prob
    else:
        _, distribution = SOLVERS[verifier]
        children = verified_children(tree, order)
        for node in order:  # BFS or DFS: a parent always comes before its children
            draws = tree.draws(node)
            if not draws or node not in reach:
                continue
            law = distribution(p[node], tree.sampled[node].dense(), draws)
            for token, child in children.get(node, {}).items():
                reach[child] = reach[node] * float(law[token])
    out = {}
    for node in order:
        entry = {"reach": reach.get(node, 0.0)}
        draws = tree.draws(node)
        if draws and verifier in ("nss", "naive", "spectr", "specinfer", "khisti"):
            entry["expected_acceptance"] = acceptance(verifier, p[node], tree.sampled[node].dense(), len(draws))
        out[str(node)] = entry
    return out
