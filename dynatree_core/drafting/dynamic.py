"""Dynamic tree policies from the reference papers, all greedy-drafted (top-k of the draft).

  dynatree          DynaTree (dynatree-confidence-aware-adaptive-tree.md §3.3, Algorithm 1)
  dyspec            DySpec greedy expansion (dyspec-dynamic-token-tree.md §4.1-4.2, App. A.1)
  dyspec_threshold  DySpec layer-by-layer construction with a threshold (§4.4, App. A.2)
  eagle2            EAGLE-2 beam search + rerank (salf-talf-tree-loss-and-stopping.md §2.3, App. B)
  salf              optimal tree search with SALF stopping (same paper, Algorithm 2; th=0 is
                    the SpecExec-style optimal search)

Every policy asks the Drafter for whole batches of nodes (one draft forward per level, or per
batch of B nodes for SALF and DySpec) and records why each node
was pruned or not expanded. Sampling-time variants (DySpec's sampling without replacement with
the residual update) belong to the sampling verifiers.
"""

from __future__ import annotations

import collections
import heapq
import math

import torch

from dynatree_core.drafting import static  # noqa: F401  (registered first: the baselines lead the list)
from dynatree_core.drafting.base import Drafter, DraftRequest, Param, Policy, register_policy
from dynatree_core.errors import DynaTreeError
from dynatree_core.sampling import adjust
from dynatree_core.tree import DraftTree, Reason, Status

NEG_INF = -math.inf


def _drafter(request: DraftRequest) -> Drafter:
    if request.drafter is None:
        raise DynaTreeError("this policy needs a draft model")
    return request.drafter


def _log(x: float) -> float:
    return math.log(x) if x > 0 else NEG_INF


def _admit(tree: DraftTree, candidates: list[tuple[float, int, int, float]], log_tau: float, room: int) -> list[int]:
    """Add one level's candidates (cum logp, parent, token, logp), most probable first: below
    log_tau pruned (threshold), beyond `room` pruned (budget). Returns the new verified nodes."""
    candidates.sort(key=lambda c: -c[0])
    added = []
    for cum, parent, tok, lp in candidates:
        if cum < log_tau:
            tree.add(parent, tok, lp, status=Status.PRUNED, reason=Reason.THRESHOLD)
        elif len(added) >= room:
            tree.add(parent, tok, lp, status=Status.PRUNED, reason=Reason.BUDGET)
        else:
            added.append(tree.add(parent, tok, lp))
    return added


def _start(request: DraftRequest, depth: int) -> tuple[DraftTree, int]:
    """A new tree and its depth cap; with no room at all the root is already a leaf."""
    tree = DraftTree.with_root(request.root_token)
    cap = min(depth, request.max_depth)
    if cap <= 0:
        tree.mark_leaf(0, Reason.LENGTH_LIMIT)
    return tree, cap


def _leaf_reason(depth_cap: int, policy_depth: int) -> Reason:
    return Reason.DEPTH_LIMIT if depth_cap == policy_depth else Reason.LENGTH_LIMIT


# ----- DynaTree ----------------------------------------------------------------------------------
@register_policy
class DynaTreeAdaptive(Policy):
    """DynaTree adaptive drafting: confidence-aware branching, dynamic depth, pruning, history.

    Level by level (one draft forward per level) over the nodes Algorithm 1 would pop:
      * depth gating, Alg. 1 lines 17-25: u is expanded iff d(u) < D_max and p(u) >= rho_stop and
        (d(u) < D0 or p(u) >= rho_deep); otherwise it stays a leaf with the failing rule as reason;
      * branching, §3.3 B(u) and Alg. 1 line 27: B_min children if c(u) >= tau_h, B_max if
        c(u) < tau_l, else B_mid, with c(u) the draft's top probability at u;
      * pruning, §3.3: a child with cumulative probability p < tau is pruned; the node budget
        N_max admits each level's children most probable first (Alg. 1 line 28).
    History (§3.3 "Historical adjustment"; the paper defers the schedule, ours is): a_r is the
    accepted length over the deepest verified depth of iteration r; after W iterations, if their
    mean is >= 0.6 drafting gets more aggressive (D0 + 1, tau_h - 0.05: deeper, narrower), if
    <= 0.3 more conservative (D0 - 1, tau_h + 0.05), and the window restarts. Each mechanism can be
    switched off to reproduce the paper's ablation (Table 4).
    """

    name = "dynatree"
    summary = "DynaTree adaptive: confidence-aware branching, dynamic depth, pruning, history"
    params = (
        Param("b_min", int, 1, 1, 8, "Children of a confident node: c(u) >= tau_h"),
        Param("b_mid", int, 2, 1, 8, "Children when tau_l <= c(u) < tau_h (and every node's, without adaptive_branch)"),
        Param("b_max", int, 3, 1, 8, "Children of an uncertain node: c(u) < tau_l"),
        Param("tau_h", float, 0.9, 0.0, 1.0, "High confidence threshold on the draft's top probability c(u)"),
        Param("tau_l", float, 0.4, 0.0, 1.0, "Low confidence threshold on c(u)"),
        Param("d0", int, 5, 1, 16, "Base depth D0: deeper only along paths with cumulative p >= rho_deep"),
        Param("d_max", int, 8, 1, 32, "Hard maximum depth D_max"),
        Param("rho_stop", float, 0.02, 0.0, 1.0, "Early stop: no expansion below this cumulative p", log_scale=True),
        Param("rho_deep", float, 0.3, 0.0, 1.0, "Cumulative p needed to grow beyond D0", log_scale=True),
        Param("tau", float, 0.01, 0.0, 1.0, "Prune a node whose cumulative draft p is below tau", log_scale=True),
        Param("budget", int, 32, 1, 256, "Node budget N_max: most drafted nodes sent to the target"),
        Param("window", int, 4, 1, 64, "History window W: iterations averaged before an adjustment"),
        Param("adaptive_branch", bool, True, help="Confidence-aware branching (off: b_mid children everywhere)"),
        Param("dynamic_depth", bool, True, help="Depth gating by rho_stop / rho_deep up to d_max (off: depth d0)"),
        Param("history", bool, True, help="Adjust d0 and tau_h from the last W iterations' acceptance"),
    )
    HIGH, LOW = 0.6, 0.3

    def __init__(self, **values):
        super().__init__(**values)
        c = self.config
        if not c["b_min"] <= c["b_mid"] <= c["b_max"]:
            raise DynaTreeError("dynatree needs b_min <= b_mid <= b_max")
        if not c["tau_l"] < c["tau_h"]:
            raise DynaTreeError("dynatree needs tau_l < tau_h")
        if not c["d0"] <= c["d_max"]:
            raise DynaTreeError("dynatree needs d0 <= d_max")
        if c["dynamic_depth"] and not c["rho_stop"] <= c["rho_deep"]:
            raise DynaTreeError("dynatree needs rho_stop <= rho_deep")
        self.reset()

    def reset(self) -> None:
        self.d0, self.tau_h = self.config["d0"], self.config["tau_h"]
        self.window: collections.deque[float] = collections.deque(maxlen=self.config["window"])
        self._last_depth = 0  # deepest verified depth of the tree just drafted

    def observe(self, outcome) -> None:
        if not self.config["history"] or self._last_depth <= 0:
            return
        self.window.append(len(outcome.accepted) / self._last_depth)
        if len(self.window) < self.window.maxlen:
            return
        mean, c = sum(self.window) / len(self.window), self.config
        if mean >= self.HIGH:
            self.d0 = min(self.d0 + 1, c["d_max"])
            self.tau_h = max(self.tau_h - 0.05, c["tau_l"] + 0.05)
        elif mean <= self.LOW:
            self.d0 = max(self.d0 - 1, 1)
            self.tau_h = min(self.tau_h + 0.05, 0.99)
        else:
            return
        self.window.clear()

    def _branch(self, confidence: float) -> int:
        c = self.config
        if not c["adaptive_branch"]:
            return c["b_mid"]
        if confidence >= self.tau_h:
            return c["b_min"]
        return c["b_max"] if confidence < c["tau_l"] else c["b_mid"]

    def _gate(self, tree: DraftTree, node: int, cap: int, policy_depth: int) -> Reason | None:
        """Why `node` may not be expanded (Alg. 1 lines 17-25), or None."""
        depth, cum = tree.depths[node], tree.cum_logp[node]
        if depth >= cap:
            return _leaf_reason(cap, policy_depth)
        if self.config["dynamic_depth"]:
            if cum < _log(self.config["rho_stop"]):
                return Reason.EARLY_STOP
            if depth >= self.d0 and cum < _log(self.config["rho_deep"]):
                return Reason.DEPTH_GATE
        return None

    def draft(self, request: DraftRequest) -> DraftTree:
        drafter, c = _drafter(request), self.config
        tree = DraftTree.with_root(request.root_token)
        tree.notes = {"d0": [float(self.d0)], "tau_h": [self.tau_h]}
        policy_depth = c["d_max"] if c["dynamic_depth"] else self.d0
        cap = min(policy_depth, request.max_depth)
        self._last_depth = 0
        frontier, drafted, log_tau = [0], 0, _log(c["tau"])
        while frontier:
            expand = []
            for node in frontier:
                why = self._gate(tree, node, cap, policy_depth)
                if why is None and drafted >= c["budget"]:
                    why = Reason.BUDGET
                if why is None:
                    expand.append(node)
                else:
                    tree.mark_leaf(node, why)
            if not expand:
                break
            logp = drafter.expand(tree, expand)  # ONE draft forward for the level
            confidence = logp.max(dim=-1).values.exp().tolist()
            branches = [self._branch(conf) for conf in confidence]
            top_lp, top_tok = logp.topk(max(branches), dim=-1)
            candidates = []
            for row, node in enumerate(expand):
                tree.mark_expanded(node)
                b = branches[row]
                for lp, tok in zip(top_lp[row, :b].tolist(), top_tok[row, :b].tolist(), strict=True):
                    candidates.append((tree.cum_logp[node] + lp, node, tok, lp))
            frontier = _admit(tree, candidates, log_tau, c["budget"] - drafted)
            drafted += len(frontier)
        self._last_depth = max((tree.depths[n] for n in range(len(tree)) if tree.is_verified(n)), default=0)
        return tree


# ----- DySpec ------------------------------------------------------------------------------------
def sibling_value(parent_value: float, probs: list[float], rank: int) -> float:
    """DySpec's estimated acceptance of the rank-th draw at a node (App. A.1): the parent's value,
    times the probability that the earlier draws there were all rejected, times the acceptance
    estimate of this draw under the residual distribution (Hypothesis 1: acceptance ~ draft p).
    With the residual r_i = q_i / (1 - sum_{j<i} q_j) the product telescopes to parent * q_i."""
    rejected, mass_left = 1.0, 1.0
    for j in range(rank):
        r_j = probs[j] / mass_left if mass_left > 0 else 0.0
        rejected *= 1.0 - r_j
        mass_left -= probs[j]
    r_i = probs[rank] / mass_left if mass_left > 0 else 0.0
    return parent_value * rejected * r_i


def _ranked_children(request: DraftRequest, tree: DraftTree, node: int, logp, m: int) -> tuple[list[float], list[int]]:
    """(probabilities, tokens) of a node's candidate children in rank order: the draft's top m,
    or, for sampled drafting, m draws without replacement from the adjusted draft distribution
    (DySpec's sampled tree; the draw order is the rank)."""
    if request.draw == "top":
        top_lp, top_tok = logp.topk(min(m, logp.shape[-1]))
        return top_lp.exp().tolist(), top_tok.tolist()
    q = adjust(logp, request.sampling).cpu()
    toks = torch.multinomial(q, min(m, int((q > 0).sum())), replacement=False, generator=request.gen).tolist()
    tree.draft_q[node] = q
    return [float(q[t]) for t in toks], toks


@register_policy
class DySpec(Policy):
    """DySpec greedy expansion: a heap of expandable draws ordered by estimated value (§4.2).

    Each step adds the draw with the highest estimated acceptance (`sibling_value`); adding the
    rank-i child of u makes two new draws expandable: u's rank-(i+1) child and the new node's
    first child (App. A.1). The paper's algorithm runs the draft once per added node. We batch
    what the algorithm allows without changing its result: a node's value bounds its children's,
    so the best known draw is taken while it beats every unexpanded node; when a forward is
    needed, it also runs the best waiting draws ahead of their turn (up to `batch` nodes per
    forward). Draws run ahead but never taken are pruned (reason budget), so the verified tree is
    exactly the node-by-node algorithm's. `dyspec_threshold` is the layer-by-layer variant (§4.4).
    """

    name = "dyspec"
    draws = ("top", "without_replacement")  # sampled: each node's children are draws without replacement
    summary = "DySpec: greedy heap expansion by estimated acceptance, up to a node budget"
    params = (
        Param("budget", int, 32, 1, 256, "Drafted nodes in the tree (the speculative budget)"),
        Param("depth", int, 12, 1, 32, "Depth cap"),
        Param("max_children", int, 8, 1, 64, "Children looked at per node (top of the draft distribution)"),
        Param("batch", int, 8, 1, 64, "Nodes per draft forward: the node needed now plus the best draws, run ahead"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        drafter, c = _drafter(request), self.config
        tree, cap = _start(request, c["depth"])
        if cap <= 0:
            return tree
        value = {0: 1.0}
        children: dict[int, tuple[list[float], list[int]]] = {}  # expanded node -> (probs, tokens)
        heap: list[tuple[float, int, int]] = []  # (-value, parent, rank): draws that may be taken next
        ahead: dict[tuple[int, int], int] = {}  # (parent, rank) -> node run through the draft early
        pending = [0]  # taken, expandable, not yet run through the draft
        taken = 0
        order: list[float] = []
        tree.notes = {"taken": order}  # node ids in the order the heap gave them

        def take_children(node: int) -> None:
            heapq.heappush(heap, (-sibling_value(value[node], children[node][0], 0), node, 0))

        while taken < c["budget"]:
            bound = max((value[n] for n in pending), default=NEG_INF)
            if pending and (not heap or -heap[0][0] < bound):  # a pending node's child may be next
                run = list(pending)
                for _neg, parent, rank in heapq.nsmallest(c["batch"], heap):
                    if len(run) >= c["batch"]:
                        break
                    if (parent, rank) not in ahead and tree.depths[parent] + 1 < cap:
                        probs, toks = children[parent]
                        ahead[(parent, rank)] = tree.add(parent, toks[rank], math.log(probs[rank]))
                        run.append(ahead[(parent, rank)])
                logp = drafter.expand(tree, run)  # ONE forward: needed nodes + draws run ahead
                for row, node in enumerate(run):
                    tree.mark_expanded(node)
                    children[node] = _ranked_children(request, tree, node, logp[row], c["max_children"])
                for node in pending:
                    take_children(node)
                pending = []
                continue
            if not heap:
                break
            neg, parent, rank = heapq.heappop(heap)
            probs, toks = children[parent]
            node = ahead.pop((parent, rank), None)
            if node is None:
                node = tree.add(parent, toks[rank], math.log(probs[rank]))
            value[node], taken = -neg, taken + 1
            order.append(float(node))
            if rank + 1 < len(probs):
                heapq.heappush(heap, (-sibling_value(value[parent], probs, rank + 1), parent, rank + 1))
            if tree.depths[node] >= cap:
                tree.mark_leaf(node, _leaf_reason(cap, c["depth"]))
            elif node in children:  # already run ahead: its first child is known
                take_children(node)
            else:
                pending.append(node)
        for node in pending:
            tree.mark_leaf(node, Reason.BUDGET)
        for node in ahead.values():  # run ahead, never taken
            tree.prune(node, Reason.BUDGET)
        left = [(n, p, r) for n, p, r in sorted(heap) if (p, r) not in ahead]
        if request.draw == "top":
            left = left[: c["max_children"]]
        for _neg, parent, rank in left:  # the best draws left out
            probs, toks = children[parent]
            tree.add(parent, toks[rank], math.log(probs[rank]), status=Status.PRUNED, reason=Reason.BUDGET)
        if request.draw != "top":
            # each node's draws are its children in rank (= drawing) order: the taken ones and the
            # next draw, always kept (pruned) so that whether a draw is listed never depends on
            # its own value, which keeps the without-replacement verifier lossless
            for child in range(1, len(tree)):  # node ids grow in rank order under each parent
                tree.draws.setdefault(tree.parents[child], []).append(tree.tokens[child])
        return tree


@register_policy
class DySpecThreshold(Policy):
    """DySpec with a threshold (§4.4, App. A.2): level by level, keep every draw whose estimated
    value (`sibling_value`, the path product under greedy drafting) is at least `threshold`, up
    to the node budget. One draft forward per level. Under greedy drafting this equals threshold
    pruning on the cumulative probability with unbounded branching (up to max_children)."""

    name = "dyspec_threshold"
    summary = "DySpec layer by layer: every draw with estimated value >= threshold"
    params = (
        Param("threshold", float, 0.02, 0.0, 1.0, "Keep draws whose estimated acceptance >= threshold", log_scale=True),
        Param("budget", int, 32, 1, 256, "Node budget: most drafted nodes sent to the target"),
        Param("depth", int, 12, 1, 32, "Depth cap"),
        Param("max_children", int, 8, 1, 64, "Children looked at per node"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        drafter, c = _drafter(request), self.config
        tree, cap = _start(request, c["depth"])
        if cap <= 0:
            return tree
        frontier, drafted = [0], 0
        for level in range(cap):
            logp = drafter.expand(tree, frontier)  # ONE draft forward for the level
            top_lp, top_tok = logp.topk(min(c["max_children"], logp.shape[-1]), dim=-1)
            candidates = []
            for row, node in enumerate(frontier):
                tree.mark_expanded(node)
                probs, parent_value = top_lp[row].exp().tolist(), math.exp(tree.cum_logp[node])
                for rank, tok in enumerate(top_tok[row].tolist()):
                    v = sibling_value(parent_value, probs, rank)
                    candidates.append((_log(v), node, tok, math.log(probs[rank])))
                    if v < c["threshold"]:  # values fall with rank: the rest are lower still
                        break
            frontier = _admit(tree, candidates, _log(c["threshold"]), c["budget"] - drafted)
            drafted += len(frontier)
            if not frontier:
                break
            if drafted >= c["budget"] and level + 1 < cap:
                for node in frontier:
                    tree.mark_leaf(node, Reason.BUDGET)
                return tree
        for node in frontier:
            tree.mark_leaf(node, _leaf_reason(cap, c["depth"]))
        return tree


# ----- EAGLE-2 -----------------------------------------------------------------------------------
@register_policy
class Eagle2Beam(Policy):
    """EAGLE-2 dynamic tree (SALF paper §2.3 and App. B): for `depth` steps expand the top-k
    nodes of the newest level by path probability (one forward per step, k children each), then
    rerank: keep the global top-N drafted nodes by path probability, prune the rest."""

    name = "eagle2"
    summary = "EAGLE-2: beam of top-k per level for `depth` steps, then global top-N rerank"
    params = (
        Param("depth", int, 6, 1, 16, "Expansion steps (tree depth)"),
        Param("topk", int, 4, 1, 16, "Nodes expanded per step, and children per expanded node"),
        Param("total", int, 24, 1, 256, "N: drafted nodes kept by the rerank"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        drafter, c = _drafter(request), self.config
        tree, cap = _start(request, c["depth"])
        if cap <= 0:
            return tree
        frontier = [0]
        for level in range(cap):
            logp = drafter.expand(tree, frontier)  # ONE draft forward per step
            top_lp, top_tok = logp.topk(c["topk"], dim=-1)
            new = []
            for row, node in enumerate(frontier):
                tree.mark_expanded(node)
                for lp, tok in zip(top_lp[row].tolist(), top_tok[row].tolist(), strict=True):
                    new.append(tree.add(node, tok, lp, reason=_leaf_reason(cap, c["depth"])))
            if level + 1 == cap:
                break
            new.sort(key=lambda n: (-tree.cum_logp[n], n))
            frontier = new[: c["topk"]]
            for node in new[c["topk"] :]:
                tree.mark_leaf(node, Reason.BEAM)
        ranked = sorted(range(1, len(tree)), key=lambda n: (-tree.cum_logp[n], n))
        keep: set[int] = set()
        for node in ranked:  # the rerank; a path probability never exceeds its parent's
            if len(keep) < c["total"] and (tree.parents[node] == 0 or tree.parents[node] in keep):
                keep.add(node)
        for node in range(1, len(tree)):
            if node not in keep and tree.status[node] != Status.PRUNED:
                tree.prune(node, Reason.RERANK)
        return tree


# ----- SALF --------------------------------------------------------------------------------------
@register_policy
class Salf(Policy):
    """Optimal tree search with stopping at low further gains (SALF paper, Algorithm 2).

    G (the tree) keeps the N most probable nodes found so far (root included); Q keeps the N
    most probable candidate children not yet in G. Each step pops B candidates from Q into G
    (lines 5-9), ignores those that cannot stay in G (pr <= epsilon, lines 10-12), stops when
    the batch's probability mass is below th (line 13; th = 0 never stops early: the
    SpecExec-style optimal search), and expands the batch in ONE draft forward (lines 14-20).
    The mass of every step is recorded in `tree.notes["salf_mass"]` (it decreases: Theorem 1).
    """

    name = "salf"
    summary = "SALF: capacity-N optimal tree search, B nodes per forward, stop when mass < th"
    params = (
        Param("nodes", int, 32, 2, 256, "N: tree nodes kept, root included"),
        Param("batch", int, 8, 1, 64, "B: nodes expanded per draft forward"),
        Param("th", float, 0.6, 0.0, 0.999, "SALF threshold: stop when the batch's probability mass is below it"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        drafter, c = _drafter(request), self.config
        n_max, batch, th = c["nodes"], c["batch"], c["th"]
        tree = DraftTree.with_root(request.root_token)
        masses: list[float] = []
        tree.notes = {"salf_mass": masses}
        cap = request.max_depth
        g = {0: 0.0}  # node -> log pr: the output tree
        queue: list[tuple[float, int, int, int, float]] = []  # (-log pr, seq, parent, token, logp)
        seq, why, stop = 0, {}, Reason.BUDGET
        batch_nodes = [0]
        while True:
            eps = min(g.values()) if len(g) >= n_max else NEG_INF  # lines 10-11
            batch_nodes = [n for n in batch_nodes if n in g and g[n] > eps]  # line 12
            mass = sum(math.exp(g[n]) for n in batch_nodes)
            masses.append(mass)
            if not batch_nodes:  # nothing popped can stay in G: the tree is final
                break
            if mass < th:  # line 13: SALF
                stop = Reason.SALF_STOP
                for node in batch_nodes:
                    why[node] = Reason.SALF_STOP
                break
            expand = [n for n in batch_nodes if tree.depths[n] < cap]
            for node in batch_nodes:
                if tree.depths[node] >= cap:
                    why[node] = Reason.LENGTH_LIMIT
            if expand:
                logp = drafter.expand(tree, expand)  # ONE forward for the batch (lines 14-20)
                top_lp, top_tok = logp.topk(min(n_max, logp.shape[-1]), dim=-1)
                for row, node in enumerate(expand):
                    tree.mark_expanded(node)
                    for lp, tok in zip(top_lp[row].tolist(), top_tok[row].tolist(), strict=True):
                        heapq.heappush(queue, (-(g[node] + lp), seq, node, tok, lp))
                        seq += 1
                queue = heapq.nsmallest(n_max, queue)  # capacity N: drop the least probable
                heapq.heapify(queue)
            batch_nodes = []
            while queue and len(batch_nodes) < batch:  # lines 5-9
                neg, _, parent, tok, lp = heapq.heappop(queue)
                if tree.status[parent] == Status.PRUNED:  # its parent left G: it cannot enter
                    continue
                node = tree.add(parent, tok, lp)
                g[node] = -neg
                batch_nodes.append(node)
                while len(g) > n_max:  # G keeps N nodes: drop the least probable, latest first
                    victim = min((n for n in g if n), key=lambda n: (g[n], -n))
                    tree.prune(victim, Reason.BUDGET)
                    del g[victim]
            if not batch_nodes:
                break
        for node in g:
            if node and tree.status[node] == Status.NOT_EXPANDED:
                tree.mark_leaf(node, why.get(node, Reason.BUDGET))
        if tree.status[0] == Status.NOT_EXPANDED:
            tree.mark_leaf(0, why.get(0, Reason.LENGTH_LIMIT))
        eps = min(g.values()) if len(g) >= n_max else NEG_INF
        for neg, _, parent, tok, lp in sorted(queue):  # candidates that would have fitted
            if -neg > eps and tree.status[parent] != Status.PRUNED:
                tree.add(parent, tok, lp, status=Status.PRUNED, reason=stop)
        return tree
