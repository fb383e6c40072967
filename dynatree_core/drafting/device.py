"""A tree's draft levels decided as tensors, on whatever device the models are on.

Every greedy ("top") level-by-level tree policy drafts here, and sampled fixed_tree, linear and delayed
(salf and dyspec grow the same tree by best-first searches: salf.py, dyspec.py, search.py). A level is one
draft forward over its rows; its decision (the children each row proposes, their order, which are
admitted under a threshold and a node budget, and why an admitted child will not be expanded) is
a few tensor operations on the level's log-probabilities, recorded as a `Level` of the iteration's
one tree (`TensorTree`, tensor_tree.py). The `DraftTree` the page, the records and the verifiers
read is a view made from that tree once it is read: nothing is decided twice, nothing replayed.

Two ways to run the levels (`DraftRequest.on_device`, the engine's `ForwardSettings.device_draft`):

- on a CPU (and wherever the host reads for free) each level's count is read at once and the next
  level's rows are exactly the children to expand;
- on a GPU every device->host read waits for the queue to drain, so a level runs at a fixed width
  (every row the level could have; rows that expand nothing are padded and marked), whether a
  level expanded anything is read one level late (transfer.LateRead: a tree that ends early costs
  one spare forward), and the levels are read in ONE copy after the last draft forward. A level's
  decision runs after its forward inside the forward's captured step (Drafter.expand_level's
  `then`; forward/capture.py): a level is one launch. SGLang's EAGLE worker keeps its draft loop
  on the GPU the same way (docs/gpu.md).

Two shapes of tree: `admitted_levels` (fixed_tree, linear, dynatree, dyspec_threshold: a level's
candidates admitted most probable first under a threshold and a budget, each admitted one with
its leaf reason from the policy's `gate`) and `grow_all_levels` (eagle2's beam, delayed and
delayed_auto: every child joins the tree). The tree's one read, its view and the verify rows built
from it are tensor_tree.py's. Sampled drafting (fixed_tree, linear, delayed, delayed_auto) draws its
children on the host, row by row with the run's generator (request.SampledLevels), then decides
as greedy levels do.

Cumulative log-probabilities are float64, as Python's floats are, so every comparison
(threshold, order, ties) decides as the papers' host loops would (tests/test_device_draft.py
checks the trees against those loops, kept there as the reference).
"""

from __future__ import annotations

import torch

from dynatree_core.core.transfer import LateRead, to_list
from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.drafting.admission import LeafGate, admit, budget_gate, most_probable_first
from dynatree_core.drafting.admission import enabled as admission_kernel
from dynatree_core.drafting.common import drafter_of, safe_log, start_tree
from dynatree_core.drafting.request import DraftRequest, SampledLevels
from dynatree_core.drafting.tensor_tree import (
    ADMITTED,
    PADDING,
    RERANKED,
    Level,
    TensorTree,
)


def children(top: tuple[torch.Tensor, torch.Tensor], cum: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """The top-k children of every row, flattened row-major (the papers' loops' candidate order),
    from the rows' top log-probabilities and ids (`Drafter.level_top`): tokens, float32 log-probs
    and float64 cumulative log-probs (NaN where the row is not real: a padded or gated row's)."""
    top_lp, top_tok = top[0][:, :k], top[1][:, :k]
    return top_tok.flatten(), top_lp.flatten(), (cum[:, None] + top_lp).flatten()


def level_forward(drafter, grown: TensorTree, then: tuple):
    """The tree's next level's ONE draft forward (the root's first, then the rows the last level
    selected) and its decision `then` = (key, fn, inputs): fn(its logits, *inputs), captured in
    one step with the forward where the run captures its levels (Drafter.expand_level)."""
    return drafter.expand_level(*grown.next_rows(), then=then)


def viewed(request: DraftRequest, grown: TensorTree, tree: DraftTree, width: int, *, reason=None, draw=None):
    """`tree` made the view of the grown tree, read in one copy (TensorTree.read, the verify forward
    queued from its rows first where the engine asks: `request.early`, which then gets the order
    its rows hold the nodes in)."""
    drafter = drafter_of(request)
    order = grown.view(
        tree, grown.read(request.early, drafter.steps, width), drafter, reason=reason, draws=draw.rows if draw else ()
    )
    if request.early is not None:
        request.early.order = order
    return tree


def _start(steps, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The root level's row: cumulative log-prob 0 (real), nothing drafted (made once per run)."""
    return (
        steps.constant(("cum0",), lambda: torch.zeros(1, dtype=torch.float64, device=device)),
        steps.constant(("drafted0",), lambda: torch.zeros((), dtype=torch.long, device=device)),
    )


def _index(steps, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """0..n-1, the row that proposes each of n candidates at k a row, and 0..n-1 as float64 (a
    record's part: made once per shape, never written)."""
    index = steps.constant(("index", n), lambda: torch.arange(n, device=device))
    rows = steps.constant(("rows", n, k), lambda: torch.div(index, k, rounding_mode="floor"))
    return index, rows, steps.constant(("index64", n), lambda: index.double())


def _decision(propose, gate: LeafGate, level: int, log_tau: float, top, k: int, record: bool, kernel: bool):
    """A level's decision as a pure function of its tensors (a captured step: admitted_levels):
    the candidates `propose` gives from each row's top `k` (`top`: Drafter.level_top), then their
    admission (admission.admit: most probable first, their fates, the leaf code `gate` gives each
    admitted one, the next level's rows, the (to expand, drafted) counts and, with `record`, the
    level's record to read; `kernel`: by admission's kernel)."""
    how = dict(log_tau=log_tau, gate=gate, level=level, record=record, kernel=kernel)

    def decide(logits, cum, drafted, index, rows, index64, *inputs):
        tokens, lp, cum_c = propose(level, top(logits, k), cum, *inputs)
        n = tokens.shape[0]
        if rows.shape[0] != n:  # a vocabulary smaller than k: fewer children a row
            rows = torch.div(index[:n], n // cum.shape[0], rounding_mode="floor")
        return admit(tokens, lp, cum_c, rows, drafted, index, index64, **how)

    return decide


def admitted_levels(
    request: DraftRequest,
    tree: DraftTree,
    cap: int,
    *,
    log_tau: float,
    k: int,
    propose,
    gate: LeafGate,
    key_of: tuple,
    inputs=(),
    ends_early: bool = True,
    draw=None,
) -> DraftTree:
    """Up to `cap` levels whose candidates are admitted most probable first under a threshold and
    the node budget `gate.budget` (the papers' admit_level), each admitted one a leaf or not by
    `gate` (admission.LeafGate: its leaf code, LEAF_REASONS; its rules, the depth cap, the budget and
    thresholds on cum, make the admitted ones it lets grow lead the order), read into `tree`.
    `propose(level, top, cum, *inputs)` gives a level's candidates (tokens, float32 log-probs,
    float64 cumulative log-probs: NaN where not real) from its rows' top `k` log-probabilities and
    ids and cumulative log-probs (NaN: a row not to expand), `k` children a row. `key_of` names
    every Python value they read (a captured step replays the values it was captured with); values
    that change from one iteration to the next go in as device tensors (`inputs`), not in the key.

    On a CPU (`request.on_device` off) each level's counts are read at once and the next rows are
    the children to expand. On the device, levels run at fixed widths and whether one expanded
    anything is read one level late (LateRead): a tree that ends early costs at most one wasted
    forward, and the counts bound the verify rows (TensorTree.read) near the tree's size. A tree
    that cannot end before `cap` (`ends_early=False`) runs every level without reading.

    Sampled drafting (`draw`: request.SampledLevels) reads each row's children from its draws in
    place of its top k: host work with the run's generator, after the level's forward, each
    level's counts read at once (never a captured step, whose replay would not draw again)."""
    drafter, budget = drafter_of(request), gate.budget
    on_device = request.on_device and draw is None
    steps = drafter.steps
    kernel = admission_kernel(steps.device.type)  # asked here, outside any captured step
    grown = TensorTree(request.root_token)
    levels = grown.levels
    late: list[LateRead] = []
    counts = None  # (to expand, drafted) through the level before the last, as read late
    drafted_now = None  # on a CPU: the nodes drafted, read at once
    for level in range(1, cap + 1):
        if level == 1:
            cum, drafted = _start(steps, steps.device)
        n = grown.width()
        index, rows, index64 = _index(steps, n * k, k, steps.device)
        # the level's forward over its rows and its decision, one captured step where forwards are
        # (forward/capture.py): every value the decision reads besides its tensors is in the key
        key = ("admit", key_of, level, n, log_tau, budget, on_device, kernel)
        decide = _decision(propose, gate, level, log_tau, draw or drafter.level_top, k, on_device, kernel)
        then = (key, decide, (cum, drafted, index, rows, index64, *inputs))
        if draw is None:
            fields = level_forward(drafter, grown, then)
        else:  # the draft's log-probabilities, then the draws on the host
            fields = decide(level_forward(drafter, grown, None), *then[2])
        tokens, lp, rows, fate, leaf, cum_c, cum, drafted, count, record = fields
        selected = index[: cum.shape[0]]
        if not on_device:  # a read costs nothing: the next rows are the children to expand
            grows, drafted_now = to_list(count)  # a read per level: free on a CPU, counted
            selected = selected[:grows]  # the children to expand lead the admitted ones
            cum = cum[:grows]
            levels.append(Level(tokens, lp, rows, fate, leaf, selected, cum_c, ranked=True, prefix=True))
            if grows == 0:
                break
            continue
        levels.append(Level(tokens, lp, rows, fate, leaf, selected, cum_c, record, prefix=True, ranked=True))
        if ends_early:
            late.append(LateRead(count))
            if level >= 2:
                counts = late[-2].tolist()
                if counts[0] == 0:  # the level before expanded nothing: this one was spare
                    break
    # the verify rows: the tree's nodes; on the device at most the budget, and with the counts before
    # the last level at most the nodes drafted then plus k children for each row the last level expanded
    width = min(budget, grown.candidates())
    if drafted_now is not None:
        width = drafted_now
    elif counts is not None:
        per_row = levels[-1].tokens.shape[0] // levels[-2].selected.shape[0]
        width = min(width, counts[1] + max(0, min(budget - counts[1], counts[0] * per_row)))
    return viewed(request, grown, tree, width, draw=draw)


def grow_topk_levels(request: DraftRequest, *, depth: int, branch: int, tau: float, budget: int) -> DraftTree:
    """fixed_tree's and linear's tree as levels (DynaTree Alg. 1: top-B children, lines 17-19 the threshold,
    lines 12/22 the budget); sampled drafting's children are each row's B draws (SampledLevels)."""
    tree, cap = start_tree(request, depth)
    if cap <= 0:
        return tree

    def propose(level, top, cum):
        return children(top, cum, branch)

    # only a threshold, or a budget smaller than the levels before the last, ends a tree early
    ends_early = tau > 0 or budget <= sum(branch**d for d in range(1, cap))
    return admitted_levels(
        request,
        tree,
        cap,
        log_tau=safe_log(tau),
        k=branch,
        propose=propose,
        gate=budget_gate(cap, depth, budget),
        key_of=("topk", branch, cap, depth),
        ends_early=ends_early,
        draw=None if request.draw == "top" else SampledLevels(request),
    )


def _grown(width: int, beam: int, last: bool, top, record: bool, sampled: bool = False):
    """A level of grow_all_levels as a pure function of its tensors (a captured step): each row's
    top `width` children (`sampled`: its distinct draws, NaN after them: not children); the next
    rows all of them, the `beam` most probable, or none (`last`); with `record`, the level's record
    to read in one copy."""

    def grow(logits, cum, index, rows):
        tokens, lp, cum_c = children(top(logits, width), cum, width)
        n = tokens.shape[0]
        if rows.shape[0] != n:  # a vocabulary smaller than the width: fewer children a row
            rows = torch.div(index[:n], n // cum.shape[0], rounding_mode="floor")
        selected = index[:n]
        if beam:
            selected = most_probable_first(cum_c)[:beam]
        fate = torch.zeros_like(tokens)  # every child ADMITTED; the leaf codes: EXPANDED (read from `selected`)
        if sampled:  # a free shape: on the host, where draws are made
            real = cum_c == cum_c
            selected, fate = selected[real], torch.where(real, fate, PADDING)
        if last:
            selected = selected[:0]
        flat = torch.cat([tokens, lp, rows, fate, fate, selected]).double() if record else cum_c[:0]  # none: a view
        return tokens, lp, rows, fate, fate, selected, cum_c, cum_c[selected], flat

    return grow


def _reranked(keep: int):
    """EAGLE-2's rerank (App. B) as a pure function of the levels' cumulative log-probs (a captured
    step): the `keep` most probable candidates, ties in node order, ADMITTED, the rest RERANKED. A
    path's probability never exceeds its parent's, so the kept ones are closed under parents."""

    def rerank(*cums):
        order = most_probable_first(torch.cat(cums))
        return (torch.full_like(order, RERANKED).scatter(0, order[:keep], ADMITTED),)

    return rerank


def grow_all_levels(
    request: DraftRequest,
    widths: list[int],
    *,
    reason: Reason,
    beam: int = 0,
    keep: int = 0,
    tree: DraftTree | None = None,
    root=None,
    draw=None,
) -> DraftTree:
    """Trees whose every drafted child joins the tree, decided on the device and read once: level
    l proposes the top `widths[l]` children of each of its rows; the next level's rows are all of
    them, or with `beam` the `beam` most probable (ties in node order: eagle2.py's sort), the rest
    leaves (Reason.BEAM). With `keep`, EAGLE-2's rerank then keeps the `keep` most probable nodes
    for verification, on the device, and withdraws the rest (Reason.RERANK). The beam (eagle2.py)
    and the delayed tree (delayed.py) are such trees; `reason` is their last level's leaf reason.
    `tree` and `root` (its log-probabilities from `expand_level(None, None, 0)`) pass in a root
    already run through the draft (delayed_auto chooses the shape from it). Sampled drafting
    (`draw`: request.SampledLevels): each row's children are its distinct draws, on the host after
    the level's forward (never a captured step), recorded on the row's node."""
    drafter = drafter_of(request)
    tree = tree if tree is not None else DraftTree.with_root(request.root_token)
    if not widths:
        tree.mark_leaf(0, reason)
        return tree
    grown = TensorTree(request.root_token)
    levels = grown.levels
    steps, on_device = drafter.steps, request.on_device and draw is None
    for level, width in enumerate(widths, start=1):
        given = level == 1 and root is not None  # its top children already
        if level == 1:
            cum = _start(steps, steps.device)[0]
        last = level == len(widths)
        n = grown.width()
        index, rows, _ = _index(steps, n * width, width, steps.device)
        # the forward and the level, one captured step (forward/capture.py); the record read in one copy on the device
        key = ("grow", level, width, beam, last, given, n, on_device)
        top = (lambda lp, k: lp.topk(min(k, lp.shape[-1]), dim=-1)) if given else drafter.level_top
        grow = _grown(width, beam, last, draw or top, on_device, draw is not None)
        if draw is not None:  # the draft's log-probabilities, then the draws on the host
            *fields, cum, record = grow(root if given else level_forward(drafter, grown, None), cum, index, rows)
        elif given:
            *fields, cum, record = steps(key, grow, root, cum, index, rows)
        else:
            *fields, cum, record = level_forward(drafter, grown, (key, grow, (cum, index, rows)))
        prefix = not beam and not last and draw is None
        levels.append(Level(*fields, record if on_device else None, prefix=prefix))
    nodes = grown.candidates()
    if keep:  # the rerank's fates replace the levels' (every child ADMITTED): their records are made again
        sizes = [lv.tokens.shape[0] for lv in levels]
        (fates,) = drafter.steps(("rerank", tuple(sizes), keep), _reranked(keep), *(lv.cum for lv in levels))
        for lv, fate in zip(levels, fates.split(sizes), strict=True):
            lv.fate, lv.record = fate, None
    # the verify rows: every node, or the ones the rerank kept; the nodes outside the beam are leaves
    return viewed(request, grown, tree, min(keep, nodes) if keep else nodes, reason=reason, draw=draw)
