"""The one visibility builder (forward/rows.py) against the masks written out by hand: the prefill,
a chain, a verify batch (chain then tree, padded or not), a draft level, batched answers."""

from __future__ import annotations

import pytest
import torch
from conftest import ancestor_mask, examples
from hypothesis import given
from hypothesis import strategies as st

from dynatree_core.core.tree import DraftTree
from dynatree_core.forward.rows import Rows, closure, lineage, visibility


def _chain_then_tree(past: int, chain: int, tree_ancestors: torch.Tensor) -> torch.Tensor:
    """The verify batch's mask as the papers draw it: the cache seen by all, the chain causal, each
    tree node its ancestors (tree_ancestors (n, n), root excluded) after the whole chain."""
    n = tree_ancestors.shape[0]
    q = chain + n
    mask = torch.zeros(q, past + q, dtype=torch.bool)
    mask[:, :past] = True
    for i in range(chain):
        mask[i, past : past + i + 1] = True
    mask[chain:, past : past + chain] = True
    mask[chain:, past + chain :] = tree_ancestors
    return mask


@st.composite
def trees(draw) -> DraftTree:
    tree = DraftTree.with_root(1)
    for token in range(draw(st.integers(0, 14))):
        tree.add(draw(st.integers(0, len(tree) - 1)), 10 + token, -0.5)
    return tree


def _verify_rows(past, chain: int, lines: torch.Tensor, **fields) -> Rows:
    """A verify batch's rows: `chain` pending rows (the root last), then the tree's rows whose
    `lines` (rows.lineage, the root's row first) name their ancestors."""
    n = lines.shape[0] - 1
    tokens, positions = list(range(100, 100 + n)), list(range(50, 50 + n))
    return Rows.tree(past, list(range(chain)), past, tokens, positions, lines, **fields)


@examples(60)
@given(tree=trees(), past=st.integers(0, 6), chain=st.integers(1, 3), kind=st.sampled_from(["bfs", "dfs"]))
def test_a_verify_batch_sees_the_cache_its_chain_and_its_ancestors(tree, past, chain, kind):
    order = tree.order(kind)
    lines = lineage(tree.parent_rows(order))
    assert torch.equal(closure(lines), ancestor_mask(tree, order))
    want = _chain_then_tree(past, chain, ancestor_mask(tree, order)[1:, 1:])
    rows = _verify_rows(past, chain, lines)
    assert torch.equal(rows.seen, want) and rows.slots is None
    n = len(order) - 1
    assert rows.ids == list(range(chain)) + list(range(100, 100 + n))
    assert rows.positions == list(range(past, past + chain)) + list(range(50, 50 + n))


@examples(30)
@given(tree=trees(), past=st.integers(0, 6), chain=st.integers(1, 3), pad=st.integers(1, 5), extra=st.integers(0, 9))
def test_a_padded_verify_batch_keeps_its_rows_and_pads_with_rows_that_see_themselves(tree, past, chain, pad, extra):
    order = tree.order("bfs")
    lines, q = lineage(tree.parent_rows(order)), chain + len(order) - 1
    span = past + q + pad + extra
    # a device scalar, as a captured step's
    rows = _verify_rows(torch.tensor(past), chain, lines, width=q + pad, span=span)
    seen = rows.seen
    assert seen.shape == (q + pad, span) and torch.equal(rows.slots, past + torch.arange(q + pad))
    assert torch.equal(seen[:q, : past + q], _verify_rows(past, chain, lines).seen) and not seen[:q, past + q :].any()
    own = torch.zeros(pad, span, dtype=torch.bool)
    own[torch.arange(pad), past + q + torch.arange(pad)] = True
    assert torch.equal(seen[q:], own)
    assert torch.equal(rows.ids[q:], torch.zeros(pad, dtype=torch.long))


@examples(30)
@given(tree=trees(), past=st.integers(0, 6), chain=st.integers(1, 3), pad=st.integers(0, 5))
def test_a_host_batch_uploaded_padded_with_its_count_sees_what_the_unpadded_batch_does(tree, past, chain, pad):
    """A verify batch built on the host goes up with its node rows padded to the width (one graph a
    width, forward/filled.py's `uploaded`) and its real count: the visibility is the batch's own."""
    order = tree.order("bfs")
    lines = lineage(tree.parent_rows(order))
    n = len(order) - 1
    q = chain + n
    width, span = q + pad, past + q + pad + 3
    d = lines.shape[1]
    own = torch.arange(q, width)[:, None].expand(pad, d)  # a padding row's lineage: its own row
    padded = torch.cat([lines + (chain - 1), own]) + past
    tokens, positions = torch.arange(100, 100 + n + pad), torch.arange(50, 50 + n + pad)
    rows = Rows.batch(past, torch.arange(chain), past, tokens, positions, padded, width=width, span=span, real=q)
    assert torch.equal(rows.seen, _verify_rows(past, chain, lines, width=width, span=span).seen)


@pytest.mark.parametrize("past,n", [(0, 1), (0, 5), (3, 1), (4, 6)])
def test_a_chain_is_causal_after_the_cache(past, n):
    want = torch.ones(n, past + n, dtype=torch.bool)
    want[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
    rows = Rows.chain(list(range(n)), past, 2)
    assert rows.positions == list(range(past, past + n)) and rows.keep == 2 and torch.equal(rows.seen, want)
    padded = Rows.batch(torch.tensor(past), torch.arange(n), past + 1, width=n + 2, span=past + n + 4)
    assert torch.equal(padded.seen[:n, : past + n], want) and not padded.seen[:n, past + n :].any()
    assert padded.seen[n:].sum() == 2 and padded.seen[n, past + n] and padded.seen[n + 1, past + n + 1]
    assert padded.positions[:n].tolist() == list(range(past + 1, past + 1 + n))


def test_a_draft_level_sees_the_committed_entries_its_ancestors_and_itself():
    # 4 committed entries, a first level at slots 4, 5, the second level's rows at 6, 7, then padding at 8
    ancestors = torch.tensor([[4, 6], [4, 7]])
    rows = Rows.batch(6, (), 0, torch.tensor([11, 12]), torch.tensor([5, 5]), ancestors, below=4, width=3, span=10)
    want = torch.zeros(3, 10, dtype=torch.bool)
    want[:2, :4] = True
    for row, slots in enumerate([[4, 6], [4, 7], [8]]):
        want[row, slots] = True
    assert torch.equal(rows.seen, want) and rows.ids.tolist() == [11, 12, 0] and rows.slots.tolist() == [6, 7, 8]
    alone = Rows.batch(6, (), 0, torch.tensor([11, 12]), torch.tensor([5, 5]), ancestors, below=4, keep=2)
    assert torch.equal(alone.seen, want[:2, :8]) and alone.slots is None


def test_batched_answers_see_up_to_their_own_length():
    """The recipes' rows from the one builder: a prefill of B chains shares one causal visibility
    and positions from 0; a step's row of each sequence sits at its own length and sees its
    sequence's slots up to its own."""
    ids = torch.tensor([[4, 5, 6, 7], [8, 9, 10, 11]])
    prefill = Rows.chain(ids, 0, keep=0)
    assert torch.equal(prefill.ids, ids) and prefill.positions.tolist() == [0, 1, 2, 3]
    assert torch.equal(prefill.seen, torch.ones(4, 4, dtype=torch.bool).tril())
    lens = torch.tensor([0, 3, 5])
    step = Rows.batch(lens[:, None], torch.tensor([[1], [2], [3]]), lens[:, None], width=1, span=6, keep=0)
    assert torch.equal(step.seen, (torch.arange(6)[None] <= lens[:, None])[:, None])
    assert step.positions.tolist() == step.slots.tolist() == [[0], [3], [5]]
    assert torch.equal(visibility(lens + 1, None, 6), torch.arange(6)[None] <= lens[:, None])
