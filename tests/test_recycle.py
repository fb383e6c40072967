"""Token Recycling (drafting/recycle.py): the matrix is the target's own top-k successors from
each verified row, the tree a breadth-first walk of it over the template, and the output the
target's (test_engine's exactness over every architecture and draft covers the policy too)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy, tiny_model
from reference_drafting import recycled_best, recycled_walk

from dynatree_core.core.tree import Reason
from dynatree_core.decoding.engine import DecodeConfig, decode
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting import DraftRequest, make_policy
from dynatree_core.drafting.sources import Recycler


def _logits(rows: list[list[int]], vocab: int = 20) -> torch.Tensor:
    """Logits whose top tokens are each row's list, most likely first."""
    out = torch.full((len(rows), vocab), -10.0)
    for i, row in enumerate(rows):
        for rank, token in enumerate(row):
            out[i, token] = 5.0 - rank
    return out


def test_the_tree_walks_the_targets_successors_over_the_template():
    policy = make_policy("recycle", {"ranked": False, "k": 3, "depth": 3, "branch": 2, "budget": 32})
    policy.observe_target([7, 1, 2], _logits([[1, 2, 3], [4, 5, 6], [8, 9, 10]]))
    tree = policy.draft(DraftRequest(root_token=7, max_depth=6, drafter=None))
    # depth 1: the root's first 2 successors; depth 2: 1 each; depth 3: tokens never seen
    assert [tree.tokens[n] for n in range(1, len(tree))] == [1, 2, 4, 8]
    assert [tree.parents[n] for n in range(1, len(tree))] == [0, 0, 1, 2]
    assert tree.reason[3] == tree.reason[4] == "no_successors"
    lp = torch.log_softmax(_logits([[1, 2, 3]])[0], -1)
    assert abs(tree.logp[1] - float(lp[1])) < 1e-6, "a node's log-prob is the target's, as recycled"


def test_the_budget_and_the_depth_cap_bound_the_tree_and_name_its_leaves():
    """The latest forward that saw a token wins its row; the budget and the depth cap end the walk."""
    policy = make_policy("recycle", {"ranked": False, "k": 4, "depth": 2, "branch": 4, "budget": 5})
    policy.observe_target([10, 1, 2, 3, 4], _logits([[1, 2, 3, 4]] + [[5, 6, 7, 8]] * 4))
    tree = policy.draft(DraftRequest(root_token=10, max_depth=6, drafter=None))
    assert len(tree) - 1 == 5  # 4 at depth 1, the budget's last at depth 2
    assert all(tree.depths[n] <= 2 for n in range(len(tree)))
    reasons = [tree.reason[n] for n in range(1, len(tree))]
    assert reasons == [None] + [Reason.BUDGET.value] * 3 + [Reason.DEPTH_LIMIT.value]
    room = policy.draft(DraftRequest(root_token=10, max_depth=1, drafter=None))
    assert max(room.depths) == 1 and room.reason[1] == Reason.LENGTH_LIMIT.value


def test_a_run_refreshes_the_matrix_from_its_forwards_and_stays_exact():
    target, prompt = tiny_model("llama"), [1, 5, 7, 9, 11, 5, 7, 9]
    policy = make_method("recycle")
    records = list(decode(target, prompt, policy, config=DecodeConfig(max_new_tokens=40)))
    assert [t for r in records for t in r.committed] == hf_greedy(target, prompt, 40)
    assert len(records[0].tree) == 1 and records[0].tree.reason[0] == "no_successors"
    assert any(len(r.tree) > 1 for r in records[1:]), "later trees come from the matrix"
    assert not any(r.draft_forwards for r in records), "no draft model, no draft forward"
    assert set(prompt) <= policy.matrix.known(), "the prefill's rows seed the matrix"
    policy.reset()
    assert policy.matrix.known() == set()


def test_the_prefill_seeds_the_matrix_with_every_prompt_row():
    """The first tree after the prefill already walks successors the prompt's rows gave: the
    token after the prompt's first 5 is what the target predicted at that row."""
    target, prompt = tiny_model("llama"), [1, 5, 7, 9, 11, 5, 7, 9]
    policy = make_method("recycle")
    records = decode(target, prompt, policy, config=DecodeConfig(max_new_tokens=2))
    next(records)  # the prefill
    with torch.inference_mode():
        logits = target(torch.tensor([prompt])).logits[0].float()
    for i, token in enumerate(prompt[:-1]):
        if token not in prompt[i + 1 :]:  # the latest row that saw a token wins it (the root: its own)
            ids, lp = policy.matrix.successors(token)  # near-ties may swap between two forwards' roundings
            assert torch.allclose(torch.tensor(lp), logits[i].log_softmax(-1).topk(8).values, atol=1e-4)
            assert torch.allclose(torch.tensor(lp), logits[i].log_softmax(-1)[ids], atol=1e-4)


def test_the_tensor_walk_equals_the_papers_walk_node_for_node():
    """The matrix as tensors and the walk as a few ops a level (drafting/sources.Recycler) build the
    tree the paper's node-by-node walk builds over the same successors (tests/reference_drafting.py),
    for random matrices, templates and budgets (derandomized)."""
    rng = random.Random(0)
    for _ in range(60):
        vocab, k = rng.randrange(3, 12), rng.randrange(1, 5)
        matrix = Recycler(k)
        for _ in range(rng.randrange(0, 4)):  # a few forwards, some tokens on two rows
            rows = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
            matrix.observe(rows, torch.randn(len(rows), vocab))
        table = {t: matrix.successors(t) for t in matrix.known()}
        widths = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 5))]
        root, budget = rng.randrange(vocab), rng.randrange(1, 12)
        got, want = matrix.walk(root, widths, budget), recycled_walk(table, root, widths, budget)
        assert (got.tokens, got.parents, got.status, got.reason) == (
            want.tokens,
            want.parents,
            want.status,
            want.reason,
        )
        assert got.logp == pytest.approx(want.logp) and got.sources == want.sources


def path_score(table: dict, root: int):
    """A path's summed recycled log-prob under the matrix's rows (`table`), from `root`."""

    def score(path: tuple[int, ...]) -> float:
        total, at = 0.0, root
        for token in path:
            ids, lps = table[at]
            total, at = total + lps[ids.index(token)], token
        return total

    return score


def test_the_ranked_walk_keeps_the_budget_most_likely_paths():
    """Best first (Recycler.ranked: a top-k a level) keeps exactly the `budget` paths of highest
    summed recycled log-prob among all paths of at most `depth` tokens (exhaustive enumeration in
    tests/reference_drafting.py), for random matrices (derandomized, whatever ran before); the tree
    is ancestor-closed and its leaves say why they stop. Paths that hold the same edges in another
    order tie in exact arithmetic, and summed in another order their floats may not: where the
    enumeration's kept set differs from the walk's, their scores agree."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    for _ in range(60):
        vocab, k = rng.randrange(3, 10), rng.randrange(1, 4)
        matrix = Recycler(k)
        for _ in range(rng.randrange(0, 4)):
            rows = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
            matrix.observe(rows, torch.randn(len(rows), vocab, generator=gen))
        table = {t: matrix.successors(t) for t in matrix.known()}
        root, depth, budget = rng.randrange(vocab), rng.randrange(1, 4), rng.randrange(1, 12)
        tree = matrix.ranked(root, depth, budget)
        paths = {tuple(tree.tokens[m] for m in tree.path(n)[1:]) for n in range(1, len(tree))}
        best = set(recycled_best(table, root, depth, budget))
        assert len(paths) == len(best)
        assert sorted(map(path_score(table, root), paths)) == pytest.approx(sorted(map(path_score(table, root), best)))
        for n in range(len(tree)):
            kids = [c for c in range(1, len(tree)) if tree.parents[c] == n]
            if not kids and tree.depths[n] < depth:
                assert tree.reason[n] == ("no_successors" if tree.tokens[n] not in table else Reason.BUDGET.value)
