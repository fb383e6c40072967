"""Delayed tree expansion (delayed-tree-expansion-and-verification-algorithms.md §5, Def. 5.2)
and a model-free prompt-lookup tree.

  delayed        a trunk of L1 draft tokens, then K branches of L2 tokens each. Greedy drafting
                 makes the paper's K i.i.d. branches identical, so the branches start from the
                 draft's top-K tokens at the trunk's end and continue with the top token. One
                 draft forward per level: L1 + L2 forwards.
  ngram          prompt lookup as a tree: the continuations that followed earlier occurrences of
                 the context's last n tokens, merged into a trie (no draft model).
"""

from __future__ import annotations

import math
import time

from dynatree_core.core.transfer import to_list
from dynatree_core.core.tree import DraftTree, Reason, Source, Status
from dynatree_core.drafting.common import drafter_of, leaf_reason
from dynatree_core.drafting.device import grow_all_levels
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest, SampledLevels
from dynatree_core.drafting.sources import listed_tree


def grow_delayed(
    request: DraftRequest, k: int, l1: int, l2: int, *, tree: DraftTree | None = None, root_logp=None
) -> DraftTree:
    """The (K, L1, L2) delayed tree, cut at the request's max depth. `tree` and `root_logp` pass in
    a root that was already run through the draft (`expand_level` for greedy drafting)."""
    cap = min(l1 + l2, request.max_depth)
    widths = [k if level == l1 else 1 for level in range(cap)]  # the branch point is the trunk's last node
    draw = None if request.draw == "top" else SampledLevels(request)  # sampled: each row's draws
    return grow_all_levels(request, widths, reason=leaf_reason(cap, l1 + l2), tree=tree, root=root_logp, draw=draw)


@register_policy
class Delayed(Policy):
    """Static delayed tree: trunk of L1 tokens, then K branches of L2 tokens (§5, Def. 5.2)."""

    name = "delayed"
    draws = ("top", "iid", "without_replacement")
    summary = "Delayed expansion: a trunk of L1 tokens, then K branches of L2 tokens"
    params = (
        Param("k", int, 2, 1, 8, "K: branches at the end of the trunk"),
        Param("l1", int, 2, 0, 16, "L1: trunk length before branching"),
        Param("l2", int, 3, 0, 16, "L2: length of each branch"),
    )

    def local_shape(self) -> bool:
        return True  # no budget: every branch grows to its length

    def draft(self, request: DraftRequest) -> DraftTree:
        c = self.config
        return grow_delayed(request, c["k"], c["l1"], c["l2"])


@register_policy
class DelayedAuto(Policy):
    """Delayed tree with (K, L1, L2) chosen every iteration by a cost model (§6, Eq. 4 and 11).

    The paper's selector is a trained MLP; this one maximises the same objective, expected
    block efficiency over expected time (Eq. 4 with a one-hot policy), from root features:
      E[tau + 1] = 1 + c1 (1 + a + ... + a^(L1-1)) + c1 a^(L1-1) s_K (1 + a + ... + a^(L2-1)) for
      L1 > 0, and 1 + s_K (1 + a + ... + a^(L2-1)) for L1 = 0, where c1 and s_K are the draft's
      top-1 and top-K probability at the root (acceptance ~ draft probability, DySpec Hyp. 1) and
      a is a running average of the draft's top-1 probability along the trunks drafted so far;
      T = sum_{j<L1} t_q(1) + sum_{j<L2} t_q(K) + t_p(L1 + K L2 + 1)   (Eq. 11, per forward width),
    with t_q and t_p linear fits (ms = a + b * tokens) of this run's measured draft and target
    forwards (`observe_cost`); until enough are measured, the static (k, l1, l2) is used.
    The root's draft forward is shared with the chosen tree: no extra forward.
    """

    name = "delayed_auto"
    draws = ("top", "iid", "without_replacement")
    summary = "Delayed tree with (K, L1, L2) chosen per iteration by a latency + acceptance cost model"
    params = (
        Param("k_max", int, 4, 1, 8, "Largest K considered"),
        Param("l1_max", int, 6, 0, 16, "Largest trunk L1 considered"),
        Param("l2_max", int, 3, 1, 16, "Largest branch length L2 considered"),
        Param("k", int, 2, 1, 8, "K used until the latency profile is measured"),
        Param("l1", int, 2, 0, 16, "L1 used until the latency profile is measured"),
        Param("l2", int, 3, 0, 16, "L2 used until the latency profile is measured"),
        Param("warmup", int, 3, 0, 64, "Iterations with the static (k, l1, l2) before the cost model decides"),
    )

    def __init__(self, **values):
        super().__init__(**values)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.target_obs: list[tuple[int, float]] = []  # (tokens read, ms)
        self.draft_obs: list[tuple[int, float]] = []  # (nodes in the forward, ms)
        self.alpha = 0.6  # running top-1 probability below the root
        self.iterations = 0
        self.choices: list[tuple[int, int, int]] = []

    def observe_cost(self, tokens: int, verify_ms: float) -> None:
        self.target_obs = [*self.target_obs[-63:], (tokens, verify_ms)]

    @staticmethod
    def _fit(obs: list[tuple[int, float]]) -> tuple[float, float]:
        """ms = a + b * n, least squares; one distinct n gives a flat fit."""
        n = len(obs)
        mx, my = sum(x for x, _ in obs) / n, sum(y for _, y in obs) / n
        var = sum((x - mx) ** 2 for x, _ in obs)
        b = max(sum((x - mx) * (y - my) for x, y in obs) / var, 0.0) if var > 0 else 0.0
        return max(my - b * mx, 0.0), b

    def expected_tokens(self, c1: float, s_k: float, l1: int, l2: int) -> float:
        a = self.alpha
        chain = lambda n: sum(a**i for i in range(n))  # noqa: E731
        if l1 == 0:
            return 1.0 + s_k * chain(l2)
        return 1.0 + c1 * chain(l1) + c1 * a ** (l1 - 1) * s_k * chain(l2)

    def choose(self, root_probs: list[float], max_depth: int) -> tuple[int, int, int]:
        c = self.config
        if self.iterations < c["warmup"] or len(self.target_obs) < 2 or len(self.draft_obs) < 2:
            return c["k"], c["l1"], c["l2"]
        (qa, qb), (pa, pb) = self._fit(self.draft_obs), self._fit(self.target_obs)
        best, best_rate = (c["k"], c["l1"], c["l2"]), -1.0
        for k in range(1, c["k_max"] + 1):
            s_k = sum(root_probs[:k])
            for l1 in range(0, c["l1_max"] + 1):
                for l2 in range(1 if k > 1 else 0, c["l2_max"] + 1):
                    if l1 + l2 > max_depth or (k > 1 and l2 == 0):
                        continue
                    t = l1 * (qa + qb) + l2 * (qa + qb * k) + pa + pb * (l1 + k * l2 + 1)  # Eq. 11
                    rate = self.expected_tokens(root_probs[0], s_k, l1, l2) / max(t, 1e-6)  # Eq. 4
                    if rate > best_rate:
                        best, best_rate = (k, l1, l2), rate
        return best

    def local_shape(self) -> bool:
        return True  # (K, L1, L2) is chosen from the root's draft distribution, before any draw

    def draft(self, request: DraftRequest) -> DraftTree:
        drafter = drafter_of(request)
        tree = DraftTree.with_root(request.root_token)
        if request.max_depth <= 0:
            tree.mark_leaf(0, Reason.LENGTH_LIMIT)
            return tree
        start = time.perf_counter()
        # the root's forward, shared with the tree: its tensor levels after it (device.py)
        root_logp = drafter.expand_level(None, None, 0)
        root_ms = (time.perf_counter() - start) * 1e3
        probs = to_list(root_logp[0].exp().topk(self.config["k_max"]).values)  # one read, counted
        k, l1, l2 = self.choose(probs, request.max_depth)
        self.choices.append((k, l1, l2))
        tree.notes = {"k": [float(k)], "l1": [float(l1)], "l2": [float(l2)]}
        forwards = drafter.forwards
        start = time.perf_counter()
        tree = grow_delayed(request, k, l1, l2, tree=tree, root_logp=root_logp)
        more = drafter.forwards - forwards
        if more:  # the mean cost of the later forwards, at their mean width (nodes run / forwards)
            ran = sum(1 for n in range(1, len(tree)) if tree.status[n] == Status.KEPT)
            self.draft_obs = [*self.draft_obs[-63:], (max(ran // more, 1), (time.perf_counter() - start) * 1e3 / more)]
        self.draft_obs = [*self.draft_obs[-63:], (1, root_ms)]
        trunk = [n for n in range(1, len(tree)) if tree.depths[n] <= l1]
        if trunk:  # track the draft's confidence below the root
            conf = math.exp(sum(tree.logp[n] for n in trunk) / len(trunk))
            self.alpha = 0.8 * self.alpha + 0.2 * conf
        self.iterations += 1
        return tree


@register_policy
class NGramLookup(Policy):
    """Prompt lookup as a tree (model-free): for n from max_n down to min_n, find earlier
    occurrences of the context's last n tokens (most recent first) and collect the tokens that
    followed them, up to `branches` distinct continuations of `depth` tokens; merge them into a
    trie. A node's p is the share of its parent's continuations that pass through it."""

    name = "ngram"
    family = "retrieved"
    summary = "Prompt lookup tree: continuations of earlier matches of the last n tokens (no draft)"
    needs_draft_model = False
    params = (
        Param("max_n", int, 3, 1, 8, "Longest suffix to match"),
        Param("min_n", int, 1, 1, 8, "Shortest suffix to match"),
        Param("depth", int, 6, 1, 32, "Tokens per continuation"),
        Param("branches", int, 3, 1, 16, "Distinct continuations merged into the tree"),
        Param("budget", int, 32, 1, 256, "Node budget"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        c = self.config
        tree = DraftTree.with_root(request.root_token)
        depth = min(c["depth"], request.max_depth)
        conts = self.continuations(request.context, depth) if depth > 0 else []
        if not conts:
            tree.mark_leaf(0, Reason.NO_MATCH if depth > 0 else Reason.LENGTH_LIMIT)
            return tree
        counts: dict[tuple[int, ...], int] = {}
        for cont in conts:
            for i in range(1, len(cont) + 1):
                counts[cont[:i]] = counts.get(cont[:i], 0) + 1
        extended = {path[:-1] for path in counts}  # the paths with a continuation
        levels: list[list[tuple]] = []
        row_of: dict[tuple[int, ...], int] = {(): 0}
        # the trie's paths parents first, then by support, up to the budget (a parent has at least
        # its child's support, so it comes first); each a node of its level (sources.listed_tree)
        for path in sorted(counts, key=lambda p: (len(p), -counts[p]))[: c["budget"]]:
            if len(path) > len(levels):
                levels.append([])
            share = counts[path] / (counts[path[:-1]] if path[:-1] else len(conts))
            row_of[path] = len(levels[-1])
            levels[-1].append((row_of[path[:-1]], path[-1], math.log(share), path in extended))
        tree = listed_tree(request.root_token, levels, depth, Reason.CONTEXT_END, Source.RETRIEVED)
        for node in range(1, len(tree)):
            if tree.depths[node] == depth:
                tree.mark_leaf(node, leaf_reason(depth, c["depth"]))
        return tree

    def continuations(self, context: list[int], depth: int) -> list[tuple[int, ...]]:
        """Distinct continuations after earlier matches of the context's suffix, best n first."""
        c, found = self.config, []
        for n in range(min(c["max_n"], len(context) - 1), c["min_n"] - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # most recent match first
                if context[start : start + n] == suffix:
                    cont = tuple(context[start + n : start + n + depth])
                    if cont and cont not in found:
                        found.append(cont)
                        if len(found) >= c["branches"]:
                            return found
        return found
