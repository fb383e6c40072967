"""The tree mask and KV compaction against plain causal computation."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tree_batch

from dynatree_core.core.tree import DraftTree
from dynatree_core.forward.choice import choose_forward
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.reference import Forward
from dynatree_core.forward.rows import Rows


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
    kv.run(Rows.chain(prefix, 0))
    logits = kv.run(tree_batch(tree, order, kv.length, [prompt[-1]], len(prompt) - 1)).logits
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
    kv.run(tree_batch(tree, order, 0, prompt, len(prompt) - 1, keep=1))

    row = {n: i for i, n in enumerate(order)}
    kv.keep(list(range(len(prompt))) + [len(prompt) - 1 + row[n] for n in path])

    committed = prompt + [tree.tokens[n] for n in path]
    fresh = KVState(model, committed)
    fresh.run(Rows.chain(committed, 0))
    for mine, ref in zip(kv.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, ref.keys)
        torch.testing.assert_close(mine.values, ref.values)
    nxt = [17]
    got = kv.run(Rows.chain(nxt, len(committed))).logits
    want = fresh.run(Rows.chain(nxt, len(committed))).logits
    torch.testing.assert_close(got, want)


SWITCHES = {  # the switches DecodeConfig carries -> the implementation choice.choose_forward picks
    "reference": (dict(static=False), "dynamic"),
    "reference-static": (dict(fast=False), "static"),
    "lean": ({}, "lean"),
    "captured": (dict(graphs=True), "lean+padded"),
    "invariant": (dict(invariant=True), "lean+invariant"),
}


@pytest.mark.parametrize("name", SWITCHES)
def test_one_place_picks_the_forward_and_says_why(name):
    switches, path = SWITCHES[name]
    choice = choose_forward(tiny_model("llama"), **switches)
    assert choice.kind == name.split("-")[0] and choice.path.startswith(path), choice
    assert choice.why, "every choice says why it was made"
    assert KVState(tiny_model("llama"), [1, 2], **switches).path.startswith(path), "KVState runs the choice"


def test_a_model_without_the_lean_forward_says_so_when_invariance_is_asked():
    choice = choose_forward(tiny_model("gpt2"), invariant=True)
    assert choice.kind == "reference" and choice.path == "static (not width-invariant: needs the lean forward)"


@torch.inference_mode()
@pytest.mark.parametrize("name", SWITCHES)
def test_every_forward_returns_one_result_type_with_states_only_when_asked(name):
    model, prompt = tiny_model("llama"), [4, 8, 15, 16]
    kv = KVState(model, prompt, **SWITCHES[name][0])
    out = kv.run(Rows.chain(prompt, 0, 2))
    assert isinstance(out, Forward) and out.states is None and out.logits.shape == (2, model.config.vocab_size)
    assert out.logits.dtype == torch.float32
    out = kv.run(Rows.chain([23], len(prompt), hidden=True))
    assert isinstance(out, Forward) and out.states.shape == (1, model.config.hidden_size)
