"""A tree's draft levels as the device holds them, and the verify rows built from them there.

drafting/device.py grows the levels; this module holds what a level is on the device (`Level`)
and once read (`ReadLevel`), reads every level in one copy (`read_levels`), and builds the
target's verify rows from the levels without a read (`tree_rows`): the admitted candidates in the
tree's bfs order, their parents' rows, depths and lineages, padded to a width the
host knows. Where the engine queues the verify forward from those rows (decoding/batch.py,
`DraftRequest.early`), `read_verifying` builds them, copies the levels and rows behind the draft,
queues the forward, and only then waits for the copy.
"""

from __future__ import annotations

import dataclasses

import torch

from dynatree_core.core.transfer import LateRead, to_list
from dynatree_core.core.tree import DraftTree, Reason, Status
from dynatree_core.drafting.common import drafter_of
from dynatree_core.drafting.request import DraftRequest
from dynatree_core.forward.rows import lineage

# why an admitted candidate is not expanded (Level.leaf), the reasons a level records as codes
LEAF_REASONS = (None, Reason.DEPTH_LIMIT, Reason.LENGTH_LIMIT, Reason.BUDGET, Reason.EARLY_STOP, Reason.DEPTH_GATE)
EXPANDED, AT_DEPTH, AT_LENGTH, OVER_BUDGET, EARLY_STOP, DEPTH_GATE = range(len(LEAF_REASONS))


# a candidate's fate, as the level records it
# the runs of a level ordered most probable first (device.fates), in that order; then a node EAGLE-2's
# rerank left out (device.grow_all_levels)
ADMITTED, BUDGET, THRESHOLD, PADDING, RERANKED = 0, 1, 2, 3, 4


@dataclasses.dataclass
class Level:
    """One draft forward's candidates in the order the tree adds them (device tensors), and which
    of them are the rows of the next forward (`selected`)."""

    tokens: torch.Tensor  # (C,) long
    logp: torch.Tensor  # (C,) float32: the draft's log-probability of the token
    parents: torch.Tensor  # (C,) long: the row of this forward that proposed it
    fate: torch.Tensor  # (C,) long: ADMITTED, BUDGET, THRESHOLD or PADDING (a padded row's child)
    # (C,) long: why an admitted candidate is not expanded (an index of LEAF_REASONS; 0: it is, as
    # a row of the next forward), decided with its admission: the tree is read, not replayed
    leaf: torch.Tensor
    selected: torch.Tensor  # (W,) long: candidates that are the next forward's rows, in row order
    cum: torch.Tensor  # (C,) float64: cumulative log-probs (they order the verify rows: tree_rows)
    # the fields above but cum as one float64 row (tokens, logp, parents, fate, leaf, selected): what
    # is read (float64 holds ids and float32 values exactly); made by the level's step, else on reading
    record: torch.Tensor | None = None
    prefix: bool = False  # `selected` is every candidate up to its length: the next rows are a slice
    # the candidates are most probable first and the admitted ones lead (device.admitted_levels' levels):
    # the verify rows' order needs no sort by probability or depth (tree_rows)
    ranked: bool = False

    def flat(self) -> torch.Tensor:
        if self.record is not None:
            return self.record
        return torch.cat([self.tokens, self.logp, self.parents, self.fate, self.leaf, self.selected]).double()

    @classmethod
    def of_record(cls, record: torch.Tensor, cum: torch.Tensor, ranked: bool = False, prefix: bool = False) -> Level:
        """The Level a record holds (its cumulative log-probs apart)."""
        c = cum.shape[0]
        tokens, logp, parents, fate, leaf, selected = record.split([c, c, c, c, c, record.shape[0] - 5 * c])
        fields = (tokens.long(), logp.float(), parents.long(), fate.long(), leaf.long(), selected.long(), cum, record)
        return cls(*fields, prefix=prefix, ranked=ranked)


@dataclasses.dataclass
class ReadLevel:
    """A Level on the host."""

    tokens: list[int]
    logp: list[float]
    parents: list[int]
    fate: list[int]
    leaf: list[int]
    selected: list[int]


@dataclasses.dataclass
class TreeRows:
    """The tree's nodes as the rows of the target's verify forward, built on the device from the
    levels (no host read): the admitted candidates in the order DraftTree.order("bfs") gives the
    tree view the host reads (by depth, most probable first, ties in node order), then padding rows
    up to a width the host knows without reading (admitted_levels bounds it by the counts read late)."""

    tokens: torch.Tensor  # (W,) long
    depths: torch.Tensor  # (W,) long: 1 for the root's children
    parents: torch.Tensor  # (W,) long: the parent's row, rows counted from 1 (0: the root); a padding row's own
    valid: torch.Tensor  # (W,) bool: a node (else padding: it sees only itself, nothing sees it)
    # (W + 1, d) long, the root's row first: each row, its parent's row, its parent's, ... (forward/rows.lineage;
    # the root and padding rows repeat themselves): whom each row sees (rows.tree_seen)
    lines: torch.Tensor
    pick: torch.Tensor  # (W,) long: the candidate a row is, counted over the levels in order (padding: any)


@dataclasses.dataclass
class ReadRows:
    """TreeRows on the host: what the engine checks the tree's view against."""

    tokens: list[int]
    parents: list[int]
    pick: list[int]
    nodes: int  # valid rows (a prefix)
    # the tree view's node of each valid row, the root's first (set once the view is made: rows_order)
    order: list[int] = dataclasses.field(default_factory=list)


def tree_rows(levels: list[Level], width: int) -> TreeRows:
    """The verify forward's `width` rows (at least the admitted candidates' count) from the levels,
    in the order DraftTree.order("bfs") gives the tree view: by depth, most probable first, ties in
    node order. Where every level is `ranked` and a `prefix` (admitted_levels' levels: each level's
    admitted candidates lead it, most probable first, and the next rows are its first candidates)
    that order is the levels' admitted candidates as they come, so a candidate's row is the count
    of admitted ones up to it, each field one scatter; else three stable sorts give it, minor key
    first. Each row's lineage: the parent pointers followed to the root, one gather a level."""
    tokens = torch.cat([lv.tokens for lv in levels])
    device = tokens.device
    admitted = torch.cat([lv.fate for lv in levels]) == ADMITTED
    depths = torch.cat([torch.full_like(lv.tokens, d) for d, lv in enumerate(levels, start=1)])
    if all(lv.ranked and lv.prefix for lv in levels):
        row = torch.cumsum(admitted, 0)  # an admitted candidate's row, counted from 1 (0: the root)
        # each candidate's parent's row: the root's for the first level; else the row of the
        # candidate of the level before that proposed it (a prefix: the candidate its row names)
        up, start = [torch.zeros_like(levels[0].tokens)], 0
        row0 = torch.cat([up[0][:1], row])
        for prev, lv in zip(levels[:-1], levels[1:], strict=True):
            up.append(lv.parents + (start + 1))
            start += prev.tokens.shape[0]
        up = row0[torch.cat(up)]
        # every field scattered to its row; the others go to a spare slot past the last, dropped
        dest = torch.where(admitted, row, width + 1)
        slots = torch.arange(width + 2, device=device)
        table = slots.scatter(0, dest, up)[: width + 1]  # parent rows, the root its own; padding: its own row
        fields = (tokens, depths, torch.arange(tokens.shape[0], device=device))  # the last: a candidate's index
        tokens, depths, pick = [tokens.new_zeros(width + 2).scatter(0, dest, f)[1 : width + 1] for f in fields]
        rows = TreeRows(tokens, depths, table[1:], slots[1 : width + 1] <= row[-1], None, pick)
    else:
        rows = _sorted_rows(tokens, admitted, depths, levels, width)
        table = torch.cat([rows.parents.new_zeros(1), rows.parents])
    rows.lines = lineage(table, len(levels))  # no row is deeper than the levels
    return rows


def _sorted_rows(tokens, admitted, depths, levels: list[Level], width: int) -> TreeRows:
    """tree_rows' rows of levels not ranked (delayed.py's, every candidate a node row by row;
    eagle2's beam, reranked): three stable sorts give the bfs order, minor key first."""
    device = tokens.device
    parent, start = [torch.full_like(levels[0].tokens, -1)], 0  # each candidate's parent candidate (-1: root)
    for prev, lv in zip(levels[:-1], levels[1:], strict=True):
        parent.append(start + prev.selected[lv.parents])
        start += prev.tokens.shape[0]
    parent = torch.cat(parent)
    order = torch.sort(torch.cat([lv.cum for lv in levels]), descending=True, stable=True).indices
    order = order[torch.sort(depths[order], stable=True).indices]
    order = order[torch.sort((~admitted[order]).to(torch.int8), stable=True).indices]
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(1, order.shape[0] + 1, device=device)
    pick, rows = order[:width], torch.arange(1, width + 1, device=device)
    valid = admitted[pick]
    up = parent[pick]
    parents = torch.where(valid, torch.where(up >= 0, row_of[up.clamp(min=0)], 0), rows)
    return TreeRows(tokens[pick], depths[pick], parents, valid, None, pick)


def read_levels(levels: list[Level]) -> list[ReadLevel]:
    """Every level's record in ONE device->host copy (float64 holds ids and float32 values exactly);
    levels decided on a CPU with their counts read at once (no record made), field by field."""
    if levels and levels[0].record is None and levels[0].tokens.device.type == "cpu":
        fields = ("tokens", "logp", "parents", "fate", "leaf", "selected")
        return [ReadLevel(*(getattr(lv, f).tolist() for f in fields)) for lv in levels]
    return _parse(levels, to_list(_flat(levels)))


def _flat(levels: list[Level], rows: TreeRows | None = None) -> torch.Tensor:
    parts = [lv.flat() for lv in levels]
    if rows is not None:
        parts.append(torch.cat([rows.tokens, rows.parents, rows.pick, rows.valid.sum()[None]]).double())
    return torch.cat(parts)


def _parse(levels: list[Level], values: list[float], rows: TreeRows | None = None) -> list[ReadLevel]:
    flat = iter(values)
    take = lambda n, kind=int: [kind(next(flat)) for _ in range(n)]  # noqa: E731
    out = []
    for lv in levels:
        c = lv.tokens.shape[0]
        out.append(ReadLevel(take(c), take(c, float), take(c), take(c), take(c), take(lv.selected.shape[0])))
    if rows is not None:
        w = rows.tokens.shape[0]
        out.append(ReadRows(take(w), take(w), take(w), take(1)[0]))
    return out


def read_verifying(request: DraftRequest, levels: list[Level], width: int) -> list[ReadLevel]:
    """read_levels, with the target's verify forward queued from the tree's rows first where the
    engine asked for it (`request.early`: decoding/batch.EarlyVerify): the levels and rows are
    copied into pinned memory behind the draft, the verify forward is queued behind that copy, and
    the host waits for the copy alone (counted "late": the device is busy verifying meanwhile),
    then makes the tree's view while the target runs. The rows as read go to `request.early.read`."""
    early = request.early
    if early is None:
        return read_levels(levels)
    steps = drafter_of(request).steps
    if steps.capture:  # the rows and the record to read, one captured step (forward/capture.py)
        shapes = tuple((lv.tokens.shape[0], lv.selected.shape[0]) for lv in levels)
        inputs = [t for lv in levels for t in (lv.flat(), lv.cum)]
        ranked = all(lv.ranked for lv in levels)
        prefix = all(lv.prefix for lv in levels)
        *built, flat = steps(("rows", shapes, width, ranked, prefix), _verify_rows(width, ranked, prefix), *inputs)
        rows = TreeRows(*built)
    else:
        rows = tree_rows(levels, width)
        flat = _flat(levels, rows)
    pending = LateRead(flat)
    early.launch(rows, depth=len(levels))
    *read, early.read = _parse(levels, pending.tolist(), rows)
    return read


def rows_order(request: DraftRequest, nodes: list[int | None]) -> None:
    """Name the tree view's node of each verify row the device built (`nodes`: the node each
    candidate became, counted over the levels in order): the order the target verified them in."""
    early = request.early
    if early is not None and early.read is not None:
        read = early.read
        early.read.order = [0] + [nodes[c] for c in read.pick[: read.nodes]]


def _verify_rows(width: int, ranked: bool, prefix: bool):
    """tree_rows and the record to read, as a pure function of the levels' records and cumulative
    log-probs (read_verifying's step)."""

    def build(*inputs):
        pairs = zip(inputs[::2], inputs[1::2], strict=True)
        levels = [Level.of_record(record, cum, ranked, prefix) for record, cum in pairs]
        rows = tree_rows(levels, width)
        return rows.tokens, rows.depths, rows.parents, rows.valid, rows.lines, rows.pick, _flat(levels, rows)

    return build


def expand_frontier(tree: DraftTree, frontier: list[int], drafter, level: int) -> None:
    """The host side of a level's forward over `frontier` (its rows in order): the nodes are
    expanded, and the drafter learns their cache slots (`Drafter.bind`; the root's is known)."""
    for row, node in enumerate(frontier):
        if node is None:  # a padding row
            continue
        tree.mark_expanded(node)
        if node:
            drafter.bind(node, level - 1, row)


def admitted_tree(tree: DraftTree, read: list[ReadLevel], drafter, draws=None) -> tuple[DraftTree, list[int | None]]:
    """The DraftTree the levels hold, as read: each candidate a node with its fate and leaf reason
    as the level decided them; each row of a level's forward, its node, expanded (and bound to its
    draft cache slot: `Drafter.bind`), with sampled drafting what was drawn there (`draws`: each
    expanded row's (q, tokens) in order, level by level: request.SampledLevels). No rule is
    applied here. Also the node each candidate became (None: not a node), counted over the levels
    in order."""
    frontier = [0]  # the node of each row of the level's forward (None: a padding row)
    nodes: list[int | None] = []
    drawn = iter(draws or ())
    for level, lv in enumerate(read, start=1):
        expand_frontier(tree, frontier, drafter, level)
        for node in frontier if draws else ():
            if node is not None:
                tree.record_draws(node, *next(drawn))
        grows: list[int | None] = []  # per candidate: its node if it is a row of the next forward
        for tok, lp, row, fate, leaf in zip(lv.tokens, lv.logp, lv.parents, lv.fate, lv.leaf, strict=True):
            node = None
            if fate == ADMITTED:
                node = tree.add(frontier[row], tok, lp, reason=LEAF_REASONS[leaf])
            elif fate != PADDING:
                reason = Reason.THRESHOLD if fate == THRESHOLD else Reason.BUDGET
                tree.add(frontier[row], tok, lp, status=Status.PRUNED, reason=reason)
            nodes.append(node)
            grows.append(node if fate == ADMITTED and leaf == EXPANDED else None)
        frontier = [grows[i] for i in lv.selected]
    return tree, nodes
