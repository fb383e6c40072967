"""Bottom-up verification: Traversal verification (Weng et al. 2025) and, on a single path, block
verification (Sun et al. 2024c); delayed-tree-expansion paper §3.1-3.2.

The tree is visited in post-order (children before their parent, first-drawn child first). Each
node carries a weight w (its acceptance probability when it is the current leaf), the target's
distribution P and the draft's Q it drew its children from. Starting weights follow the sequence
ratio, clipped at every step (§3.1: w(a_1:i) = min(1, w(a_1:i-1) p(a_i) / q(a_i))). The current
leaf is accepted with probability w: its path is committed and the correction token is drawn from
its P. A rejected child x of node c updates c (the "w-weighted naive residual" of BV):

    P_c <- (w_c P_c - Q_c)+ / Z,   w_c <- Z / sum (Q_c - w_c P_c)+,   Z = sum (w_c P_c - Q_c)+

and, for children drawn without replacement, Q_c loses x (the next sibling was drawn from q
without x); the later children's weights are recomputed from the updated c. Why it is lossless,
by induction from the leaves: a node entered with weight w ends up accepting a continuation s
with probability w * P(s) and rejecting itself with probability 1 - w. A child x drawn from Q
takes min(Q(x), w P(x)) of the mass w P(x); what is missing, (w P - Q)+, plus the 1 - w of
rejecting c, is exactly the rejection mass sum (Q - w P)+, which the update hands to the rest
of the walk. On a path (one child per node) this is BV's h_i and residual; at the root w stays 1,
so the walk always commits at least one token. The tests check the law exactly on small trees.

Children drawn i.i.d. with the same token share one node (and one subtree): the first draw walks
the subtree, a repeated draw is a leaf test of that node with its original P. A drawn child the
policy pruned (never sent to the target) is a leaf whose acceptance commits its token and ends
the iteration: its continuation is the next iteration's, drawn from the target then.
"""

from __future__ import annotations

import dataclasses

import torch

from dynatree_core.verify.otlp import EPS, draw_from, top_tokens, uniform_draw


@dataclasses.dataclass
class WalkSpec:
    """What a bottom-up walk needs, keyed by node id (0 = root)."""

    p: dict[int, torch.Tensor]  # target distribution at every verified node
    q: dict[int, torch.Tensor]  # draft distribution at every node with draws
    draws: dict[int, list[int]]  # drawn tokens with multiplicity, drawing order
    children: dict[int, dict[int, int]]  # verified children: token -> node
    without_replacement: bool = False


class _Decider:
    """Random decisions of a walk; the trace records each one."""

    def __init__(self, gen: torch.Generator | None, trace: list | None):
        self.gen, self.trace = gen, trace

    def test(self, node: int, child: int | None, token: int | None, prob: float) -> bool:
        u = uniform_draw(self.gen)
        if self.trace is not None:
            self.trace.append(
                {
                    "kind": "test",
                    "node": node,
                    "child": child,
                    "token": token,
                    "prob": prob,
                    "u": u,
                    "accepted": u <= prob,
                }
            )
        return u <= prob

    def residual(self, node: int, dist: torch.Tensor, weight: float) -> None:
        if self.trace is not None:
            self.trace.append({"kind": "residual", "node": node, "top": top_tokens(dist), "weight": weight})

    def finish(self, node: int, dist: torch.Tensor, source: str):
        y = draw_from(dist, self.gen)
        if self.trace is not None:
            self.trace.append({"kind": "sample", "node": node, "token": y, "source": source})
        return y


class _Scripted(_Decider):
    """Replays a fixed list of test outcomes; asks for a new one by raising _Branch."""

    def __init__(self, script: list[bool]):
        super().__init__(None, None)
        self.script, self.used = script, 0

    def test(self, node, child, token, prob):
        if self.used == len(self.script):
            raise _Branch(prob)
        self.used += 1
        return self.script[self.used - 1]

    def residual(self, node, dist, weight):
        pass

    def finish(self, node, dist, source):
        return dist  # the exact law of the correction token


class _Branch(Exception):
    def __init__(self, prob: float):
        self.prob = prob


def _ratio_weight(w: float, p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    return 1.0 if q[x] <= EPS else min(1.0, w * float(p[x]) / float(q[x]))


def after_rejection(w: float, P: torch.Tensor, Q: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Hand the mass a rejected child leaves behind to the rest of the walk at its parent:
    P <- (w P - Q)+ / Z and w <- Z / sum (Q - w P)+ (BV's residual and h_i, Sun et al. 2024c)."""
    excess = (w * P - Q).clamp_min(0)
    deficit = float((Q - w * P).clamp_min(0).sum())
    if deficit <= EPS:  # a rejection had probability 0: nothing to hand over
        return w, P
    if float(excess.sum()) <= EPS:
        return 0.0, P
    return min(1.0, float(excess.sum()) / deficit), excess / excess.sum()


def _visit(spec: WalkSpec, node: int, w: float, decide: _Decider):
    """Walk the subtree of `node` (entered with weight w). Returns (accepted nodes below `node`,
    final token or law) or None when `node` itself is rejected."""
    P = spec.p[node]
    Q = spec.q.get(node)
    seen: set[int] = set()
    for x in spec.draws.get(node, []):
        child = spec.children.get(node, {}).get(x)
        wx = _ratio_weight(w, P, Q, x)
        if child is not None and x not in seen:
            seen.add(x)
            found = _visit(spec, child, wx, decide)
            if found is not None:
                return [child, *found[0]], found[1]
        elif decide.test(node, child, x, wx):  # a repeated draw, or a pruned child: a leaf
            if child is None:
                return [], x  # the pruned token is committed; its continuation is the next iteration's
            return [child], decide.finish(child, spec.p[child], "p")
        w, P = after_rejection(w, P, Q)  # x's subtree was rejected
        decide.residual(node, P, w)
        if spec.without_replacement:
            Q = Q.clone()
            Q[x] = 0.0
            Q = Q / Q.sum() if Q.sum() > EPS else Q
    if decide.test(node, node, None, w):
        return [], decide.finish(node, P, "p" if P is spec.p[node] else "residual")
    return None


def walk(spec: WalkSpec, gen: torch.Generator | None = None, trace: list | None = None) -> tuple[list[int], int]:
    """Sample: (accepted node ids, root excluded, root-to-leaf; the token committed after them)."""
    found = _visit(spec, 0, 1.0, _Decider(gen, trace))
    if found is None:  # unreachable in exact arithmetic (the root's weight stays 1)
        return [], draw_from(spec.p[0], gen)
    return found


def walk_law(spec: WalkSpec) -> list[tuple[float, list[int], torch.Tensor | int]]:
    """The exact law of `walk`: [(probability, accepted nodes, law of the final token or the
    committed pruned token)], by enumerating the accept/reject outcomes of every test."""
    out, stack = [], [([], 1.0)]
    while stack:
        script, prob = stack.pop()
        try:
            found = _visit(spec, 0, 1.0, _Scripted(script))
        except _Branch as branch:
            if branch.prob > 0:
                stack.append(([*script, True], prob * branch.prob))
            if branch.prob < 1:
                stack.append(([*script, False], prob * (1 - branch.prob)))
            continue
        if found is not None and prob > 0:
            out.append((prob, found[0], found[1]))
    return out
