"""The papers' drafting loops, node by node on the host: the reference the tensor levels
(dynatree_core/drafting/device.py) are checked against (tests/test_device_draft.py). They read a
drafter's rows with `expand(tree, nodes)` and apply each rule to one node at a time, as the
papers write them; the library decides the same trees as a few tensor operations per level."""

from __future__ import annotations

import heapq
import math

import torch

from dynatree_core.core.tree import DraftTree, Reason, Source, Status
from dynatree_core.drafting.common import leaf_reason, safe_log, start_tree
from dynatree_core.drafting.request import level_q, level_top


def admit_level(
    tree: DraftTree, candidates: list[tuple[float, int, int, float]], log_tau: float, room: int
) -> list[int]:
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


def _children(tree: DraftTree, node: int, lps: list[float], toks: list[int]) -> list[tuple]:
    """(cum logp, parent, token, logp) of a node's children, as admit_level takes them."""
    return [(tree.cum_logp[node] + lp, node, tok, lp) for lp, tok in zip(lps, toks, strict=True)]


def _close(tree: DraftTree, frontier: list[int], reason) -> None:
    for node in frontier:
        tree.mark_leaf(node, reason)


def fixed_tree(request, *, depth: int, branch: int, tau: float, budget: int) -> DraftTree:
    """DynaTree Alg. 1: top-B children of every frontier node (sampled drafting: B draws, `_drawn`);
    below tau pruned (lines 17-19); the node budget (lines 12, 22), most probable first."""
    drafter, (tree, cap) = request.drafter, start_tree(request, depth)
    frontier, drafted = [0], 0
    for level in range(cap):
        logp = drafter.expand(tree, frontier)
        if request.draw == "top":
            lp_rows, tok_rows = level_top(logp, branch)
        else:
            q_rows = level_q(request, logp)
        candidates = []
        for row, node in enumerate(frontier):
            tree.mark_expanded(node)
            if request.draw == "top":
                candidates += _children(tree, node, lp_rows[row], tok_rows[row])
            else:
                candidates += _children(tree, node, *_drawn(request, tree, node, q_rows[row], branch))
        frontier = admit_level(tree, candidates, safe_log(tau), budget - drafted)
        drafted += len(frontier)
        if not frontier:
            break
        if drafted >= budget and level + 1 < cap:
            _close(tree, frontier, Reason.BUDGET)
            break
        if level + 1 == cap:
            _close(tree, frontier, leaf_reason(cap, depth))
    return tree


def _drawn(request, tree: DraftTree, node: int, q16, k: int) -> tuple[list[float], list[int]]:
    """A node's k draws from its adjusted draft distribution (recorded on the tree, rounded to
    float16 once), with the run's generator: their distinct tokens in drawing order, logp = log q."""
    draw = tree.record_draws(node, q16)
    q = draw.dense()
    k = min(k, int((q > 0).sum())) if request.draw == "without_replacement" else k
    draw.tokens.extend(torch.multinomial(q, k, replacement=request.draw == "iid", generator=request.gen).tolist())
    distinct = list(dict.fromkeys(draw.tokens))
    return [math.log(float(q[t])) for t in distinct], distinct


def dyspec_threshold(request, *, threshold: float, budget: int, depth: int, max_children: int) -> DraftTree:
    """DySpec App. A.2: every draw whose value (cum + lp under greedy drafting) is >= threshold, a
    row's draws in rank order up to the first below it, up to the node budget."""
    drafter, (tree, cap) = request.drafter, start_tree(request, depth)
    log_th = safe_log(threshold)
    frontier, drafted = [0], 0
    for level in range(cap):
        lp_rows, tok_rows = level_top(drafter.expand(tree, frontier), max_children)
        candidates = []
        for row, node in enumerate(frontier):
            tree.mark_expanded(node)
            for lp, tok in zip(lp_rows[row], tok_rows[row], strict=True):
                candidates.append((tree.cum_logp[node] + lp, node, tok, lp))
                if tree.cum_logp[node] + lp < log_th:
                    break
        frontier = admit_level(tree, candidates, log_th, budget - drafted)
        drafted += len(frontier)
        if not frontier:
            return tree
        if drafted >= budget and level + 1 < cap:
            _close(tree, frontier, Reason.BUDGET)
            return tree
    _close(tree, frontier, leaf_reason(cap, depth))
    return tree


def dynatree(policy, request) -> DraftTree:
    """DynaTree Alg. 1 with `policy`'s state (d0, tau_h): a node's gate (lines 17-25: depth cap,
    rho_stop, D0 and rho_deep, then the budget), its branching B(u) from c(u) (line 27), pruning
    below tau and the budget, most probable first (line 28)."""
    c, drafter = policy.config, request.drafter
    tree = DraftTree.with_root(request.root_token)
    tree.notes = {"d0": [float(policy.d0)], "tau_h": [policy.tau_h]}
    policy_depth = c["d_max"] if c["dynamic_depth"] else policy.d0
    cap = min(policy_depth, request.max_depth)

    def gate(node):
        depth, cum = tree.depths[node], tree.cum_logp[node]
        if depth >= cap:
            return leaf_reason(cap, policy_depth)
        if c["dynamic_depth"] and cum < safe_log(c["rho_stop"]):
            return Reason.EARLY_STOP
        if c["dynamic_depth"] and depth >= policy.d0 and cum < safe_log(c["rho_deep"]):
            return Reason.DEPTH_GATE
        return Reason.BUDGET if drafted >= c["budget"] else None

    def branch(top_logp):
        if not c["adaptive_branch"]:
            return c["b_mid"]
        if top_logp >= safe_log(policy.tau_h):
            return c["b_min"]
        return c["b_max"] if top_logp < safe_log(c["tau_l"]) else c["b_mid"]

    frontier, drafted = [0], 0
    while frontier:
        expand = []
        for node in frontier:
            why = gate(node)
            expand.append(node) if why is None else tree.mark_leaf(node, why)
        if not expand:
            break
        lp_rows, tok_rows = level_top(drafter.expand(tree, expand), max(c["b_min"], c["b_mid"], c["b_max"]))
        candidates = []
        for row, node in enumerate(expand):
            tree.mark_expanded(node)
            b = branch(lp_rows[row][0])
            candidates += [
                (tree.cum_logp[node] + lp, node, t, lp)
                for lp, t in zip(lp_rows[row][:b], tok_rows[row][:b], strict=True)
            ]
        frontier = admit_level(tree, candidates, safe_log(c["tau"]), c["budget"] - drafted)
        drafted += len(frontier)
    return tree


def eagle2_beam(request, *, depth: int, topk: int) -> DraftTree:
    """EAGLE-2's beam (before its rerank): each step expands the top-k newest nodes by path
    probability (ties in node order), k children each; the rest are leaves (BEAM)."""
    drafter, (tree, cap) = request.drafter, start_tree(request, depth)
    frontier = [0]
    for level in range(cap):
        lp_rows, tok_rows = level_top(drafter.expand(tree, frontier), topk)
        new = []
        for row, node in enumerate(frontier):
            tree.mark_expanded(node)
            for lp, tok in zip(lp_rows[row], tok_rows[row], strict=True):
                new.append(tree.add(node, tok, lp, reason=leaf_reason(cap, depth)))
        if level + 1 == cap:
            break
        new.sort(key=lambda n: (-tree.cum_logp[n], n))
        frontier = new[:topk]
        _close(tree, new[topk:], Reason.BEAM)
    return tree


def eagle2(request, *, depth: int, topk: int, total: int) -> DraftTree:
    """EAGLE-2: the beam, then the rerank: the global top-N drafted nodes by path probability
    (ties in node order) whose parents are kept, the rest pruned (RERANK)."""
    tree = eagle2_beam(request, depth=depth, topk=topk)
    keep: set[int] = set()
    for node in sorted(range(1, len(tree)), key=lambda n: (-tree.cum_logp[n], n)):
        if len(keep) < total and (tree.parents[node] == 0 or tree.parents[node] in keep):
            keep.add(node)
    for node in range(1, len(tree)):
        if node not in keep and tree.is_verified(node):
            tree.prune(node, Reason.RERANK)
    return tree


def delayed(request, *, k: int, l1: int, l2: int) -> DraftTree:
    """The delayed tree (Def. 5.2): a trunk of L1 greedy tokens, then K branches of L2 tokens."""
    drafter, tree = request.drafter, DraftTree.with_root(request.root_token)
    cap = min(l1 + l2, request.max_depth)
    frontier = [0]
    for level in range(cap):
        width = k if level == l1 else 1
        logp = drafter.expand(tree, frontier)
        if request.draw == "top":
            lp_rows, tok_rows = level_top(logp, width)
        else:
            q_rows = level_q(request, logp)
        new = []
        for row, node in enumerate(frontier):
            tree.mark_expanded(node)
            if request.draw == "top":
                lps, toks = lp_rows[row], tok_rows[row]
            else:  # the distinct draws in drawing order
                lps, toks = _drawn(request, tree, node, q_rows[row], width)
            new += [tree.add(node, t, lp, reason=leaf_reason(cap, l1 + l2)) for lp, t in zip(lps, toks, strict=True)]
        frontier = new
    if cap <= 0:
        tree.mark_leaf(0, leaf_reason(cap, l1 + l2))
    return tree


def recycled_walk(successors: dict[int, tuple[list[int], list[float]]], root: int, widths: list[int],
                  budget: int) -> DraftTree:  # fmt: skip
    """Token Recycling's breadth-first walk (Luo et al. §3.2) node by node over a dict matrix
    (token -> successors, most likely first): a node at depth d - 1 gets the first widths[d - 1]
    successors of its token while the budget lasts; a token with no row is a leaf."""
    tree = DraftTree.with_root(root)
    frontier, drafted = [0], 0
    for width in widths:
        grown = []
        for node in frontier:
            known = successors.get(tree.tokens[node])
            if known is None:
                tree.mark_leaf(node, "no_successors")
                continue
            if drafted >= budget:
                tree.mark_leaf(node, Reason.BUDGET)
                continue
            tree.mark_expanded(node)
            for token, lp in list(zip(*known, strict=True))[: min(width, budget - drafted)]:
                grown.append(tree.add(node, token, lp, source=Source.RECYCLED))
                drafted += 1
        frontier = grown
        if not frontier:
            break
    return tree


def recycled_best(successors: dict[int, tuple[list[int], list[float]]], root: int, depth: int,
                  budget: int) -> list[tuple[int, ...]]:  # fmt: skip
    """Best-first recycled drafting by exhaustion: every path of at most `depth` tokens the matrix
    allows from `root` (a token without a row has no successors), the `budget` of highest summed
    log-prob, as token tuples (the root left out)."""
    paths, frontier = [], [((), 0.0, root)]
    for _ in range(depth):
        grown = []
        for path, score, token in frontier:
            for child, lp in zip(*successors.get(token, ([], [])), strict=True):
                grown.append((path + (child,), score + lp, child))
        paths += grown
        frontier = grown
    return [path for path, _, _ in sorted(paths, key=lambda p: (-p[1], len(p[0])))[:budget]]


def salf(request, *, nodes: int, batch: int, th: float) -> DraftTree:
    """SALF (salf-talf-tree-loss-and-stopping.md, Algorithm 2) with heaps, node by node: G keeps the
    N most probable nodes (root included), Q the N most probable candidates; each step pops B from Q
    into G (a candidate whose parent left G is passed over), ignores those that cannot stay
    (pr <= epsilon), stops when the batch's mass is below th, expands the batch in one forward."""
    drafter, n_max, cap = request.drafter, nodes, request.max_depth
    tree = DraftTree.with_root(request.root_token)
    masses: list[float] = []
    tree.notes = {"salf_mass": masses}
    g = {0: 0.0}  # node -> log pr: the output tree
    queue: list[tuple[float, int, int, int, float]] = []  # (-log pr, seq, parent, token, logp)
    seq, why, stop = 0, {}, Reason.BUDGET
    batch_nodes = [0]
    while True:
        eps = min(g.values()) if len(g) >= n_max else -math.inf  # lines 10-11
        batch_nodes = [n for n in batch_nodes if n in g and g[n] > eps]  # line 12
        mass = sum(math.exp(g[n]) for n in batch_nodes)
        masses.append(mass)
        if not batch_nodes:
            break
        if mass < th:  # line 13
            stop = Reason.SALF_STOP
            for node in batch_nodes:
                why[node] = Reason.SALF_STOP
            break
        expand = [n for n in batch_nodes if tree.depths[n] < cap]
        for node in batch_nodes:
            if tree.depths[node] >= cap:
                why[node] = Reason.LENGTH_LIMIT
        if expand:
            lp_rows, tok_rows = level_top(drafter.expand(tree, expand), n_max)  # lines 14-20
            for row, node in enumerate(expand):
                tree.mark_expanded(node)
                for lp, tok in zip(lp_rows[row], tok_rows[row], strict=True):
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
    eps = min(g.values()) if len(g) >= n_max else -math.inf
    for neg, _, parent, tok, lp in sorted(queue):  # candidates that would have fitted
        if -neg > eps and tree.status[parent] != Status.PRUNED:
            tree.add(parent, tok, lp, status=Status.PRUNED, reason=stop)
    return tree


def dyspec(request, *, budget: int, depth: int, max_children: int, batch: int) -> DraftTree:
    """DySpec's greedy expansion (dyspec-dynamic-token-tree.md §4.2, App. A.1) with a heap, one draw
    taken at a time: the expandable draw of highest value (the telescoped sibling value: the path's
    probability, here as its log) is taken next; taking u's rank-i child makes u's rank-(i+1) child and
    the new node's first child expandable. A forward runs the taken nodes waiting for it and the best
    waiting draws ahead of their turn (up to `batch`); draws run ahead but never taken are pruned.
    Ties go to the draw pushed first (its forward, row and rank: `seq`)."""
    drafter, m = request.drafter, max_children
    tree, cap = start_tree(request, depth)
    if cap <= 0:
        return tree
    value = {0: 0.0}  # node -> log of its estimated value
    children: dict[int, tuple[list[float], list[int], int]] = {}  # run node -> (log-probs, tokens, first seq)
    heap: list[tuple[float, int, int, int]] = []  # (-value, seq, parent, rank)
    ahead: dict[tuple[int, int], int] = {}
    pending, taken, order, slots = [0], 0, [], 0
    tree.notes = {"taken": order}

    def push(parent: int, rank: int) -> None:
        lps, _, first = children[parent]
        if rank < len(lps):
            heapq.heappush(heap, (-(value[parent] + lps[rank]), first + rank, parent, rank))

    while taken < budget:
        bound = max((value[n] for n in pending), default=-math.inf)
        if pending and (not heap or -heap[0][0] < bound):
            run = list(pending)
            for _neg, _seq, parent, rank in heapq.nsmallest(batch, heap):
                if len(run) >= batch:
                    break
                if (parent, rank) not in ahead and tree.depths[parent] + 1 < cap:
                    lps, toks, _ = children[parent]
                    ahead[(parent, rank)] = tree.add(parent, toks[rank], lps[rank])
                    run.append(ahead[(parent, rank)])
            logp = drafter.expand(tree, run)
            if request.draw == "top":
                lp_rows, tok_rows = level_top(logp, m)
                width = len(lp_rows[0])
            else:
                width = m
            q_rows = level_q(request, logp)
            for row, node in enumerate(run):
                tree.mark_expanded(node)
                if request.draw == "top":
                    lps, toks = lp_rows[row], tok_rows[row]
                else:
                    q = tree.record_draws(node, q_rows[row]).dense()
                    toks = torch.multinomial(q, min(m, int((q > 0).sum())), replacement=False, generator=request.gen)
                    toks = toks.tolist()
                    lps = [math.log(float(q[t])) for t in toks]
                children[node] = (lps, toks, slots + row * width)
            slots += len(run) * width
            for node in pending:
                push(node, 0)
            pending = []
            continue
        if not heap:
            break
        neg, _seq, parent, rank = heapq.heappop(heap)
        lps, toks, _ = children[parent]
        node = ahead.pop((parent, rank), None)
        if node is None:
            node = tree.add(parent, toks[rank], lps[rank])
        value[node], taken = -neg, taken + 1
        order.append(float(node))
        push(parent, rank + 1)
        if tree.depths[node] >= cap:
            tree.mark_leaf(node, leaf_reason(cap, depth))
        elif node in children:  # already run ahead: its first child is known
            push(node, 0)
        else:
            pending.append(node)
    for node in pending:
        tree.mark_leaf(node, Reason.BUDGET)
    for node in ahead.values():
        tree.prune(node, Reason.BUDGET)
    left = [(s, p, r) for _n, s, p, r in sorted(heap) if (p, r) not in ahead]
    if request.draw == "top":
        left = left[:m]
    for _s, parent, rank in left:  # the best draws left out
        lps, toks, _ = children[parent]
        tree.add(parent, toks[rank], lps[rank], status=Status.PRUNED, reason=Reason.BUDGET)
    if request.draw != "top":  # each node's draws: its children in rank order, taken and the next one
        for child in range(1, len(tree)):
            tree.sampled[tree.parents[child]].tokens.append(tree.tokens[child])
    return tree
