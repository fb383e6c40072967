"""A draft tree as tensors, grown one level per draft forward on whatever device the models are on.

drafting/device.py decides each level; this module holds the tree the levels make (`TensorTree`).
A level (`Level`) is one draft forward's candidates in the order the tree adds them: token, draft
log-probability, the row of the forward that proposed it (its parent), cumulative log-probability,
and two codes, its fate (admitted, pruned and why, padding) and, admitted, why it is not expanded
(0: it is, as a row of the next forward). Everything else comes from those tensors alone:

- the next forward's rows (`next_rows`);
- the target's verify rows (`rows`), built where the tree is, with no read: the admitted candidates
  in the bfs order (by depth, most probable first, ties in node order), padded to a width the host
  knows without reading;
- ONE device->host copy of the whole tree (`read`), with the engine's verify forward queued from
  the rows before the host waits for it where the engine asks (`DraftRequest.early`:
  decoding/batch.EarlyVerify);
- the `DraftTree` view the page, the records and the verifiers read (`view`), made once from that
  copy, and the order the target verified its nodes in: the rows' own.

The view applies no rule (the levels decided every fate), so the tree the host shows and the rows
the target read are one tree: there is nothing to replay and nothing to check.
"""

from __future__ import annotations

import dataclasses

import torch

from dynatree_core.core.transfer import LateRead, to_list
from dynatree_core.core.tree import DraftTree, Reason, Source, Status
from dynatree_core.forward.rows import lineage

# why an admitted candidate is not expanded (Level.leaf), the reasons a level records as codes
LEAF_REASONS = (None, Reason.DEPTH_LIMIT, Reason.LENGTH_LIMIT, Reason.BUDGET, Reason.EARLY_STOP, Reason.DEPTH_GATE)
LEAF_REASONS += (Reason.NO_SUCCESSORS, Reason.CONTEXT_END, Reason.CORPUS_END, Reason.SALF_STOP)
EXPANDED, AT_DEPTH, AT_LENGTH, OVER_BUDGET, EARLY_STOP, DEPTH_GATE, NO_SUCCESSORS, *_ = range(len(LEAF_REASONS))
SALF_STOPPED = LEAF_REASONS.index(Reason.SALF_STOP)

# a candidate's fate: the runs of a level ordered most probable first (admission.fates), in that order;
# then a node EAGLE-2's rerank left out (device.grow_all_levels), a candidate SALF's stop left out (salf.py)
ADMITTED, BUDGET, THRESHOLD, PADDING, RERANKED, STOPPED = range(6)
PRUNED = {BUDGET: Reason.BUDGET, THRESHOLD: Reason.THRESHOLD, RERANKED: Reason.RERANK, STOPPED: Reason.SALF_STOP}


@dataclasses.dataclass
class Level:
    """One draft forward's candidates in the order the tree adds them (device tensors), and which
    of them are the rows of the next forward (`selected`)."""

    tokens: torch.Tensor  # (C,) long
    logp: torch.Tensor  # (C,) float32: the draft's log-probability of the token
    parents: torch.Tensor  # (C,) long: the row of this forward that proposed it
    fate: torch.Tensor  # (C,) long: ADMITTED, BUDGET, THRESHOLD, PADDING (not a node), RERANKED or STOPPED
    leaf: torch.Tensor  # (C,) long: why an admitted candidate is not expanded (LEAF_REASONS; 0: it is)
    selected: torch.Tensor  # (W,) long: candidates that are the next forward's rows, in row order
    cum: torch.Tensor  # (C,) float64: cumulative log-probs (they order the verify rows)
    # the fields above but cum as one float64 row (float64 holds ids and float32 values exactly): what
    # `read` copies; made by the level's step where the levels run at fixed widths, else on reading
    record: torch.Tensor | None = None
    prefix: bool = False  # `selected` is every candidate up to its length: the next rows are a slice
    # the candidates are most probable first and the admitted ones lead (device.admitted_levels' levels):
    # the verify rows' order needs no sort by probability or depth
    ranked: bool = False
    # `selected` counts the candidates of every level so far, not this one's alone: a best-first
    # search's next rows may be any earlier candidates (salf.py)
    reach: bool = False

    def flat(self) -> torch.Tensor:
        if self.record is not None:
            return self.record
        return torch.cat([self.tokens, self.logp, self.parents, self.fate, self.leaf, self.selected]).double()

    @classmethod
    def of_record(cls, record: torch.Tensor, cum: torch.Tensor, ranked: bool, prefix: bool) -> Level:
        """The Level a record holds (its cumulative log-probs apart)."""
        c = cum.shape[0]
        tokens, logp, parents, fate, leaf, selected = record.split([c, c, c, c, c, record.shape[0] - 5 * c])
        fields = (tokens.long(), logp.float(), parents.long(), fate.long(), leaf.long(), selected.long(), cum, record)
        return cls(*fields, prefix=prefix, ranked=ranked)


@dataclasses.dataclass
class TreeRows:
    """The tree's admitted candidates as the rows of the target's verify forward, in bfs order,
    then padding rows up to the width asked for (a padding row sees only itself, nothing sees it)."""

    tokens: torch.Tensor  # (W,) long
    depths: torch.Tensor  # (W,) long: 1 for the root's children
    parents: torch.Tensor  # (W,) long: the parent's row, rows counted from 1 (0: the root); a padding row's own
    valid: torch.Tensor  # (W,) bool: a node (else padding)
    # (W + 1, d) long, the root's row first: each row, its parent's row, its parent's, ... (forward/rows.lineage;
    # the root and padding rows repeat themselves): whom each row sees (rows.Rows.batch)
    lines: torch.Tensor
    pick: torch.Tensor  # (W,) long: the candidate a row is, counted over the levels in order (padding: any)


@dataclasses.dataclass
class TensorTree:
    """A draft tree as tensors: the root's token and its levels, one a draft forward."""

    root_token: int
    levels: list[Level] = dataclasses.field(default_factory=list)

    def next_rows(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """The next draft forward's rows: (tokens, their parents' rows in the level before, depth);
        the root's (None, None, 0) first."""
        if not self.levels:
            return None, None, 0
        last = self.levels[-1]
        if last.prefix:  # the first candidates: views, no gather
            width = last.selected.shape[0]
            return last.tokens[:width], last.parents[:width], len(self.levels)
        return last.tokens[last.selected], last.parents[last.selected], len(self.levels)

    def width(self) -> int:
        """How many rows the next draft forward has: the root's one, then the last level's selected."""
        return self.levels[-1].selected.shape[0] if self.levels else 1

    def candidates(self) -> int:
        return sum(lv.tokens.shape[0] for lv in self.levels)

    def rows(self, width: int, steps=None) -> TreeRows:
        """The verify forward's `width` rows (at least the admitted candidates' count), in the order
        DraftTree.order("bfs") gives the view: by depth, most probable first, ties in node order.
        Where every level is `ranked` and a `prefix` (admitted_levels': each level's admitted
        candidates lead it, most probable first, and the next rows are its first candidates) that
        order is the admitted candidates as they come, so a candidate's row is the count of admitted
        ones up to it, each field one scatter; else three stable sorts give it, minor key first.
        Each row's lineage: the parent pointers followed to the root, one gather a level. What
        depends on the levels' sizes alone is made once per run where `steps` keeps constants
        (forward/capture.StepGraphs.constant), else here."""
        levels = self.levels
        sizes = tuple(lv.tokens.shape[0] for lv in levels)
        device = levels[0].tokens.device

        def constant(key, make):
            return make() if steps is None else steps.constant(key, make)

        depths = constant(("tree depths", sizes), lambda: _per_level(sizes, list(range(1, len(sizes) + 1)), device))
        tokens = torch.cat([lv.tokens for lv in levels])
        admitted = torch.cat([lv.fate for lv in levels]) == ADMITTED
        if all(lv.ranked and lv.prefix for lv in levels):
            # each candidate's parent candidate counted from 1 (0: the root): a level's parent rows
            # shifted by where the level before starts, plus 1 (a prefix: the candidate its row names)
            shifts = [0] + [sum(sizes[:i]) + 1 for i in range(len(sizes) - 1)]
            starts = constant(("tree parent starts", sizes), lambda: _per_level(sizes, shifts, device))
            n = max(sum(sizes), width + 2)  # 0, 1, ... and zeros, past the candidates and the rows
            counted = constant(
                ("tree index", n), lambda: torch.stack([torch.arange(n), torch.zeros(n).long()]).to(device)
            )
            up = torch.cat([lv.parents for lv in levels]) + starts
            rows, table = _ranked_rows(tokens, admitted, depths, up, counted, width)
        else:
            rows = _sorted_rows(tokens, admitted, depths, levels, width)
            table = torch.cat([rows.parents.new_zeros(1), rows.parents])
        rows.lines = lineage(table, len(levels))
        return rows

    def read(self, early, steps, width: int) -> tuple[list, list[int]]:
        """Every level's fields on the host, in ONE device->host copy (float64 holds ids and float32
        values exactly), and the verify rows' candidates (admitted ones only: a prefix of `pick`).
        Where the engine asked for it (`early`: decoding/batch.EarlyVerify) the rows are built and
        copied behind the draft, the verify forward is queued behind that copy, and the host waits
        for the copy alone (counted "late": the device is busy verifying meanwhile); the rows are
        built and the record copied as one captured step where `steps` capture. Without `early`,
        levels decided on a CPU with their counts read at once are read field by field, no record."""
        levels = self.levels
        if early is None:
            if levels[0].record is None and levels[0].tokens.device.type == "cpu":
                fields = ("tokens", "logp", "parents", "fate", "leaf", "selected")
                return [tuple(getattr(lv, f).tolist() for f in fields) for lv in levels], []
            return _parse(levels, to_list(_flat(levels)))
        if steps.capture:  # the rows and the record to read, one captured step (forward/capture.py)
            shapes = tuple((lv.tokens.shape[0], lv.selected.shape[0]) for lv in levels)
            ranked, prefix = all(lv.ranked for lv in levels), all(lv.prefix for lv in levels)
            inputs = [t for lv in levels for t in (lv.flat(), lv.cum)]
            *built, flat = steps(("rows", shapes, width, ranked, prefix), _verify_rows(ranked, prefix, width), *inputs)
            rows = TreeRows(*built)
        else:
            rows = self.rows(width, steps)
            flat = _flat(levels, rows)
        pending = LateRead(flat)
        early.launch(rows, depth=len(levels))
        return _parse(levels, pending.tolist(), rows)

    def view(
        self, tree: DraftTree, read: tuple, drafter, *, reason: Reason | None = None, draws=(), source=Source.MODEL
    ) -> list[int]:
        """Make `tree` (the root's view) the tree `read` holds: each candidate a node with its fate and,
        admitted, its leaf reason as the levels decided them (`reason`: an admitted candidate's
        whose level left it unexpanded without a code: the last level's, Reason.BEAM before it);
        each row of a level's forward, its node, expanded and bound to its draft cache slot
        (`Drafter.bind`), with sampled drafting what was drawn there (`draws`: each row's (q,
        tokens) in order, level by level: request.SampledLevels). `drafter`: None where no draft
        forward made the levels (drafting/sources.Recycler's walks); `source`: where the nodes' tokens
        came from. Returns the nodes in the order the verify rows hold them, the root first ([0]
        alone where no rows were read)."""
        levels, picks = read
        frontier = [0]  # the node of each row of the level's forward (None: a padding row)
        nodes: list[int | None] = []  # the node each candidate became, over the levels in order
        codes: list[int] = []  # their leaf codes
        reach = [lv.reach for lv in self.levels] or [False] * len(levels)  # records alone: levels of their own
        drawn = iter(draws)
        for level, (tokens, logp, parents, fate, leaf, selected) in enumerate(levels, start=1):
            for row, node in enumerate(frontier):
                if node is None or tree.status[node] == Status.PRUNED:  # padding; a reranked row
                    continue
                tree.mark_expanded(node)
                if node and drafter is not None:
                    drafter.bind(node, level - 1, row)
                if draws:
                    tree.record_draws(node, *next(drawn))
            default = reason if level == len(levels) else Reason.BEAM
            made = []
            for t, lp, r, f, code in zip(tokens, logp, parents, fate, leaf, strict=True):
                if f == PADDING:
                    made.append(None)
                elif f in PRUNED:  # never a row of a later forward, or (reranked) its children are pruned too
                    made.append(tree.add(frontier[r], t, lp, status=Status.PRUNED, reason=PRUNED[f], source=source))
                else:
                    made.append(tree.add(frontier[r], t, lp, reason=LEAF_REASONS[code] or default, source=source))
            nodes += made
            codes += leaf
            pool, pool_codes = (nodes, codes) if reach[level - 1] else (made, leaf)
            frontier = [pool[i] if pool_codes[i] == EXPANDED else None for i in selected]  # the next forward's rows
        return [0] + [nodes[c] for c in picks]


def _per_level(sizes: tuple[int, ...], values: list[int], device) -> torch.Tensor:
    """(sum(sizes),) long: each level's value repeated over its candidates."""
    return torch.cat([torch.full((c,), v, dtype=torch.long) for v, c in zip(values, sizes, strict=True)]).to(device)


def _ranked_rows(tokens, admitted, depths, up, counted, width: int) -> tuple[TreeRows, torch.Tensor]:
    """TensorTree.rows of ranked prefix levels and their parent table (the root's row first): a
    candidate's row is the count of admitted ones up to it; its parent's row, the row of its parent
    candidate (`up`, counted from 1; 0: the root); every field scattered to its row, the others to a
    spare slot past the last, dropped. `counted`: 0, 1, ... and zeros, past both the candidates and width + 1."""
    row = torch.cumsum(admitted, 0)  # an admitted candidate's row, counted from 1 (0: the root)
    up = torch.nn.functional.pad(row, (1, 0))[up]
    dest = torch.where(admitted, row, width + 1)
    slots, zeros = counted[0, : width + 2], counted[1, : width + 2]
    table = slots.scatter(0, dest, up)[: width + 1]  # parent rows, the root its own; padding: its own row
    fields = (tokens, depths, counted[0, : tokens.shape[0]])  # the last: a candidate's index
    tokens, depths, pick = [zeros.scatter(0, dest, f)[1 : width + 1] for f in fields]
    return TreeRows(tokens, depths, table[1:], slots[1 : width + 1] <= row[-1], None, pick), table


def _sorted_rows(tokens, admitted, depths, levels: list[Level], width: int) -> TreeRows:
    """TensorTree.rows of levels not ranked (delayed.py's, every candidate a node row by row;
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


def _flat(levels: list[Level], rows: TreeRows | None = None) -> torch.Tensor:
    """The levels' records (and the rows' candidates and count) as one float64 row: one copy reads it."""
    parts = [lv.flat() for lv in levels]
    if rows is not None:
        parts.append(torch.cat([rows.pick, rows.valid.sum()[None]]).double())
    return torch.cat(parts)


def _parse(levels: list[Level], values: list[float], rows: TreeRows | None = None) -> tuple[list, list[int]]:
    """`_flat`'s row as read: each level's fields as lists, and the verify rows' admitted candidates."""
    flat = iter(values)
    take = lambda n, kind=int: [kind(next(flat)) for _ in range(n)]  # noqa: E731
    out = []
    for lv in levels:
        c = lv.tokens.shape[0]
        out.append((take(c), take(c, float), take(c), take(c), take(c), take(lv.selected.shape[0])))
    if rows is None:
        return out, []
    picks = take(rows.tokens.shape[0])
    return out, picks[: take(1)[0]]


def _verify_rows(ranked: bool, prefix: bool, width: int):
    """TensorTree.rows and the record to read, as a pure function of the levels' records and
    cumulative log-probs (TensorTree.read's captured step)."""

    def build(*inputs):
        pairs = zip(inputs[::2], inputs[1::2], strict=True)
        tree = TensorTree(0, [Level.of_record(record, cum, ranked, prefix) for record, cum in pairs])
        rows = tree.rows(width)
        return rows.tokens, rows.depths, rows.parents, rows.valid, rows.lines, rows.pick, _flat(tree.levels, rows)

    return build
