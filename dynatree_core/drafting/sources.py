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

Each source builds a `DraftTree` whose nodes carry their `Source`; no model is called here.
"""

from __future__ import annotations

import math

import torch

from dynatree_core.core.transfer import to_list
from dynatree_core.core.tree import DraftTree, Reason, Source, Status


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
        order; a token with no successors yet is a leaf. The template's slots are tensors: a level
        is a gather of its parents' rows; the budget is one count over every level at the end (a
        slot past it has every slot below it past it too), and the tree is read once."""
        tree = DraftTree.with_root(root)
        if self.rows is None:
            tree.mark_leaf(0, "no_successors")
            return tree
        dev, fans = self.rows.device, [min(w, self.rows.shape[1]) for w in widths]
        tokens = torch.tensor([root], device=dev)
        ok = torch.ones(1, dtype=torch.bool, device=dev)  # a slot holding a node, the budget aside
        ids, lps, oks, grows = [tokens.float()], [torch.zeros(1, device=dev)], [ok], []
        for fan in fans:
            grows.append(ok & self.seen[tokens])  # a node whose token has successors
            level = self.rows[tokens, :fan].flatten(0, 1)  # (slots * fan, 2)
            ok = grows[-1].repeat_interleave(fan)
            tokens = level[:, 0].long()
            ids.append(level[:, 0]), lps.append(level[:, 1]), oks.append(ok)
        grows.append(ok & self.seen[tokens])
        ok = torch.cat(oks)
        kept = ok & (ok.cumsum(0) <= budget + 1)  # the root is slot 0
        slots = to_list(torch.cat([torch.cat(ids), kept.float(), torch.cat(lps), torch.cat(grows).float()]))
        n = len(ok)
        token, kept, lp, seen = slots[:n], slots[n : 2 * n], slots[2 * n : 3 * n], slots[3 * n :]
        node_of, start, size = {0: 0}, 0, 1  # template slot -> tree node
        for fan in fans:
            above, start, size = start, start + size, size * fan
            for j in range(size):
                parent = node_of.get(above + j // fan)
                if kept[start + j] and parent is not None:
                    tree.mark_expanded(parent)
                    node_of[start + j] = tree.add(parent, int(token[start + j]), lp[start + j], source=Source.RECYCLED)
        inner = {tree.parents[n] for n in range(1, len(tree))}
        for slot, node in node_of.items():
            if node not in inner and tree.depths[node] < len(widths):
                tree.mark_leaf(node, Reason.BUDGET if seen[slot] else "no_successors")
        return tree

    def ranked(self, root: int, depth: int, budget: int) -> DraftTree:
        """Best first instead of a template: the `budget` nodes of highest path log-probability (the
        sum of the recycled log-probs from the root) within `depth` levels. A level keeps the
        `budget` best children of the level above (a gather, an add, a top-k), which holds every
        node of the global best `budget`, as a child's path log-prob is at most its parent's
        (EAGLE-2's rerank, Li et al. 2024, §4.2). The levels are read once; the final choice
        (ancestors before descendants on ties) is made on the host over depth x budget slots."""
        tree = DraftTree.with_root(root)
        if self.rows is None or budget <= 0 or depth <= 0:
            tree.mark_leaf(0, "no_successors" if self.rows is None else Reason.BUDGET)
            return tree
        tokens = torch.tensor([root], device=self.rows.device)
        score = torch.zeros(1, device=self.rows.device)
        parts, sizes = [self.seen[tokens].float()], []
        for _ in range(depth):
            rows = self.rows[tokens]  # (slots, k, 2)
            child = (score[:, None] + rows[..., 1]).masked_fill(~self.seen[tokens][:, None], -math.inf)
            score, at = child.flatten().topk(min(budget, child.numel()))
            tokens = rows.flatten(0, 1)[at, 0].long()
            parts += [tokens.float(), (at // rows.shape[1]).float(), score, self.seen[tokens].float()]
            sizes.append(len(at))
        flat, start = to_list(torch.cat(parts)), 1
        levels = [([root], [0], [0.0], flat[:1])]  # per level: token, parent slot, path log-prob, seen
        for size in sizes:
            levels.append(tuple(flat[start + i * size : start + (i + 1) * size] for i in range(4)))
            start += 4 * size
        best = sorted((-s, d, j) for d in range(1, len(levels)) for j, s in enumerate(levels[d][2]) if s > -math.inf)
        node_of = {(0, 0): 0}  # (level, slot) -> tree node
        for d, j in sorted((d, j) for _, d, j in best[:budget]):
            token, parent, score, _ = levels[d]
            above = int(parent[j])
            tree.mark_expanded(node_of[d - 1, above])
            logp = score[j] - levels[d - 1][2][above]
            node_of[d, j] = tree.add(node_of[d - 1, above], int(token[j]), logp, source=Source.RECYCLED)
        inner = {tree.parents[n] for n in range(1, len(tree))}
        for (d, j), node in node_of.items():
            if node not in inner and d < depth:
                tree.mark_leaf(node, Reason.BUDGET if levels[d][3][j] else "no_successors")
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

        return retrieved_tree(root, state, children, depth, budget, "context_end")  # the text ends there


def retrieved_tree(root: int, start, children, depth: int, budget: int, end: str) -> DraftTree:
    """A retrieved tree grown breadth first from the search state `start` of `root`:
    `children(state)` lists a node's (token, log-prob, state), best first; a node with none is a
    leaf for `end`, one past the budget for the budget (what the automaton and the corpus share)."""
    tree = DraftTree.with_root(root)
    frontier, drafted = [(0, start)], 0
    for _ in range(depth):
        grown = []
        for node, at in frontier:
            kids = children(at)
            if not kids:
                tree.mark_leaf(node, end)
                continue
            if drafted >= budget:
                tree.mark_leaf(node, Reason.BUDGET)
                continue
            tree.mark_expanded(node)
            for token, logp, to in kids[: budget - drafted]:
                grown.append((tree.add(node, token, logp, source=Source.RETRIEVED), to))
                drafted += 1
        frontier = grown
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
