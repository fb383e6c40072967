"""The one visibility builder (forward/rows.py) against the masks written out by hand: the prefill,
a chain, a verify batch (chain then tree, padded or not), a draft level, batched answers."""

from __future__ import annotations

import pytest
import torch
from conftest import ancestor_mask, examples
from hypothesis import given
from hypothesis import strategies as st

from dynatree_core.core.tree import DraftTree
from dynatree_core.forward.rows import Rows, batch_lines, causal, closure, lineage, tree_seen, visibility


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


@examples(60)
@given(tree=trees(), past=st.integers(0, 6), chain=st.integers(1, 3), kind=st.sampled_from(["bfs", "dfs"]))
def test_a_verify_batch_sees_the_cache_its_chain_and_its_ancestors(tree, past, chain, kind):
    order = tree.order(kind)
    lines = lineage(tree.parent_rows(order))
    assert torch.equal(closure(lines), ancestor_mask(tree, order))
    want = _chain_then_tree(past, chain, ancestor_mask(tree, order)[1:, 1:])
    assert torch.equal(tree_seen(past, chain, lines), want)


@examples(30)
@given(tree=trees(), past=st.integers(0, 6), chain=st.integers(1, 3), pad=st.integers(1, 5), extra=st.integers(0, 9))
def test_a_padded_verify_batch_keeps_its_rows_and_pads_with_rows_that_see_themselves(tree, past, chain, pad, extra):
    order = tree.order("bfs")
    lines, q = lineage(tree.parent_rows(order)), chain + len(order) - 1
    span = past + q + pad + extra
    seen = tree_seen(torch.tensor(past), chain, lines, span, q + pad)  # a device scalar, as a captured step's
    assert seen.shape == (q + pad, span)
    assert torch.equal(seen[:q, : past + q], tree_seen(past, chain, lines)) and not seen[:q, past + q :].any()
    own = torch.zeros(pad, span, dtype=torch.bool)
    own[torch.arange(pad), past + q + torch.arange(pad)] = True
    assert torch.equal(seen[q:], own)


@examples(30)
@given(tree=trees(), past=st.integers(0, 6), chain=st.integers(1, 3), pad=st.integers(0, 5))
def test_a_host_batch_uploaded_as_bounds_and_lineages_sees_what_tree_seen_gives(tree, past, chain, pad):
    """A verify batch built on the host goes up as each row's bound and lineage (batch_lines, one
    graph a width): the captured step's visibility from them is tree_seen's."""
    order = tree.order("bfs")
    lines = lineage(tree.parent_rows(order))
    q = chain + len(order) - 1
    width, span = q + pad, past + q + pad + 3
    flat = torch.tensor(batch_lines(chain, lines.tolist(), width))
    before, every = flat[:width], flat[width:].view(width, width)
    seen = visibility(past + before, past + every, span, torch.arange(width) < q)
    assert torch.equal(seen, tree_seen(past, chain, lines, span, width))


@pytest.mark.parametrize("past,n", [(0, 1), (0, 5), (3, 1), (4, 6)])
def test_a_chain_is_causal_after_the_cache(past, n):
    want = torch.ones(n, past + n, dtype=torch.bool)
    want[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(causal(past, n), want)
    rows = Rows.chain(list(range(n)), past, 2)
    assert rows.positions == list(range(past, past + n)) and rows.keep == 2 and torch.equal(rows.seen, want)


def test_a_draft_level_sees_the_committed_entries_its_ancestors_and_itself():
    # 4 committed entries, a first level at slots 4, 5, the second level's rows at 6, 7, 8
    ancestors = torch.tensor([[4, 6], [4, 7], [5, 8]])
    real = torch.tensor([True, True, False])
    seen = visibility(4, ancestors, 9, real)
    want = torch.zeros(3, 9, dtype=torch.bool)
    want[:2, :4] = True
    for row, slots in enumerate([[4, 6], [4, 7], [5, 8]]):
        want[row, slots] = True
    assert torch.equal(seen, want)


def test_batched_answers_see_up_to_their_own_length():
    lens = torch.tensor([0, 3, 5])
    want = torch.arange(6)[None] <= lens[:, None]
    assert torch.equal(visibility(lens + 1, None, 6), want)
