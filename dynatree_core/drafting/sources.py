"""Candidates that cost no draft forward, and how they join a tree.

- `Recycler`: Token Recycling's adjacency matrix (Luo et al., ACL 2025, §3.1): token -> the
  target's `k` most likely successors, refreshed from every row of every verify forward (and the
  prefill's), the latest forward that saw a token winning. `walk` is the paper's breadth-first
  walk of the matrix over a static tree template (§3.2).
- `SuffixAutomaton`: the online suffix automaton of SAM-Decoding (Hu et al., ACL 2025, §3.1;
  Blumer et al.'s construction): over the context (prompt + output so far), extended a token at a
  time in amortised O(1). The longest suffix of the context that occurred before is the state
  behind the last one's suffix link (`match`), so retrieval costs O(1) too (§3.2); the tokens
  that followed its occurrences are that state's transitions (`walk`).
- `graft`: put one source's tree into another, merging equal paths: a joined tree is one tree,
  verified in one target forward.

Each source builds a `DraftTree` whose nodes carry their `Source`; no model is called here. The
Recycler's walks grow their levels as a tensor tree (drafting/tensor_tree.py: a level's decision a
few tensor ops where the matrix is), read once and viewed as a model's levels are; the automaton's
walk (and the corpus's, and prompt lookup's trie) lists its levels on the host, where its structure
is, as the level records a read returns (`listed_tree`), viewed the same way.
"""

from __future__ import annotations

import itertools
import math

import torch

from dynatree_core.core.tree import DraftTree, Reason, Source, Status
from dynatree_core.drafting.tensor_tree import (
    ADMITTED,
    AT_DEPTH,
    EXPANDED,
    LEAF_REASONS,
    NO_SUCCESSORS,
    OVER_BUDGET,
    PADDING,
    TensorTree,
)


class Recycler:
    """Token Recycling's adjacency matrix as tensors on the models' device: row t holds the `k`
    most likely successors of token t (ids, as float32: exact below 2^24, and log-probs) and
    whether a forward has read t yet. The refresh and the walk run where the logits are; a tree is
    read to the host once (`walk`)."""

    def __init__(self, k: int):
        self.k = k
        self.rows: torch.Tensor | None = None  # (vocab, k, 2): successor id, its log-prob; most likely first
        self.seen: torch.Tensor | None = None  # (vocab,) bool

    def observe(self, tokens: list[int], logits: torch.Tensor) -> None:
        """Refresh from one forward: `logits[i]` is the target's distribution of the token after
        `tokens[i]` (every row, accepted or not: the paper's "trash"); a token on two rows keeps
        the later row's."""
        if not tokens:
            return
        logits = logits.float()
        vocab = logits.shape[-1]
        if self.rows is None or self.rows.shape[0] != vocab or self.rows.device != logits.device:
            self.rows = torch.zeros(vocab, min(self.k, vocab), 2, device=logits.device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        last = {token: row for row, token in enumerate(tokens)}  # the later row wins
        at = torch.tensor(list(last), device=logits.device)
        if len(last) < len(tokens):  # a copy of the rows kept only when a token repeats
            logits = logits[torch.tensor(list(last.values()), device=logits.device)]
        top, ids = logits.topk(self.rows.shape[1], dim=-1)
        lp = top - logits.logsumexp(dim=-1, keepdim=True)  # log-softmax at the top k only
        self.rows[at] = torch.stack([ids.float(), lp], dim=-1)
        self.seen[at] = True

    def successors(self, token: int) -> tuple[list[int], list[float]] | None:
        """Token's row (ids, log-probs), or None before a forward has read it (a host read)."""
        if self.seen is None or not bool(self.seen[token]):
            return None
        ids, lp = self.rows[token].unbind(-1)
        return [int(i) for i in ids.tolist()], lp.tolist()

    def known(self) -> set[int]:
        """The tokens a forward has read (a host read)."""
        return set() if self.seen is None else set(self.seen.nonzero().flatten().tolist())

    def walk(self, root: int, widths: list[int], budget: int) -> DraftTree:
        """The breadth-first walk from `root` over the template: a node at depth d - 1 gets the
        first `widths[d - 1]` successors of its token, up to `budget` nodes in breadth-first
        order; a token with no successors yet is a leaf. Each template level is a level of a
        tensor tree (drafting/tensor_tree.py): a gather of its parents' rows; the budget is one
        count over every level at the end (a slot past it has every slot below it past it too);
        the tree is read once and viewed as every tree is."""
        if self.rows is None or not widths:
            return _leaf(root, Reason.NO_SUCCESSORS) if self.rows is None else DraftTree.with_root(root)
        dev, fans = self.rows.device, [min(w, self.rows.shape[1]) for w in widths]
        tokens = torch.tensor([root], device=dev)
        ok = torch.ones(1, dtype=torch.bool, device=dev)  # a slot holding a node, the budget aside
        found, oks = [], []
        for fan in fans:
            level = self.rows[tokens, :fan].flatten(0, 1)  # (slots * fan, 2)
            parents = torch.arange(level.shape[0], device=dev) // fan
            ok = (ok & self.seen[tokens])[parents]  # a child of a node whose token has successors
            tokens = level[:, 0].long()
            found.append((tokens, level[:, 1], parents))
            oks.append(ok)
        ok = torch.cat(oks)
        return self._viewed(root, found, ok & (ok.cumsum(0) <= budget))  # the root aside

    def ranked(self, root: int, depth: int, budget: int) -> DraftTree:
        """Best first instead of a template: the `budget` nodes of highest path log-probability (the
        sum of the recycled log-probs from the root) within `depth` levels. A level keeps the
        `budget` best children of the level above (a gather, an add, a top-k), which holds every
        node of the global best `budget`, as a child's path log-prob is at most its parent's
        (EAGLE-2's rerank, Li et al. 2024, §4.2); the global best are one stable sort over the levels
        (ancestors before descendants on ties), on the device, and the tree is read once."""
        if self.rows is None or budget <= 0 or depth <= 0:
            return _leaf(root, Reason.NO_SUCCESSORS if self.rows is None else Reason.BUDGET)
        tokens = torch.tensor([root], device=self.rows.device)
        score = torch.zeros(1, device=self.rows.device)
        found, scores = [], []
        for _ in range(depth):
            rows = self.rows[tokens]  # (slots, k, 2)
            child = (score[:, None] + rows[..., 1]).masked_fill(~self.seen[tokens][:, None], -math.inf)
            above, (best, at) = score, child.flatten().topk(min(budget, child.numel()))
            parents, tokens, score = at // rows.shape[1], rows.flatten(0, 1)[at, 0].long(), best
            # a node's own log-prob: its path's less its parent's, in float64 (exact for float32 sums)
            found.append((tokens, best.double() - above.double()[parents], parents))
            scores.append(best)
        scores = torch.cat(scores)
        rank = torch.empty_like(scores, dtype=torch.long)
        rank[torch.sort(scores, descending=True, stable=True).indices] = torch.arange(
            scores.shape[0], device=rank.device
        )
        return self._viewed(root, found, (rank < budget) & (scores > -math.inf))

    def _viewed(self, root: int, found: list[tuple], kept: torch.Tensor) -> DraftTree:
        """The tree the levels (`found`: each level's tokens, log-probs and parent rows) and their
        `kept` candidates (over every level in order) make, decided over every level at once and
        read in one copy: a kept candidate is a node; one with kept children is expanded; the last
        level's stop at the depth; the others for the budget, or because no forward has read their
        token yet. Not kept: padding (never shown). The records are a tensor tree's (drafting/
        tensor_tree.py: every candidate a row of the next level), viewed as every tree is."""
        sizes = [f[0].shape[0] for f in found]
        tokens, logp, parents = (torch.cat(field) for field in zip(*found, strict=True))
        starts = [0, *itertools.accumulate(sizes)]  # where each level's candidates start
        # each candidate's parent row counted over every level (the next level names its candidates by row)
        below = [f[2] + start for f, start in zip(found[1:], starts, strict=False)]
        below = torch.cat(below) if below else tokens[:0]
        children = torch.zeros_like(tokens).scatter_add(0, below, kept[sizes[0] :].long())
        leaf = torch.where(children > 0, EXPANDED, torch.where(self.seen[tokens], OVER_BUDGET, NO_SUCCESSORS))
        leaf[starts[-2] :] = AT_DEPTH
        fate = torch.where(kept, ADMITTED, PADDING)
        values = torch.stack([tokens.double(), logp.double(), parents.double(), fate.double(), leaf.double()])
        tok, lp, up, fates, leaves = values.tolist()  # one read
        records = []
        for a, b in itertools.pairwise(starts):
            ints = [[int(v) for v in field[a:b]] for field in (tok, up, fates, leaves)]
            records.append((ints[0], lp[a:b], ints[1], ints[2], ints[3], list(range(b - a))))
        tree = DraftTree.with_root(root)
        TensorTree(root).view(tree, (records, []), None, source=Source.RECYCLED)
        if len(tree) == 1:  # no kept child: the root's token has no successors yet (the budget is >= 1)
            tree.mark_leaf(0, Reason.NO_SUCCESSORS)
        return tree


def _leaf(root: int, reason: Reason) -> DraftTree:
    tree = DraftTree.with_root(root)
    tree.mark_leaf(0, reason)
    return tree


class SuffixAutomaton:
    """The suffix automaton of a growing token sequence. State 0 is the empty string; every state
    keeps its longest string's length, its suffix link, its transitions and `first`, the end
    position of its strings' first occurrence (they all end together: one endpos class)."""

    def __init__(self):
        self.text: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.first = [-1]
        self.last = 0

    def _state(self, length: int, link: int, first: int, moves: dict[int, int]) -> int:
        self.next.append(moves)
        self.link.append(link)
        self.length.append(length)
        self.first.append(first)
        return len(self.length) - 1

    def extend(self, token: int) -> None:
        """Append one token (the standard online construction: amortised O(1))."""
        self.text.append(token)
        cur = self._state(self.length[self.last] + 1, 0, len(self.text) - 1, {})
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:  # split q: the clone holds its strings of length <= length[p] + 1
                clone = self._state(self.length[p] + 1, self.link[q], self.first[q], dict(self.next[q]))
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def follow(self, tokens: list[int]) -> None:
        """Extend with the tokens of `tokens` past the text already read (a context only grows
        within a run; a context that is not a continuation starts the automaton again)."""
        if tokens[: len(self.text)] != self.text:
            self.__init__()
        for token in tokens[len(self.text) :]:
            self.extend(token)

    def match(self) -> tuple[int, int]:
        """(length, state) of the longest suffix of the text that also occurred earlier: the last
        state's suffix link (its endpos holds the text's end and at least one earlier end), or
        (0, 0) when no token of the suffix occurred before."""
        state = self.link[self.last] if self.last else 0
        return (self.length[state], state) if state > 0 else (0, 0)

    def walk(self, root: int, state: int, depth: int, branches: int, budget: int) -> DraftTree:
        """The continuations of `state`'s occurrences as a tree under `root`: a node's children are
        the distinct tokens that followed its string, the first occurrence's first (the chain
        SAM-Decoding proposes), at most `branches`, to `depth` levels and `budget` nodes. A child's
        log-probability is its share of its parent's `branches` choices (no counts are kept)."""

        def children(at: int) -> list[tuple[int, float, int]]:
            moves = sorted(self.next[at].items(), key=lambda move: self.first[move[1]])[:branches]
            return [(token, -math.log(len(moves)), to) for token, to in moves]

        return retrieved_tree(root, state, children, depth, budget, Reason.CONTEXT_END)  # the text ends there


def retrieved_tree(root: int, start, children, depth: int, budget: int, end: Reason) -> DraftTree:
    """A retrieved tree grown breadth first from the search state `start` of `root`:
    `children(state)` lists a node's (token, log-prob, state), best first; nodes are taken in
    breadth-first order up to the budget (what the automaton and the corpus share; `listed_tree`
    makes the tree, a node with no children a leaf for `end`)."""
    levels, states, room = [], [start], budget
    for _ in range(depth):
        found = [children(at) for at in states]
        if levels:  # whether each node of the level above has continuations
            levels[-1] = [(*node[:3], bool(f)) for node, f in zip(levels[-1], found, strict=True)]
        kept = [(row, token, logp, to) for row, f in enumerate(found) for token, logp, to in f][: max(room, 0)]
        if not kept:
            if not levels and found[0]:  # the root's continuations, all past the budget
                return _leaf(root, Reason.BUDGET)
            break
        room -= len(kept)
        levels.append([(row, token, logp, False) for row, token, logp, _ in kept])
        states = [to for *_, to in kept]
    return listed_tree(root, levels, depth, end, Source.RETRIEVED)


def listed_tree(root: int, levels: list[list[tuple]], depth: int, end: Reason, source: Source) -> DraftTree:
    """The tree a host structure lists level by level (the suffix automaton's, the corpus's, prompt
    lookup's trie): each level's nodes as (the row of its parent in the level above, 0 under the
    root; token; log-prob; whether it has continuations). They are written as a tensor tree's level
    records (drafting/tensor_tree.py, the form `TensorTree.read` returns: every node admitted, each
    a row of the next level) and viewed as every tree is: a node the next level names is expanded;
    else it stops at `depth`, for the budget where it has continuations left out, or at `end`.
    The root with no level below it is a leaf for `end`."""
    records, end = [], LEAF_REASONS.index(end)
    for d, nodes in enumerate(levels, start=1):
        below = {node[0] for node in levels[d]} if d < len(levels) else set()
        parents, tokens, logp, more = (list(field) for field in zip(*nodes, strict=True))
        leaf = [EXPANDED if i in below else AT_DEPTH if d >= depth else OVER_BUDGET if m else end
                for i, m in enumerate(more)]  # fmt: skip
        records.append((tokens, logp, parents, [ADMITTED] * len(nodes), leaf, list(range(len(nodes)))))
    if not records:
        return _leaf(root, LEAF_REASONS[end])
    tree = DraftTree.with_root(root)
    TensorTree(root).view(tree, (records, []), None, source=source)
    return tree


def graft(tree: DraftTree, other: DraftTree, room: int) -> int:
    """Put `other`'s verified nodes into `tree` (same root token), parents first: a node whose
    parent's place in `tree` already has a verified child with its token merges into it; else it
    is added with its source, its reason and its log-probability, while `room` lasts. Returns the
    nodes added. An added node is a leaf until one of its children is added too."""
    if len(other) < 2 or room <= 0:
        return 0
    kids = tree.child_map()
    place, added = {0: 0}, 0
    for node in other.order("bfs")[1:]:
        parent = place.get(other.parents[node])
        if parent is None:
            continue  # its parent found no room
        same = next((c for c in kids.get(parent, []) if tree.tokens[c] == other.tokens[node]), None)
        if same is None:
            if added >= room:
                continue
            if tree.status[parent] != Status.KEPT:
                tree.mark_expanded(parent)  # a leaf of `tree` that `other` goes on from
            leaf = other.status[node] == Status.NOT_EXPANDED  # else: its children may find no room
            why = other.reason[node] if leaf else Reason.BUDGET
            same = tree.add(parent, other.tokens[node], other.logp[node], reason=why, source=Source(other.source(node)))
            kids.setdefault(parent, []).append(same)
            added += 1
        place[node] = same
    return added
