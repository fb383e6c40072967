"""The tree mask and KV compaction against plain causal computation."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from dynatree_core.core.kv import KVState, chain_then_tree_visibility
from dynatree_core.core.tree import DraftTree


def _causal_logits(model, tokens):
    return model(input_ids=torch.tensor([tokens])).logits[0]


@torch.inference_mode()
def test_chain_shaped_tree_gives_causal_logits(arch):
    model = tiny_model(arch)
    prompt, chain = [4, 8, 15, 16], [23, 42, 7, 9, 1]
    tree = DraftTree.with_root(prompt[-1])
    node = 0
    for tok in chain:
        node = tree.add(node, tok, -0.5)
    order = tree.order("bfs")
    kv = KVState(model, prompt)
    prefix = kv.pending[:-1]
    kv.forward(
        prefix,
        list(range(len(prefix))),
        chain_then_tree_visibility(0, len(prefix), torch.zeros(0, 0, dtype=torch.bool)),
        1,
    )
    visible = chain_then_tree_visibility(kv.length, 1, tree.ancestor_mask(order)[1:, 1:])
    tokens = [prompt[-1]] + [tree.tokens[n] for n in order[1:]]
    logits = kv.forward(tokens, tree.position_ids(order, len(prompt) - 1), visible, len(order))
    expected = _causal_logits(model, prompt + chain)[len(prompt) - 1 :]
    torch.testing.assert_close(logits, expected.float(), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("path", [[], [1], [1, 3], [2, 4], [1, 5]])
def test_compaction_equals_recomputing_the_cache(arch, path):
    """Verify a branching tree, keep only an accepted path, then compare with a cache built
    from scratch over the committed tokens: same keys/values, same next logits."""
    model = tiny_model(arch)
    prompt = [3, 1, 4, 1, 5, 9]
    tree = DraftTree.with_root(prompt[-1])
    a = tree.add(0, 26, -0.1)  # node 1
    b = tree.add(0, 53, -0.3)  # node 2
    tree.add(a, 58, -0.2)  # node 3
    tree.add(b, 97 % 96, -0.2)  # node 4
    tree.add(a, 93, -0.9)  # node 5
    order = tree.order("bfs")
    kv = KVState(model, prompt)
    visible = chain_then_tree_visibility(0, len(prompt), tree.ancestor_mask(order)[1:, 1:])
    positions = list(range(len(prompt))) + tree.position_ids(order[1:], len(prompt) - 1)
    kv.forward(prompt + [tree.tokens[n] for n in order[1:]], positions, visible, 1)

    row = {n: i for i, n in enumerate(order)}
    kv.keep(list(range(len(prompt))) + [len(prompt) - 1 + row[n] for n in path])

    committed = prompt + [tree.tokens[n] for n in path]
    fresh = KVState(model, committed)
    fresh.forward(
        committed,
        list(range(len(committed))),
        chain_then_tree_visibility(0, len(committed), torch.zeros(0, 0, dtype=torch.bool)),
        1,
    )
    for mine, ref in zip(kv.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, ref.keys)
        torch.testing.assert_close(mine.values, ref.values)
    nxt = [17]
    vis = chain_then_tree_visibility(kv.length, 1, torch.zeros(0, 0, dtype=torch.bool))
    got = kv.forward(nxt, [len(committed)], vis, 1)
    want = fresh.forward(nxt, [len(committed)], vis, 1)
    torch.testing.assert_close(got, want)
