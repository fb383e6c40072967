"""Candidates that cost no draft forward (drafting/sources.py, suffix.py, joined.py): the suffix
automaton against a brute-force search, the graft of one tree into another, joined trees under
their budget with each node's source, and the source in exports and run files. Greedy exactness of
every new policy and joined form is test_engine's (every architecture, every draft), the law under
sampling test_sampling's."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from conftest import hf_greedy, noisy_copy, tiny_model

from dynatree_core.core.tree import DraftTree, Reason, Source, Status
from dynatree_core.decoding.engine import DecodeConfig, decode
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting import DraftRequest, make_policy
from dynatree_core.drafting import suffix as suffix_module
from dynatree_core.drafting.corpus import SEPARATOR, CorpusIndex, answers_corpus
from dynatree_core.drafting.sources import SuffixAutomaton, graft, retrieved_tree
from dynatree_core.runs.validate import _check_tree


def _longest_earlier_suffix(text: list[int]) -> int:
    """The longest suffix of `text` that also ends at an earlier position (brute force)."""
    n = len(text)
    for length in range(n - 1, 0, -1):
        suffix = text[n - length :]
        if any(text[end - length + 1 : end + 1] == suffix for end in range(length - 1, n - 1)):
            return length
    return 0


def _followers(text: list[int], pattern: list[int]) -> set[int]:
    """The tokens that follow occurrences of `pattern` in `text` (brute force)."""
    m = len(pattern)
    return {text[i + m] for i in range(len(text) - m) if text[i : i + m] == pattern}


@pytest.mark.parametrize("alphabet", [2, 3, 8])
def test_the_automatons_match_and_continuations_equal_a_brute_force_search(alphabet):
    """After every token: the match length is the longest earlier suffix, and the walk's children
    are exactly the tokens that followed that suffix, the first occurrence's first."""
    rng = random.Random(alphabet)  # derandomized: the same texts on every machine
    for _ in range(20):
        sam, text = SuffixAutomaton(), []
        for _ in range(60):
            text.append(rng.randrange(alphabet))
            sam.extend(text[-1])
            length, state = sam.match()
            assert length == _longest_earlier_suffix(text), text
            if length == 0:
                continue
            suffix = text[len(text) - length :]
            tree = sam.walk(text[-1], state, 1, alphabet, 99)
            children = [tree.tokens[n] for n in range(1, len(tree))]
            assert set(children) == _followers(text, suffix)
            first = next(i for i in range(len(text)) if text[i : i + length] == suffix)
            assert children[0] == text[first + length], "the first occurrence's continuation first"
            assert all(tree.source(n) == Source.RETRIEVED for n in range(1, len(tree)))


def test_follow_extends_a_growing_context_and_restarts_on_another():
    sam = SuffixAutomaton()
    sam.follow([1, 2, 3, 1, 2])
    assert sam.match()[0] == 2
    sam.follow([1, 2, 3, 1, 2, 3])
    assert sam.match()[0] == 3 and sam.text == [1, 2, 3, 1, 2, 3]
    sam.follow([9, 9])
    assert sam.text == [9, 9] and sam.match()[0] == 1


def test_the_suffix_policy_continues_the_first_match_as_a_chain_or_a_tree():
    context = [4, 5, 6, 7, 8, 4, 5, 6, 9, 4, 5, 6]

    def draft(**params) -> DraftTree:
        request = DraftRequest(root_token=6, max_depth=8, drafter=None, context=context)
        return make_policy("suffix", params).draft(request)

    chain = draft(depth=3)
    assert [chain.tokens[n] for n in range(1, len(chain))] == [7, 8, 4], "what followed 4 5 6 the first time"
    assert chain.notes["match"] == [3.0]
    tree = draft(depth=1, branches=3)
    assert [tree.tokens[n] for n in range(1, len(tree))] == [7, 9]
    short = draft(min_match=4)
    assert len(short) == 1 and short.reason[0] == "no_match"


def _grown_node_by_node(root, start, children, depth: int, budget: int, end: Reason) -> DraftTree:
    """A retrieved tree built node by node on the host, breadth first (the reference for
    sources.retrieved_tree, which writes level records and views them)."""
    tree = DraftTree.with_root(root)
    frontier, drafted = [(0, start)], 0
    for _ in range(depth):
        grown = []
        for node, at in frontier:
            kids = children(at)
            if not kids:
                tree.mark_leaf(node, end)
            elif drafted >= budget:
                tree.mark_leaf(node, Reason.BUDGET)
            else:
                tree.mark_expanded(node)
                for token, logp, to in kids[: budget - drafted]:
                    grown.append((tree.add(node, token, logp, source=Source.RETRIEVED), to))
                    drafted += 1
        frontier = grown
    return tree


def _fields(tree: DraftTree) -> tuple:
    sources = [tree.source(n) for n in range(len(tree))]
    return tree.tokens, tree.parents, tree.depths, tree.logp, tree.status, tree.reason, sources


@pytest.mark.parametrize("seed", range(4))
def test_a_retrieved_tree_equals_the_node_by_node_walk(seed):
    """retrieved_tree (level records viewed as every tree is: sources.listed_tree) makes the tree the
    node-by-node breadth-first walk makes, node for node: tokens, parents, log-probs, statuses,
    reasons (an end, the budget, the depth) and sources, over random continuation tries."""
    rng = random.Random(seed)  # derandomized: the same tries on every machine
    for _ in range(200):
        fan, vocab, salt = rng.randrange(0, 4), rng.randrange(2, 9), rng.random()

        def children(path: tuple, fan=fan, vocab=vocab, salt=salt) -> list:
            r = random.Random(hash((salt, path)))
            tokens = r.sample(range(vocab), min(vocab, r.randrange(0, fan + 1)))
            return [(t, -r.random(), (*path, t)) for t in tokens]

        depth, budget = rng.randrange(1, 7), rng.randrange(0, 14)
        end = rng.choice([Reason.CONTEXT_END, Reason.CORPUS_END])
        want = _grown_node_by_node(5, (), children, depth, budget, end)
        got = retrieved_tree(5, (), children, depth, budget, end)
        assert _fields(got) == _fields(want), (depth, budget)


def _tree(root: int, paths: list[list[int]], source: Source = Source.MODEL) -> DraftTree:
    tree = DraftTree.with_root(root)
    for path in paths:
        node = 0
        for token in path:
            kids = [c for c in range(len(tree)) if tree.parents[c] == node and tree.tokens[c] == token]
            if kids:
                node = kids[0]
            else:
                tree.mark_expanded(node)
                node = tree.add(node, token, -0.5, source=source)
    return tree


def test_graft_merges_equal_paths_and_adds_the_rest_while_room_lasts():
    model = _tree(1, [[2, 3], [4]])
    retrieved = _tree(1, [[2, 3, 5, 6], [7]], Source.RETRIEVED)
    added = graft(model, retrieved, 2)
    assert added == 2
    paths = {tuple(model.tokens[n] for n in model.path(n)[1:]): model.source(n) for n in range(1, len(model))}
    assert paths == {(2,): "model", (2, 3): "model", (4,): "model", (2, 3, 5): "retrieved", (7,): "retrieved"}
    five = next(n for n in range(len(model)) if model.tokens[n] == 5)
    three = model.parents[five]
    assert model.status[three] == Status.KEPT, "a model leaf the graft goes on from is expanded"
    assert model.status[five] == Status.NOT_EXPANDED and model.reason[five] == Reason.BUDGET.value
    assert graft(model, retrieved, 0) == 0


def test_a_joined_tree_stays_under_its_budget_and_marks_every_source():
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.01)
    prompt = [3, 8, 13, 21, 3, 8, 13, 21, 3, 8]
    params = {"budget": 10, "retrieved": 4, "recycled": 4, "tau": 0.0}
    policy = make_method("joined_fixed_tree", params)
    records = list(decode(target, prompt, policy, draft=draft, config=DecodeConfig(max_new_tokens=30)))
    assert [t for r in records for t in r.committed] == hf_greedy(target, prompt, 30)
    sources = {r.tree.source(n) for r in records for n in range(1, len(r.tree))}
    assert {"model", "retrieved", "recycled"} <= sources
    for r in records:
        assert sum(r.tree.is_verified(n) for n in range(1, len(r.tree))) <= params["budget"]
        for n in r.tree.sources:  # a grafted node is expanded exactly when a child of it was grafted too
            verified_kids = [c for c in range(len(r.tree)) if r.tree.parents[c] == n and r.tree.is_verified(c)]
            assert (r.tree.status[n] == Status.KEPT) == bool(verified_kids)
    assert policy.config["budget"] == params["budget"], "the model's share of the budget is restored"


def test_sources_travel_with_the_tree_and_a_bad_one_is_refused():
    tree = _tree(1, [[2, 3]])
    tree.add(0, 9, -1.0, source=Source.RECYCLED)
    data = tree.to_dict()
    assert data["sources"] == {"3": "recycled"}
    back = DraftTree.from_dict(data)
    assert back.source(3) == "recycled" and back.source(1) == "model"
    _check_tree(data, 100)
    with pytest.raises(ValueError, match="sources"):
        _check_tree({**data, "sources": {"3": "guessed"}}, 100)
    with pytest.raises(ValueError, match="sources"):
        _check_tree({**data, "sources": {"0": "recycled"}}, 100)
    with pytest.raises(ValueError):
        DraftTree.from_dict({**data, "sources": {"7": "recycled"}})


def _brute_sa(tokens: list[int]) -> list[int]:
    return sorted(range(len(tokens)), key=lambda i: tokens[i:])


@pytest.mark.parametrize("alphabet", [2, 5, 50])
def test_the_corpus_suffix_array_and_its_searches_equal_brute_force(alphabet):
    rng = random.Random(alphabet)  # derandomized
    for _ in range(10):
        tokens = [rng.randrange(alphabet) if rng.random() > 0.05 else SEPARATOR for _ in range(rng.randrange(1, 300))]
        index = CorpusIndex(np.array(tokens))
        assert index.sa.tolist() == _brute_sa(tokens)
        context = [rng.randrange(alphabet) for _ in range(12)]
        length, lo, hi = index.longest(context)
        found = {n for n in range(1, 13) for i in range(len(tokens)) if tokens[i : i + n] == context[-n:]}
        want = max(found, default=0)
        assert length == want
        if length:
            starts = sorted(int(i) for i in index.sa[lo:hi])
            assert starts == [i for i in range(len(tokens)) if tokens[i : i + length] == context[-length:]]
            follow = [
                tokens[i + length] for i in starts if i + length < len(tokens) and tokens[i + length] != SEPARATOR
            ]
            got = index.followers(lo, hi, length, 99)
            assert {t: round(s * (hi - lo)) for t, s in got} == {t: follow.count(t) for t in set(follow)}
            counts = [s for _, s in got]
            assert counts == sorted(counts, reverse=True), "the most frequent first"
            assert all(t < 3 for t, _ in index.followers(lo, hi, length, 99, vocab=3))


def test_the_suffix_policy_takes_the_corpus_match_when_it_is_longer(monkeypatch):
    corpus = CorpusIndex(np.array([7, 1, 2, 3, 4, 5, SEPARATOR, 1, 2, 3, 4, 6, SEPARATOR, 1, 2, 3, 4, 5, 99]))
    monkeypatch.setattr(suffix_module, "answers_index", lambda: corpus)
    request = DraftRequest(root_token=4, max_depth=8, drafter=None, context=[9, 1, 2, 3, 4], vocab=50)
    tree = make_policy("suffix", {"corpus": True, "depth": 2, "branches": 2}).draft(request)
    paths = {tuple(tree.tokens[n] for n in tree.path(n)[1:]) for n in range(1, len(tree))}
    assert paths == {(5,), (6,)}, "5 followed twice, 6 once; 99 is past the vocabulary, SEPARATOR ends an answer"
    assert tree.logp[1] == pytest.approx(np.log(2 / 3)) and tree.notes == {"match": [4.0], "corpus": [1.0]}
    off = make_policy("suffix", {"depth": 2}).draft(request)
    assert len(off) == 1 and off.reason[0] == "no_match", "the context alone has no earlier match"
    context = [1, 2, 3, 4, 8, 1, 2, 3, 4]  # the context's own match (4 tokens) ties the corpus's: the context wins
    tie = make_policy("suffix", {"corpus": True, "depth": 1}).draft(dataclasses.replace(request, context=context))
    assert [tie.tokens[n] for n in range(1, len(tie))] == [8] and tie.notes["corpus"] == [0.0]


def test_a_run_with_the_corpus_on_stays_exact(monkeypatch):
    rng = random.Random(3)
    corpus = CorpusIndex(np.array([rng.randrange(200) for _ in range(5000)]))  # ids past the tiny vocabulary too
    monkeypatch.setattr(suffix_module, "answers_index", lambda: corpus)
    target, prompt = tiny_model("llama"), [5, 7, 9, 11, 5, 7]
    records = list(
        decode(
            target,
            prompt,
            make_method("suffix", {"corpus": True, "min_match": 1}),
            config=DecodeConfig(max_new_tokens=30),
        )
    )
    assert [t for r in records for t in r.committed] == hf_greedy(target, prompt, 30)
    assert any(r.tree.notes.get("corpus") == [1.0] and len(r.tree) > 1 for r in records), "the corpus proposed"


def test_the_committed_answers_make_the_corpus():
    tokens = answers_corpus()
    assert len(tokens) > 1_000_000 and int(tokens.max()) < 49152
    assert (tokens == SEPARATOR).sum() > 1000, "one separator after every answer"
