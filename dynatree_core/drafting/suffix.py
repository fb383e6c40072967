"""Suffix-automaton retrieval (Hu et al., "SAM-Decoding: Speculative Decoding via Suffix
Automaton", ACL 2025): a draft that costs no draft forward.

A suffix automaton over the run's context (the prompt and every token committed since) is
extended with each committed token in amortised O(1) (§3.1). Its last state's suffix link is the
longest suffix of the context that occurred before (§3.2: the match, in O(1)); when that match
is at least `min_match` tokens, the tokens that followed its first occurrence are the draft
(SAM-Decoding's chain). With `branches` > 1 the draft is a small tree: every distinct token that
followed the match's occurrences (the state's transitions), and below each what followed it.
With `corpus` on, a static corpus (drafting/corpus.py: the embedded target's committed answers)
is searched too, and the longer of the two matches proposes (§3.2: the static and the dynamic
automaton, the longer match first; a tie goes to the context). The tree is verified like any
other, so greedy output is the target's, token for token; its tokens are deterministic, so the
sampling verifiers keep the output distribution the target's.
"""

from __future__ import annotations

from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.drafting.common import leaf_reason
from dynatree_core.drafting.corpus import answers_index
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest
from dynatree_core.drafting.sources import SuffixAutomaton


@register_policy
class SuffixLookup(Policy):
    """SAM-Decoding's retrieval: the continuation of the context's longest earlier suffix match."""

    name = "suffix"
    family = "retrieved"
    summary = "Suffix automaton over prompt + output: continues the longest earlier match (no draft)"
    needs_draft_model = False
    params = (
        Param("min_match", int, 2, 1, 16, "Shortest suffix match (tokens) that proposes a draft"),
        Param("depth", int, 8, 1, 32, "Tokens drafted below the root (the continuation's length)"),
        Param("branches", int, 1, 1, 8, "Distinct continuations per node (1: SAM-Decoding's chain)"),
        Param("budget", int, 16, 1, 256, "Node budget"),
        Param("corpus", bool, False, help="Also search the embedded target's committed answers (SmolLM2's tokenizer)"),
    )

    def __init__(self, **values):
        super().__init__(**values)
        self.automaton = SuffixAutomaton()

    def reset(self) -> None:
        self.automaton = SuffixAutomaton()

    def draft(self, request: DraftRequest) -> DraftTree:
        c = self.config
        depth = min(c["depth"], request.max_depth)
        self.automaton.follow(request.context)
        length, state = self.automaton.match()
        static = answers_index().longest(request.context) if c["corpus"] else (0, 0, 0)
        if depth <= 0 or max(length, static[0]) < c["min_match"]:
            tree = DraftTree.with_root(request.root_token)
            tree.mark_leaf(0, Reason.LENGTH_LIMIT if depth <= 0 else Reason.NO_MATCH)
            return tree
        if static[0] > length:
            shape = (depth, c["branches"], c["budget"], request.vocab)
            tree = answers_index().walk(request.root_token, request.context, static, *shape)
        else:
            tree = self.automaton.walk(request.root_token, state, depth, c["branches"], c["budget"])
        tree.notes = {"match": [float(max(length, static[0]))], "corpus": [float(static[0] > length)]}
        for node in range(1, len(tree)):
            if tree.depths[node] == depth:
                tree.mark_leaf(node, leaf_reason(depth, c["depth"]))
        return tree
