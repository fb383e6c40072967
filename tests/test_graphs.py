"""Captured forwards (graphs.py): the fixed-shape padded forward against the unpadded lean one.

On CUDA the padded forward is replayed as one CUDA graph per width bucket; on a CPU the same
arithmetic runs eagerly (KVState(graphs=True)), which is what these tests pin down: padded rows,
attention over the whole buffer and slot-indexed writes change nothing the engine can see. The
CUDA test runs only where a GPU exists.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import hf_greedy, noisy_copy, tiny_model
from test_fastpath import LEAN_ARCHS, _branching_tree, _prefill, _tree_forward

from dynatree_core import graphs
from dynatree_core.drafting.feature import FeatureDraft
from dynatree_core.engine import DecodeConfig, generate
from dynatree_core.graphs import bucket_for, buckets, graphs_enabled
from dynatree_core.kv import KVState, chain_then_tree_visibility, forward_path
from dynatree_core.methods import make_method

TOL = dict(rtol=1e-5, atol=1e-5)  # attention over more (masked) keys: same math, other summation blocks


def test_buckets_are_powers_of_two_up_to_the_widest():
    assert buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket_for(q, buckets(128)) for q in (1, 2, 3, 5, 64, 65, 128, 129)] == [1, 2, 4, 8, 64, 128, 128, None]


def test_graphs_are_on_for_cuda_only_unless_asked(monkeypatch):
    assert graphs_enabled(torch.device("cuda")) and not graphs_enabled(torch.device("cpu"))
    assert graphs_enabled(torch.device("cpu"), True) and not graphs_enabled(torch.device("cuda"), False)
    monkeypatch.setenv("DYNATREE_GRAPHS", "0")
    assert not graphs_enabled(torch.device("cuda"))
    model = tiny_model("llama")
    assert forward_path(model, graphs=True) == "lean+padded" and forward_path(model) == "lean"


@torch.inference_mode()
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_padded_forwards_equal_unpadded_ones_through_compaction(arch):
    """Prefill, a 6-node tree (padded to 8), compaction of an accepted path, then a 1-token step:
    logits, hidden states and the valid cache slots all equal the unpadded lean path's."""
    model, prompt = tiny_model(arch), [3, 1, 4, 1, 5, 9]
    ref, mine = KVState(model, prompt), KVState(model, prompt, graphs=True)
    assert mine.padded is not None and ref.padded is None
    torch.testing.assert_close(_prefill(mine, prompt[:-1]), _prefill(ref, prompt[:-1]), **TOL)
    tree = _branching_tree(prompt[-1])
    got, order = _tree_forward(mine, tree, len(prompt) - 1)
    want, _ = _tree_forward(ref, tree, len(prompt) - 1)
    torch.testing.assert_close(got, want, **TOL)
    keep = list(range(len(prompt))) + [len(prompt) - 1 + order.index(n) for n in (1, 3)]
    mine.keep(keep)
    ref.keep(keep)
    for a, b in zip(mine.cache.layers, ref.cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, **TOL)
        torch.testing.assert_close(a.values, b.values, **TOL)
    nxt = chain_then_tree_visibility(mine.length, 1, torch.zeros(0, 0, dtype=torch.bool))
    got, got_h = mine.forward([17], [len(keep)], nxt, 1, hidden=True)
    want, want_h = ref.forward([17], [len(keep)], nxt, 1, hidden=True)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_h, want_h, **TOL)


@torch.inference_mode()
def test_wider_than_every_bucket_falls_back_and_a_full_cache_grows(monkeypatch):
    """A prefill wider than the largest bucket takes the unpadded path; a padded forward that does
    not fit the buffer grows it (dropping the buckets built for the old buffer)."""
    monkeypatch.setattr(graphs, "MAX_BUCKET", 4)
    model, prompt = tiny_model("llama"), list(range(1, 11))
    ref, mine = KVState(model, prompt, capacity=10), KVState(model, prompt, capacity=10, graphs=True)
    torch.testing.assert_close(_prefill(mine, prompt), _prefill(ref, prompt), **TOL)
    assert not mine.padded.buckets, "10 rows > the widest bucket: the unpadded path"
    capacity = mine.cache.layers[0].capacity
    for step in range(capacity - len(prompt) + 2):  # past the capacity, one token at a time
        nxt = chain_then_tree_visibility(mine.length, 1, torch.zeros(0, 0, dtype=torch.bool))
        token = [1 + step % 50]
        torch.testing.assert_close(
            mine.forward(token, [mine.length], nxt, 1), ref.forward(token, [ref.length], nxt, 1), **TOL
        )
    assert mine.grows >= 1 and mine.padded.buckets, "the buffer grew and buckets were rebuilt"


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@pytest.mark.parametrize(
    "policy_name,params",
    [("linear", {"k": 4}), ("fixed_tree", {}), ("dynatree", {}), ("eagle2", {"total": 5, "topk": 2})],
)
def test_policies_stay_exact_on_the_padded_path(arch, policy_name, params):
    target, draft = tiny_model(arch), noisy_copy(arch, 0.01)
    config = DecodeConfig(max_new_tokens=30, graphs=True)
    for prompt in ([1, 5, 7, 9, 11], [42, 17, 8, 8, 8, 8, 60, 2, 90, 33, 12, 4]):
        result = generate(target, prompt, make_method(policy_name, params), draft=draft, config=config)
        assert result.token_ids == hf_greedy(target, prompt, 30), f"{policy_name} diverged on the padded path"
        assert result.forward_path == "lean+padded"


def test_a_feature_draft_stays_exact_on_the_padded_path():
    target = tiny_model("llama")
    draft = FeatureDraft.from_target(target, seed=3)
    config = DecodeConfig(max_new_tokens=30, graphs=True)
    result = generate(target, [1, 5, 7, 9, 11], make_method("dynatree", {}), draft=draft, config=config)
    assert result.token_ids == hf_greedy(target, [1, 5, 7, 9, 11], 30)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_on_cuda_are_exact_and_replayed():
    target = copy.deepcopy(tiny_model("llama")).to("cuda")  # the cached tiny models stay on the CPU
    draft = copy.deepcopy(noisy_copy("llama", 0.01)).to("cuda")
    prompt = [1, 5, 7, 9, 11]
    config = DecodeConfig(max_new_tokens=30)
    result = generate(target, prompt, make_method("fixed_tree", {}), draft=draft, config=config)
    eager = generate(
        target, prompt, make_method("fixed_tree", {}), draft=draft, config=DecodeConfig(max_new_tokens=30, graphs=False)
    )
    assert result.forward_path == "lean+graphs" and result.token_ids == eager.token_ids


def test_reduced_precision_reports_say_outputs_may_differ_at_near_ties():
    from dynatree_core.metrics import exactness_note

    assert exactness_note("float32") is None and exactness_note("torch.float32") is None
    assert "near-ties" in exactness_note("bfloat16") and "float32 is token-identical" in exactness_note("float16")
