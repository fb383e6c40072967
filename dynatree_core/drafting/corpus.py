"""A static corpus for retrieval: SAM-Decoding's static automaton (Hu et al., ACL 2025, §3.1) as a
suffix array, which holds millions of tokens in two int32 arrays where a Python automaton would
not fit.

The corpus the `suffix` policy reads (`corpus` on) is the embedded target's own answers that the
project commits for draft training (assets/draft-data/answers, sources disjoint from the OOD
prompts; SmolLM2's tokenizer: for a target with another vocabulary its ids are other tokens, so
leave it off there). Answers are joined with a separator no match crosses. The index is built once
(numpy prefix doubling: about 10 s for the 4.4M answer tokens on 2 cores) and cached under
$DYNATREE_CACHE/corpus/.

`longest(context)`: the longest suffix of the context (at most MAX_MATCH tokens) that occurs in the
corpus, by binary search over the match length (a suffix that occurs has every shorter suffix
occurring too) and over the suffix array; `walk`: its continuations as a tree, each node's
children the tokens that followed its occurrences, the most frequent first, p their share.
"""

from __future__ import annotations

import functools
import hashlib
import math

import numpy as np

from dynatree_core.core.cache_dir import cache_dir
from dynatree_core.core.log import logger
from dynatree_core.core.presets import REPO_ROOT
from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.drafting.sources import retrieved_tree

ANSWERS = REPO_ROOT / "assets" / "draft-data" / "answers"
MAX_MATCH = 32
SEPARATOR = -1  # between two answers: no match or continuation crosses it


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The suffix array of `tokens` (int32), by prefix doubling: rank the suffixes by their first
    2^k tokens until every rank is distinct; O(n log^2 n) in numpy."""
    n = len(tokens)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64)
    span = 1
    while True:
        second = np.full(n, -1, np.int64)
        second[: n - span] = rank[span:]
        order = np.lexsort((second, rank))
        key = rank[order] * (n + 1) + second[order] + 1
        rank = np.empty(n, np.int64)
        rank[order] = np.concatenate(([0], np.cumsum(key[1:] != key[:-1])))
        if rank[order[-1]] == n - 1 or span >= n:
            return order.astype(np.int32)
        span *= 2


class CorpusIndex:
    """A token corpus and its suffix array."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray | None = None):
        self.tokens = np.asarray(tokens, dtype=np.int32)
        self.sa = suffix_array(self.tokens) if sa is None else sa

    def _bound(self, pattern: list[int], lo: int, hi: int, above: bool) -> int:
        """The first suffix in sa[lo:hi] whose first len(pattern) tokens are >= pattern (> with
        `above`), as Python compares lists."""
        m = len(pattern)
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(self.sa[mid])
            head = self.tokens[start : start + m].tolist()
            if head < pattern or (above and head == pattern):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def occurrences(self, pattern: list[int], lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """The range of the suffix array whose suffixes start with `pattern` (within [lo, hi))."""
        hi = len(self.sa) if hi is None else hi
        first = self._bound(pattern, lo, hi, False)
        return first, self._bound(pattern, first, hi, True)

    def longest(self, context: list[int]) -> tuple[int, int, int]:
        """(length, lo, hi): the longest suffix of `context` (<= MAX_MATCH tokens) in the corpus and
        the range of its occurrences; length 0 when not even its last token occurs."""
        best, found = 0, (0, len(self.sa))
        short, long = 1, min(MAX_MATCH, len(context))
        while short <= long:
            length = (short + long) // 2
            lo, hi = self.occurrences(context[-length:])
            if hi > lo:
                best, found, short = length, (lo, hi), length + 1
            else:
                long = length - 1
        return best, *found

    def followers(self, lo: int, hi: int, length: int, branches: int, vocab: int = 0) -> list[tuple[int, float]]:
        """The tokens that follow the occurrences sa[lo:hi] of a `length`-token pattern, the most
        frequent first (at most `branches`; below `vocab` when given), with their share of the
        occurrences."""
        after = self.sa[lo:hi].astype(np.int64) + length
        after = self.tokens[after[after < len(self.tokens)]]
        after = after[(after != SEPARATOR) & ((after < vocab) if vocab else True)]
        if not len(after):
            return []
        tokens, counts = np.unique(after, return_counts=True)
        top = np.argsort(-counts, kind="stable")[:branches]
        return [(int(tokens[i]), float(counts[i]) / (hi - lo)) for i in top]

    def walk(self, root: int, context: list[int], match: tuple[int, int, int], depth: int, branches: int,
             budget: int, vocab: int = 0) -> DraftTree:  # fmt: skip
        """The continuations of the match as a tree under `root`, to `depth` levels and `budget`
        nodes, every token below `vocab` (when given: a corpus of another tokenizer's ids)."""
        length, lo, hi = match

        def children(at: tuple[list[int], int, int]) -> list[tuple[int, float, tuple[list[int], int, int]]]:
            pattern, a, b = at
            nexts = self.followers(a, b, len(pattern), branches, vocab)
            return [(t, math.log(share), ([*pattern, t], *self.occurrences([*pattern, t], a, b))) for t, share in nexts]

        start = (context[len(context) - length :], lo, hi)
        return retrieved_tree(root, start, children, depth, budget, Reason.CORPUS_END)


def answers_corpus() -> np.ndarray:
    """The committed answers (their assistant turns), joined by SEPARATOR."""
    parts = []
    for shard in sorted(ANSWERS.glob("*_*.npz")):
        with np.load(shard) as data:
            ids, offsets, prompts = data["ids"], data["offsets"], data["prompt_lens"]
        for start, end, prompt in zip(offsets[:-1], offsets[1:], prompts, strict=True):
            parts += [ids[start + prompt : end].astype(np.int32), np.array([SEPARATOR], np.int32)]
    return np.concatenate(parts) if parts else np.array([SEPARATOR], np.int32)


@functools.cache
def answers_index() -> CorpusIndex:
    """The answers' index, built once and cached on disk by the corpus's digest."""
    tokens = answers_corpus()
    digest = hashlib.sha256(tokens.tobytes()).hexdigest()[:16]
    path = cache_dir() / "corpus" / f"answers-{digest}.npy"
    if path.exists():
        sa = np.load(path)
        if len(sa) == len(tokens):
            return CorpusIndex(tokens, sa)
    logger().info("building the answers corpus index (%d tokens; once: about 10 s on 2 cores)", len(tokens))
    index = CorpusIndex(tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, index.sa)
    return index
