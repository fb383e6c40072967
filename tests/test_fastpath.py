"""The static KV cache and the lean forward against the stock transformers reference path.

Three ways a forward can run (kv.KVState): `dynamic` (transformers' DynamicCache, concatenating:
the reference), `static` (the HF forward over preallocated SlotLayer buffers) and `lean`
(fastpath.LeanForward over the same buffers; Llama-family models only). All three must give the
same logits, the same compaction and the same greedy decoding for every policy.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHS, hf_greedy, noisy_copy, tiny_model, tree_batch

from dynatree_core.core.packing import pack_linears
from dynatree_core.core.settings import ForwardSettings
from dynatree_core.core.tree import DraftTree
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.forward.fastpath import FUSE_MAX_BYTES, LeanForward, lean_forward_for, supports_lean
from dynatree_core.forward.kv import SLACK, KVState, SlotLayer
from dynatree_core.forward.rows import Rows

PATHS = {"dynamic": dict(static=False, fast=False), "static": dict(static=True, fast=False), "lean": {}}
LEAN_ARCHS = ("llama", "qwen2")
POLICIES = (
    ("linear", {"k": 4}),
    ("fixed_tree", {"tau": 0.0, "branch": 3, "depth": 5, "budget": 24}),
    ("dynatree", {}),
    ("dyspec", {"budget": 7, "depth": 3}),
    ("dyspec_threshold", {"threshold": 0.01}),
    ("eagle2", {"total": 5, "topk": 2}),
    ("salf", {"th": 0.0, "nodes": 12, "batch": 3}),
    ("delayed", {"k": 3, "l1": 0, "l2": 4}),
    ("delayed_auto", {"warmup": 1}),
    ("ngram", {}),
    ("suffix", {"branches": 2}),
    ("recycle", {}),
    ("joined_fixed_tree", {}),
)


def _prefill(kv: KVState, tokens: list[int]) -> torch.Tensor:
    out = kv.run(Rows.chain(tokens, 0)).logits
    kv.pending = []
    return out


def _branching_tree(root: int) -> DraftTree:
    tree = DraftTree.with_root(root)
    a, b = tree.add(0, 26, -0.1), tree.add(0, 53, -0.3)
    tree.add(a, 58, -0.2)
    tree.add(b, 95, -0.2)
    tree.add(a, 93, -0.9)
    return tree


def _tree_forward(kv: KVState, tree: DraftTree, root_pos: int) -> tuple[torch.Tensor, list[int]]:
    order = tree.order("bfs")
    return kv.run(tree_batch(tree, order, kv.length, [tree.tokens[0]], root_pos)).logits, order


@torch.inference_mode()
@pytest.mark.parametrize(
    ("arch", "path"), [(a, "static") for a in ARCHS] + [(a, "lean") for a in LEAN_ARCHS]
)  # the lean forward covers Llama-family models only
def test_tree_forward_logits_equal_the_reference_path(arch, path):
    model, prompt = tiny_model(arch), [3, 1, 4, 1, 5, 9]
    ref, mine = KVState(model, prompt, **PATHS["dynamic"]), KVState(model, prompt, **PATHS[path])
    assert (mine.lean is not None) == (path == "lean"), "the lean forward runs exactly where asked"
    torch.testing.assert_close(_prefill(mine, prompt[:-1]), _prefill(ref, prompt[:-1]), rtol=1e-9, atol=1e-9)
    tree = _branching_tree(prompt[-1])
    got, _ = _tree_forward(mine, tree, len(prompt) - 1)
    want, _ = _tree_forward(ref, tree, len(prompt) - 1)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@torch.inference_mode()
def test_lean_forward_takes_attention_output_in_cuda_layout(monkeypatch):
    """CUDA's attention kernels return (B, heads, T, d) laid out rows-major (a transposed view),
    which `.view` cannot reshape (seen on the first H200 run of gpu-check); the lean forward must
    give the same logits whatever the output's strides."""
    model, prompt = tiny_model("llama"), [3, 1, 4, 1, 5, 9]
    ref, mine = KVState(model, prompt, **PATHS["dynamic"]), KVState(model, prompt)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def strided(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, CUDA's layout

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strided)
    torch.testing.assert_close(_prefill(mine, prompt[:-1]), _prefill(ref, prompt[:-1]), rtol=1e-9, atol=1e-9)
    got, _ = _tree_forward(mine, _branching_tree(prompt[-1]), len(prompt) - 1)
    want, _ = _tree_forward(ref, _branching_tree(prompt[-1]), len(prompt) - 1)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@torch.inference_mode()
@pytest.mark.parametrize("path", ["static", "lean"])
@pytest.mark.parametrize("accepted", [[], [1], [1, 3], [2, 4]])
def test_static_compaction_equals_recomputation(arch, path, accepted):
    """Verify a branching tree, keep an accepted path inside the buffer, and compare with a fresh
    cache over the committed tokens: same keys/values in the valid slots, same next logits."""
    model, prompt = tiny_model(arch), [3, 1, 4, 1, 5, 9]
    kv = KVState(model, prompt, **PATHS[path])
    _prefill(kv, prompt[:-1])
    tree = _branching_tree(prompt[-1])
    _, order = _tree_forward(kv, tree, len(prompt) - 1)
    row = {n: i for i, n in enumerate(order)}
    root_slot = len(prompt) - 1
    kv.keep(list(range(root_slot + 1)) + [root_slot + row[n] for n in accepted])
    assert all(isinstance(layer, SlotLayer) and layer.length == kv.length for layer in kv.cache.layers)
    committed = prompt + [tree.tokens[n] for n in accepted]
    fresh = KVState(model, committed, **PATHS["dynamic"])
    _prefill(fresh, committed)
    for mine, ref in zip(kv.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, ref.keys, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(mine.values, ref.values, rtol=1e-9, atol=1e-9)
    nxt = Rows.chain([17], len(committed))
    torch.testing.assert_close(kv.run(nxt).logits, fresh.run(nxt).logits, rtol=1e-9, atol=1e-9)


@torch.inference_mode()
def test_static_buffers_are_written_in_place_and_grow_only_when_full():
    model, prompt = tiny_model("llama"), list(range(1, 9))
    kv = KVState(model, prompt, capacity=len(prompt))
    _prefill(kv, prompt)
    buffers = [layer.key_buf.data_ptr() for layer in kv.cache.layers]
    for _ in range(SLACK - 1):  # fills the slack one token at a time: no reallocation
        kv.run(Rows.chain([5], kv.length))
    assert [layer.key_buf.data_ptr() for layer in kv.cache.layers] == buffers and kv.grows == 0
    ref = KVState(model, prompt, **PATHS["dynamic"])
    _prefill(ref, prompt)
    for _ in range(SLACK - 1):
        ref.run(Rows.chain([5], ref.length))
    wide = 40  # past the capacity: the buffer grows once and keeps every entry
    got = kv.run(Rows.chain([7] * wide, kv.length, wide)).logits
    want = ref.run(Rows.chain([7] * wide, ref.length, wide)).logits
    assert kv.grows == 1
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("policy_name,params", POLICIES)
def test_every_policy_stays_exact_on_every_forward_path(arch, path, policy_name, params):
    target, draft = tiny_model(arch), noisy_copy(arch, 0.01)
    config = DecodeConfig(
        max_new_tokens=30,
        forward=ForwardSettings(static_cache=PATHS[path].get("static"), fast_forward=PATHS[path].get("fast")),
    )
    for prompt in ([1, 5, 7, 9, 11], [42, 17, 8, 8, 8, 8, 60, 2, 90, 33, 12, 4]):
        result = generate(target, prompt, make_method(policy_name, params), draft=draft, config=config)
        assert result.token_ids == hf_greedy(target, prompt, 30), f"{policy_name} on the {path} path diverged"


@torch.inference_mode()
def test_packed_float32_lean_forward_matches_the_packed_hf_forward():
    model = copy.deepcopy(tiny_model("llama")).float()
    pack_linears(model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref, mine = KVState(model, prompt, **PATHS["static"]), KVState(model, prompt)
    assert mine.lean is not None
    torch.testing.assert_close(_prefill(mine, prompt), _prefill(ref, prompt), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_fused_projections_give_the_same_logits():
    model, prompt = tiny_model("qwen2"), [3, 1, 4, 1, 5, 9]  # qwen2: q/k/v carry biases
    outs = []
    for fuse in (False, True):
        kv = KVState(model, prompt)
        kv.lean = LeanForward(model, fuse=fuse)
        outs.append(_prefill(kv, prompt))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-9)


def test_lean_forward_is_reused_and_rebuilt_when_the_model_changes():
    model = copy.deepcopy(tiny_model("llama"))
    first = lean_forward_for(model)
    assert first is lean_forward_for(model), "built once per model, shared by runs"
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)  # a training step
    second = lean_forward_for(model)
    assert second is not first, "a weight update must not leave stale fused copies"
    pack_linears(model.float())
    assert lean_forward_for(model) is not second, "packing replaces modules"
    assert first.blocks[0].qkv is not None, f"a tiny model is fused (copy under {FUSE_MAX_BYTES} bytes)"


def test_lean_forward_switches_and_coverage(monkeypatch):
    assert supports_lean(tiny_model("llama")) and supports_lean(tiny_model("qwen2"))
    assert not supports_lean(tiny_model("gpt2")) and not supports_lean(tiny_model("gpt_neox"))
    assert lean_forward_for(tiny_model("llama"), fast=False) is None
    monkeypatch.setenv("DYNATREE_FAST_FORWARD", "0")
    assert KVState(tiny_model("llama"), [1]).lean is None
    monkeypatch.setenv("DYNATREE_STATIC_CACHE", "0")
    kv = KVState(tiny_model("llama"), [1])
    assert not kv.static and kv.lean is None, "no static buffers: the lean forward has nothing to write to"


def test_static_cache_serves_every_architecture(arch):
    kv = KVState(tiny_model(arch), [1, 2, 3])
    assert kv.static and all(isinstance(layer, SlotLayer) for layer in kv.cache.layers)


# The forms a GPU's lean forward takes (one fused RMSNorm kernel, the target's projections fused),
# run here by naming the CPU among those devices (conftest's gpu_forms): the same logits up to
# rounding, the same tokens.
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_the_rotation_is_transformers_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from dynatree_core.forward.fastpath import _rotate, rope_pair

    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor([[0, 1, 2, 3, 7, 7, 8, 40, 41]])
    cos, sin = model.model.rotary_emb(torch.zeros(1, 9, 1, dtype=dtype), positions)  # (1, 9, head_dim)
    q, k = (torch.randn(1, heads, 9, cos.shape[-1], generator=gen).to(dtype) for heads in (4, 2))
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    pair = rope_pair(cos, sin)
    assert torch.equal(_rotate(q, *pair), want_q) and torch.equal(_rotate(k, *pair), want_k)


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@torch.inference_mode()
def test_the_gpus_forms_keep_the_logits_and_every_policy_exact(arch, gpu_forms):
    model = copy.deepcopy(tiny_model(arch))  # a model of its own: its lean forward built with these forms
    lean = lean_forward_for(model)
    assert lean.blocks[0].qkv is not None and lean.blocks[0].gate_up is not None
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = KVState(model, prompt, **PATHS["static"])
    torch.testing.assert_close(_prefill(KVState(model, prompt), prompt), _prefill(ref, prompt), rtol=1e-5, atol=1e-5)
    draft = noisy_copy(arch, 0.3)
    for name, params in POLICIES[:6]:
        result = generate(model, prompt, make_method(name, params), draft=draft, config=DecodeConfig(20))
        assert result.token_ids == hf_greedy(model, prompt, 20), name


@torch.inference_mode()
def test_the_gpus_fused_adds_write_into_the_residual_and_leave_inputs_and_taps_alone(gpu_forms):
    """The residual adds inside the o and down GEMMs update x in place: an `embeds` input passed
    by a caller must come back unchanged, and a tapped layer input must be the value it had then
    (transformers' own hidden states are the reference)."""
    from dynatree_core.forward.fastpath import _residual, _rotate, _rotate_fused

    model = copy.deepcopy(tiny_model("llama"))
    block = lean_forward_for(model).blocks[0]
    assert block.add_o is not None and block.add_down is not None and block.rotate is _rotate_fused
    size, dtype = model.config.hidden_size, model.dtype
    x, a = torch.randn(1, 5, size, dtype=dtype), torch.randn(1, 5, size, dtype=dtype)
    want = x + block.o(a)
    assert block.add_o(x, a) is x and torch.allclose(x, want, atol=1e-5)
    q, cos, sin = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)
    torch.testing.assert_close(_rotate_fused(q, cos, sin), _rotate(q, cos, sin))
    assert _residual(torch.nn.Linear(4, 4, bias=False)) is not None and _residual(torch.nn.Linear(4, 4)) is None
    embeds = torch.randn(1, 6, size, dtype=dtype)
    kept = embeds.clone()
    ids, positions = torch.arange(6)[None], torch.arange(6)[None]
    mask = torch.zeros(1, 1, 6, 6, dtype=dtype).masked_fill_(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    layers = KVState(model, list(range(6)), capacity=16).cache.layers
    fused = lean_forward_for(model)(ids, positions, mask, layers, 6, embeds=embeds, hidden=(0, 1))
    assert torch.equal(embeds, kept), "the caller's embeds were written"
    reference = model(inputs_embeds=embeds, output_hidden_states=True)
    for tap in (0, 1):
        torch.testing.assert_close(fused.states[:, tap], reference.hidden_states[tap][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.logits, reference.logits[0], rtol=1e-4, atol=1e-4)


def test_the_gpus_rotation_writes_over_the_fused_projection_so_k_lies_beside_v(gpu_forms):
    """On a GPU the rotation writes q and k over the fused q/k/v output (one cache write then
    takes k and v: slots.side_by_side): the same bits as the rotation into a new tensor; under
    autograd (out= has none) it rotates into a new tensor and the backward runs."""
    from dynatree_core.forward.fastpath import _rotate_fused
    from dynatree_core.forward.slots import side_by_side

    model = copy.deepcopy(tiny_model("llama"))
    block = lean_forward_for(model).blocks[0]
    assert block.qkv is not None, "the GPU's form fuses q/k/v"
    dtype = model.dtype
    h = torch.randn(1, 5, model.config.hidden_size, dtype=dtype)
    cos, sin = (torch.randn(1, 1, 5, block.head_dim, dtype=dtype) for _ in "cs")
    with torch.inference_mode():
        q, k, v = block.project(h, cos, sin)
        qkv = block.qkv(h).view(1, 5, -1, block.head_dim).transpose(1, 2)
        want = _rotate_fused(qkv[:, : block.qk_heads], cos, sin)
    assert side_by_side(k, v) is not None
    assert torch.equal(q, want[:, : block.heads]) and torch.equal(k, want[:, block.heads :])
    assert torch.equal(v, qkv[:, block.qk_heads :])
    graded = h.clone().requires_grad_()
    q, k, v = block.project(graded, cos, sin)
    (q.sum() + k.sum() + v.sum()).backward()
    assert graded.grad is not None and side_by_side(k, v) is None
