"""Triton's kernels for the lean forward on a GPU (forward/kernels.py), run here in Triton's
interpreter: each is its torch form up to rounding, a row's bits never depend on the rows beside
it, and with them a tree's path nodes keep `ar`'s bits and every run `ar`'s tokens."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import noisy_copy
from test_invariant import PROMPT, _model

from benchmarks.forward_kernels import forward_ops
from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.forward import kernels
from dynatree_core.forward.fastpath import _rotate_fused, lean_forward_for
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.static_rows import StaticRows, static_sequence_attention
from dynatree_core.measure import gpu_check


def _attention_case(dtype: torch.dtype, rows: int = 9, span: int = 256):
    """q (1, 6, rows, 64) over 2 key heads of 300 slots; row 3 sees 5 slots only (its later
    blocks are padding alone), the others about half of theirs."""
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, 2, 300, 64, generator=gen).to(dtype) for _ in "kv")
    q = torch.randn(1, 6, rows, 64, generator=gen).to(dtype)
    visible = torch.rand(rows, 300, generator=gen) < 0.4
    visible[:, 0], visible[:, span:] = True, False
    visible[3], visible[3, :5] = False, True
    return q, keys, values, visible


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_the_attention_kernel_is_the_fixed_shape_attention_and_a_rows_bits_are_its_own(dtype):
    q, keys, values, visible = _attention_case(dtype)
    rows = StaticRows(*StaticRows.build(visible, 256))
    want = static_sequence_attention(q, keys, values, rows, 0.125)  # the torch form (no kernels here)
    got = kernels.static_attention(q, keys[0], values[0], rows.slots, rows.tail, 0.125)  # blocks of 32
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert got.transpose(1, 2).is_contiguous(), "rows (W, heads * d) as the o projection reads them"
    for i in (0, 3):  # alone: a launch of one row, its own padding
        one = StaticRows(*StaticRows.build(visible[[i]], 256))
        alone = kernels.static_attention(q[:, :, [i]], keys[0], values[0], one.slots, one.tail, 0.125)
        assert torch.equal(alone[:, :, 0], got[:, :, i]), f"row {i} alone differs from row {i} among {q.shape[2]}"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_the_rotation_and_silu_kernels_are_the_torch_forms_up_to_rounding(dtype):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 5, 8, 16, generator=gen).to(dtype).transpose(1, 2)  # (B, heads, q, d) inside a buffer
    cos, sin = (torch.randn(2, 1, 5, 16, generator=gen).to(dtype) for _ in "cs")
    want = _rotate_fused(qkv[:, :6].clone(), cos, sin)
    v = qkv[:, 6:].clone()
    got = kernels.rotated(qkv[:, :6], cos, sin)
    assert got.data_ptr() == qkv.data_ptr(), "written over q and k where they lie"
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, 6:], v), "v untouched"
    x = torch.randn(2, 3, 5, 16, generator=gen).to(dtype)  # one cos / sin for both batch rows
    torch.testing.assert_close(
        kernels.rotated(x.clone(), cos[:1], sin[:1]), _rotate_fused(x, cos[:1], sin[:1]), atol=tol, rtol=tol
    )
    gate_up = torch.randn(2, 3, 40, generator=gen).to(dtype)
    want = F.silu(gate_up[..., :20]) * gate_up[..., 20:]
    torch.testing.assert_close(kernels.silu_mul(gate_up), want, atol=tol, rtol=tol)


def test_a_kernel_that_fails_its_check_leaves_the_torch_forms(monkeypatch):
    assert kernels.check(torch.device("cpu"))
    silu_mul = kernels.silu_mul
    monkeypatch.setattr(kernels, "silu_mul", lambda x: silu_mul(x) * (1 if x.dtype == torch.float32 else 1.05))
    assert not kernels.check(torch.device("cpu")), "checked in bfloat16 too"
    monkeypatch.setattr(kernels, "silu_mul", lambda x: 1 / 0)
    assert not kernels.check(torch.device("cpu"))
    monkeypatch.setattr(kernels.FORWARD, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(kernels.FORWARD, "verdicts", {})
    assert not kernels.enabled("cpu") and kernels.FORWARD.verdicts == {"cpu": False}
    monkeypatch.setenv("DYNATREE_KERNELS", "0")
    monkeypatch.setattr(kernels.FORWARD, "verdicts", {"cpu": True})
    assert not kernels.enabled("cpu"), "DYNATREE_KERNELS=0 switches them off"


@torch.inference_mode()
def test_with_the_kernels_a_layer_launches_the_fused_ops_in_place_of_the_torch_ones(gpu_forms):
    """The same forward (the GPU's forms, fixed shapes, bfloat16) counted without and with the kernels."""
    plain = forward_ops(_model("llama", torch.bfloat16), PROMPT, 3, invariant=True)[0]
    with kernels.kernel_forms("cpu", block_keys=128):
        fused = forward_ops(_model("llama", torch.bfloat16), PROMPT, 3, invariant=True)[0]
    layers = 2
    for name in ("attention_parts", "attention_merge", "rotate_", "silu_mul"):
        assert fused[name] == layers and plain[name] == 0, name
    for name in ("softmax", "bmm", "roll", "silu", "addcmul"):
        assert plain[name] >= layers and fused[name] == 0, name
    assert sum(fused.values()) <= sum(plain.values()) - 8 * layers, (sum(fused.values()), sum(plain.values()))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@torch.inference_mode()
def test_with_the_kernels_a_path_nodes_bits_are_those_ar_computes_alone(dtype, gpu_kernels):
    model = _model("llama", dtype)
    assert lean_forward_for(model).blocks[0].kernels, "the kernels are on"
    path = KVState(model, PROMPT, invariant=True, graphs=True).path
    assert path == "lean+kernels+invariant+padded", f"the fixed-shape attention (the kernel's) is not taken: {path}"
    assert gpu_check.path_bits_match(model, [*PROMPT, 17], graphs=True)


@torch.inference_mode()
def test_with_the_kernels_bfloat16_trees_are_token_identical_to_ar(gpu_kernels, monkeypatch):
    """Captured as on a GPU (stand-in graphs here: each replay runs the captured call)."""
    from test_graphs import _force_capture

    _force_capture(monkeypatch)
    target = _model("qwen2", torch.bfloat16)
    draft = copy.deepcopy(noisy_copy("qwen2", 0.01)).to(torch.bfloat16)
    assert lean_forward_for(target).blocks[0].kernels and lean_forward_for(draft).blocks[0].kernels
    config = DecodeConfig(max_new_tokens=12, forward=ForwardSettings(graphs=True))
    ar = generate(target, PROMPT, make_method("ar"), config=config)
    assert ar.forward_path == "lean+kernels+invariant+graphs"
    for name, params in (("fixed_tree", {"depth": 3, "branch": 2}), ("dynatree", {})):
        tree = generate(target, PROMPT, make_method(name, params), draft=draft, config=config)
        assert tree.token_ids == ar.token_ids, name
        assert tree.tokens_per_iteration > 1, name
