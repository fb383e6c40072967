"""Draft levels decided on the device: the tree is read once per iteration, not once per level.

On a GPU every device->host read waits for the queue to drain. A policy that reads each level's
top-k on the host to choose the next level's rows pays one such wait per draft forward (3.7
reads per fixed_tree iteration on an H200: BENCHMARKS, "The GPU round measured"). Here a level's
choices are made on the device, at fixed widths (every row the level could have; rows the
policy would not have are padded and marked), and the levels' records are read in ONE copy
after the last draft forward. The host then replays them into the DraftTree the host path
builds from the same distributions, node for node, reasons included
(tests/test_device_draft.py). SGLang's EAGLE worker keeps its draft loop on the GPU the same
way (docs/gpu.md).

The price: levels run at their widest, and a tree the host path stops early (an empty frontier,
a spent budget) runs one spare draft forward: whether a level admitted anything is read one
level late (transfer.LateRead: the device is busy with the next level meanwhile). On a CPU a
read costs nothing, so the engine drafts this way on CUDA only (ForwardSettings.device_draft).
Greedy ("top") drafting only: sampled drafting draws on the host.

Two shapes of tree: `admitted_levels` (fixed_tree, linear, dynatree, dyspec_threshold: a
level's candidates admitted most probable first under a threshold and a budget; the policy
proposes them, the host replays its own rules over what was read) and `grow_all_on_device`
(eagle2's beam, delayed and delayed_auto: every child joins the tree). The levels, their one
read and the verify rows built from them are drafting/levels.py's.

Between the draft forwards a level's decision (top-k, order, admission) is one captured step where
forwards are captured (forward/capture.py): on a GPU one launch, not thirty.

Cumulative log-probabilities are float64 on the device, as the host's Python floats are, so
every comparison (threshold, order, ties) decides the same way on both paths.
"""

from __future__ import annotations

import math

import torch

from dynatree_core.core.transfer import LateRead
from dynatree_core.core.tree import DraftTree, Reason, Status
from dynatree_core.drafting.common import drafter_of, leaf_reason, safe_log, start_tree
from dynatree_core.drafting.levels import (
    ADMITTED,
    BUDGET,
    PADDING,
    THRESHOLD,
    Level,
    ReadLevel,
    read_levels,
    read_verifying,
)
from dynatree_core.drafting.request import DraftRequest


def expand_frontier(tree: DraftTree, frontier: list[int], drafter, level: int) -> None:
    """The host side of a level's forward over `frontier` (its rows in order): the nodes are
    expanded, and the drafter learns their cache slots (`Drafter.bind`; the root's is known)."""
    for row, node in enumerate(frontier):
        tree.mark_expanded(node)
        if node:
            drafter.bind(node, level - 1, row)


def children(logp: torch.Tensor, cum: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """The top-k children of every row, flattened row-major (the host path's candidate order):
    tokens, float32 log-probs, float64 cumulative log-probs, proposing rows."""
    top_lp, top_tok = logp.topk(min(k, logp.shape[-1]), dim=-1)  # the call level_top makes
    rows = torch.arange(logp.shape[0], device=logp.device).repeat_interleave(top_lp.shape[1])
    cum_c = (cum[:, None] + top_lp.float().double()).flatten()
    return top_tok.flatten(), top_lp.float().flatten(), cum_c, rows


def most_probable_first(cum: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Candidate order: real candidates first (a padded or gated row's are not), by cumulative
    log-prob, highest first, ties in candidate order (the host's stable sort). One stable ascending
    sort of -cum with the candidates that are not real as NaN, which torch's sort places last on
    every device; `0.0 - cum` makes no negative zero, whose place a device's sort may not keep."""
    return torch.sort(torch.where(valid, 0.0 - cum, math.nan), stable=True).indices


def admit(cum: torch.Tensor, valid: torch.Tensor, log_tau: float, room: torch.Tensor) -> torch.Tensor:
    """Fates of candidates already in most-probable-first order (common.admit_level on the
    device): below log_tau THRESHOLD, past the budget's `room` BUDGET. Those at or above log_tau
    are a prefix of the order, so the first `room` of them are admitted."""
    passing = valid & (cum >= log_tau)
    index = torch.arange(cum.shape[0], device=cum.device)
    fate = torch.where(passing & (index < room), ADMITTED, BUDGET)
    fate = torch.where(passing, fate, THRESHOLD)
    return torch.where(valid, fate, PADDING)


def level_forward(drafter, levels: list[Level]) -> torch.Tensor:
    """The next level's ONE draft forward, its logits (the step that decides the level makes them
    log-probabilities: Drafter.to_logp): the root's first, then the rows the last level selected."""
    if not levels:
        return drafter.expand_level(None, None, 0, raw=True)
    prev = levels[-1]
    if prev.prefix:  # the first candidates: views, no gather
        width = prev.selected.shape[0]
        return drafter.expand_level(prev.tokens[:width], prev.parents[:width], len(levels), raw=True)
    return drafter.expand_level(prev.tokens[prev.selected], prev.parents[prev.selected], len(levels), raw=True)


def _start(steps, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The root level's row: cumulative log-prob 0, real, nothing drafted (made once per run)."""
    return (
        steps.constant(("cum0",), lambda: torch.zeros(1, dtype=torch.float64, device=device)),
        steps.constant(("valid0",), lambda: torch.ones(1, dtype=torch.bool, device=device)),
        steps.constant(("drafted0",), lambda: torch.zeros((), dtype=torch.long, device=device)),
    )


def _decision(propose, level: int, log_tau: float, budget: int, to_logp):
    """A level's decision as a pure function of its tensors (a captured step: admitted_levels):
    the candidates `propose` gives, most probable first, their fates, the next level's rows
    (every candidate the level may admit), and the (admitted, drafted) counts read late."""

    def decide(logits, cum, valid, drafted, *inputs):
        tokens, lp, cum_c, rows, real = propose(level, to_logp(logits), cum, valid, drafted, *inputs)
        order = most_probable_first(cum_c, real)
        tokens, lp, cum_c, rows, real = tokens[order], lp[order], cum_c[order], rows[order], real[order]
        fate = admit(cum_c, real, log_tau, budget - drafted)
        width = min(tokens.shape[0], budget)  # the next level's rows: every node this one may admit
        admitted = fate == ADMITTED
        n = admitted.sum()
        total = drafted + n
        selected = torch.arange(width, device=tokens.device)
        record = torch.cat([tokens, lp, rows, fate, selected]).double()
        return (
            tokens,
            lp,
            rows,
            fate,
            cum_c,
            cum_c[:width],
            admitted[:width],
            total,
            torch.stack([n, total]),
            selected,
            record,
        )

    return decide


def admitted_levels(
    request: DraftRequest,
    cap: int,
    *,
    log_tau: float,
    budget: int,
    propose,
    key_of: tuple,
    inputs=(),
    ends_early: bool = True,
) -> list[ReadLevel]:
    """Up to `cap` levels whose candidates are admitted most probable first under a threshold and
    a node budget (common.admit_level), decided on the device, read once. `propose(level, logp,
    cum, valid, drafted)` gives a level's candidates (tokens, log-probs, float64 cumulative
    log-probs, proposing rows, and which are real) from its rows' distributions, cumulative
    log-probs and validity, and the nodes drafted before it; `key_of` names every Python value it
    reads (the policy's parameters: a captured step replays the values it was captured with);
    values that change from one iteration to the next go in as device tensors (`inputs`, handed to
    `propose` after `drafted`), not in the key. How many nodes a level admitted is
    read one level late (LateRead): a tree that ends early costs at most one wasted forward, and
    the counts bound the verify rows (read_verifying) near the tree's size. A tree that cannot end
    before `cap` (`ends_early=False`) runs every level without reading."""
    drafter = drafter_of(request)
    steps = drafter.steps
    levels: list[Level] = []
    late: list[LateRead] = []
    counts = None  # (admitted, drafted) through the level before the last, as read late
    for level in range(1, cap + 1):
        logits = level_forward(drafter, levels)  # over every row the level could have
        if level == 1:
            cum, valid, drafted = _start(steps, logits.device)
        # the level's decision, one captured step where forwards are (forward/capture.py): every value
        # it reads besides its tensors is in the key
        key = ("admit", key_of, level, tuple(logits.shape), log_tau, budget)
        tokens, lp, rows, fate, cum_c, cum, valid, drafted, count, selected, record = steps(
            key, _decision(propose, level, log_tau, budget, drafter.to_logp), logits, cum, valid, drafted, *inputs
        )
        levels.append(Level(tokens, lp, rows, fate, selected, cum_c, record, prefix=True, ranked=True))
        if ends_early:
            late.append(LateRead(count))
            if level >= 2:
                counts = late[-2].tolist()
                if counts[0] == 0 or counts[1] >= budget:  # the level before ended the tree: this one was spare
                    break
    # the verify rows: at most the budget; with the counts before the last level, at most the nodes
    # drafted then plus k children for each row the last level expanded (its rows: those admitted before)
    width = min(budget, sum(lv.tokens.shape[0] for lv in levels))
    if counts is not None:
        per_row = levels[-1].tokens.shape[0] // levels[-2].selected.shape[0]
        width = min(width, counts[1] + max(0, min(budget - counts[1], counts[0] * per_row)))
    return read_verifying(request, levels, width)


def grow_topk_on_device(request: DraftRequest, *, depth: int, branch: int, tau: float, budget: int) -> DraftTree:
    """static.grow_topk_tree (DynaTree Alg. 1: top-B children, lines 17-19 the threshold, lines
    12/22 the budget) with its levels decided on the device and read once."""
    tree, cap = start_tree(request, depth)
    if cap <= 0:
        return tree

    def propose(level, logp, cum, valid, drafted):
        tokens, lp, cum_c, rows = children(logp, cum, branch)
        return tokens, lp, cum_c, rows, valid[rows]

    # only a threshold, or a budget smaller than the levels before the last, ends a tree early
    ends_early = tau > 0 or budget <= sum(branch**d for d in range(1, cap))
    log_tau = safe_log(tau)
    levels = admitted_levels(
        request, cap, log_tau=log_tau, budget=budget, propose=propose, key_of=("topk", branch), ends_early=ends_early
    )
    return replay_topk(tree, levels, request.drafter, cap=cap, depth=depth, budget=budget)


def replay_topk(tree: DraftTree, levels: list[ReadLevel], drafter, *, cap: int, depth: int, budget: int) -> DraftTree:
    """The host half of grow_topk_on_device: grow_topk_tree's loop over the levels as read,
    stopping where it stops (an empty frontier, the budget spent before the last level)."""
    frontier, drafted = [0], 0
    for level, lv in enumerate(levels, start=1):
        frontier = replay_level(tree, frontier, frontier, lv, drafter)
        drafted += len(frontier)
        if not frontier:
            break
        if drafted >= budget and level < cap:
            for node in frontier:
                tree.mark_leaf(node, Reason.BUDGET)
            break
        if level == cap:
            for node in frontier:
                tree.mark_leaf(node, leaf_reason(cap, depth))
    return tree


def replay_level(tree: DraftTree, frontier: list[int], expand: list[int], lv: ReadLevel, drafter) -> list[int]:
    """One admitted level as read, on the host: the device ran every row of `frontier` (row r is
    frontier[r]); `expand`, the rows the host's rules expand, must be exactly the ones that
    proposed candidates there (checked: the two paths' rules agree). Adds the candidates in the
    device's order with their fates and returns the admitted nodes, most probable first: the
    next level's rows."""
    row_of = {node: row for row, node in enumerate(frontier)}
    if {row for row, fate in zip(lv.parents, lv.fate, strict=True) if fate != PADDING} != {row_of[n] for n in expand}:
        raise RuntimeError("the device's rules and the host's expanded different rows of a draft level")
    depth = tree.depths[frontier[0]]
    for node in expand:
        tree.mark_expanded(node)
        if node:
            drafter.bind(node, depth, row_of[node])
    added = []
    for tok, lp, row, fate in zip(lv.tokens, lv.logp, lv.parents, lv.fate, strict=True):
        if fate == ADMITTED:
            added.append(tree.add(frontier[row], tok, lp))
        elif fate != PADDING:
            reason = Reason.THRESHOLD if fate == THRESHOLD else Reason.BUDGET
            tree.add(frontier[row], tok, lp, status=Status.PRUNED, reason=reason)
    return added


def _grown(width: int, beam: int, last: bool, to_logp):
    """A level of grow_all_on_device as a pure function of its tensors (a captured step): each row's
    top `width` children; the next rows all of them, the `beam` most probable, or none (`last`)."""

    def grow(logits, cum):
        tokens, lp, cum_c, rows = children(to_logp(logits), cum, width)
        selected = torch.arange(tokens.shape[0], device=tokens.device)
        if beam:
            selected = most_probable_first(cum_c, torch.ones_like(tokens, dtype=torch.bool))[:beam]
        if last:
            selected = selected[:0]
        fate = torch.zeros_like(tokens)
        record = torch.cat([tokens, lp, rows, fate, selected]).double()
        return tokens, lp, rows, fate, selected, cum_c, cum_c[selected], record

    return grow


def grow_all_on_device(
    request: DraftRequest, widths: list[int], *, reason: Reason, beam: int = 0, tree: DraftTree | None = None, root=None
) -> DraftTree:
    """Trees whose every drafted child joins the tree, decided on the device and read once: level
    l proposes the top `widths[l]` children of each of its rows; the next level's rows are all of
    them, or with `beam` the `beam` most probable (ties in node order: eagle2.py's sort), the rest
    leaves (Reason.BEAM). EAGLE-2's beam (before its rerank, done on the host from the tree) and
    the delayed tree (delayed.py) are such trees; `reason` is their last level's leaf reason.
    `tree` and `root` (its log-probabilities from `expand_level(None, None, 0)`) pass in a root
    already run through the draft (delayed_auto chooses the shape from it)."""
    drafter = drafter_of(request)
    tree = tree if tree is not None else DraftTree.with_root(request.root_token)
    if not widths:
        tree.mark_leaf(0, reason)
        return tree
    levels: list[Level] = []
    for level, width in enumerate(widths, start=1):
        given = level == 1 and root is not None  # log-probabilities already
        logits = root if given else level_forward(drafter, levels)
        if level == 1:
            cum = _start(drafter.steps, logits.device)[0]
        last = level == len(widths)
        key = ("grow", level, width, beam, last, given, tuple(logits.shape))  # one captured step (forward/capture.py)
        to_logp = (lambda x: x) if given else drafter.to_logp
        *fields, cum, record = drafter.steps(key, _grown(width, beam, last, to_logp), logits, cum)
        levels.append(Level(*fields, record, prefix=not beam and not last))
    # every candidate is a node, except in a beam, whose tree the host reranks (eagle2.py) before it
    # is verified: no verify forward queued from its rows
    nodes = sum(lv.tokens.shape[0] for lv in levels)
    read = read_levels(levels) if beam else read_verifying(request, levels, nodes)
    frontier = [0]
    for level, lv in enumerate(read, start=1):
        expand_frontier(tree, frontier, drafter, level)
        rows = zip(lv.tokens, lv.logp, lv.parents, strict=True)
        new = [tree.add(frontier[r], tok, lp, reason=reason) for tok, lp, r in rows]
        frontier = [new[i] for i in lv.selected]
        if beam and level < len(widths):  # outside the beam: leaves
            for node in sorted(set(new) - set(frontier)):
                tree.mark_leaf(node, Reason.BEAM)
    return tree
