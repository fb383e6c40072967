"""oneDNN pre-packed linears (core/packing.py): same numbers as nn.Linear up to rounding, exact greedy
decoding through them, and load_pair packs on CPU unless told not to."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHS, noisy_copy, tiny_model

from dynatree_core.core.packing import PackedLinear, _packs, is_packed, pack_linears, packing_enabled
from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(dtype, tol, bias):
    if not _packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU (packing_enabled says no there)")
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    x = torch.randn(1, 9, 24, dtype=dtype)
    for inp in (x, x[:, 4:, :], x[0, :1]):  # 3-D, a non-contiguous slice (logits_to_keep), 2-D
        want = linear(inp)
        got = packed(inp)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(packed.weight, linear.weight.detach())  # the dense view reads back the weight
    clone = copy.deepcopy(packed)  # oneDNN tensors have no storage: __deepcopy__ rebuilds
    torch.testing.assert_close(clone(x), packed(x))


def test_a_dtype_onednn_cannot_pack_here_is_not_packed(monkeypatch):
    """Some CPUs with AVX512-BF16 lack what oneDNN's bfloat16 packing needs (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT): packing_enabled must say no there instead of load_pair raising."""
    assert packing_enabled(torch.device("cpu"), torch.bfloat16) == _packs(torch.bfloat16)

    def refuse(weight, _):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    _packs.cache_clear()
    try:
        assert not packing_enabled(torch.device("cpu"), torch.bfloat16)
    finally:
        monkeypatch.undo()
        _packs.cache_clear()


def _packed_f32(arch: str, model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model).to(torch.float32)  # never mutate the shared tiny models
    assert pack_linears(model) > 0  # GPT-2's Conv1D blocks stay as they are; its head is packed
    return model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy_name,params", [("dynatree", {}), ("fixed_tree", {"tau": 0.0}), ("linear", {"k": 4})])
def test_greedy_decoding_through_packed_models_is_exact(arch, policy_name, params):
    target = _packed_f32(arch, tiny_model(arch))
    draft = _packed_f32(arch, noisy_copy(arch, 0.01))
    plain = copy.deepcopy(tiny_model(arch)).to(torch.float32)
    config = DecodeConfig(max_new_tokens=24)
    for prompt in ([1, 5, 7, 9, 11], [42, 17, 8, 8, 8, 8, 60, 2]):
        ar = generate(target, prompt, make_method("ar"), config=config).token_ids
        assert ar == generate(plain, prompt, make_method("ar"), config=config).token_ids
        tree = generate(target, prompt, make_method(policy_name, params), draft=draft, config=config)
        assert tree.token_ids == ar, f"{policy_name} through packed linears diverged from AR"


def _bench_says_packed(tiny_pair_dirs, tmp_path) -> bool:
    """What a bench report's environment says of the pair it loaded (the number a reader trusts)."""
    import json

    from dynatree_core.cli import main

    out = tmp_path / "bench.json"
    code = main(["bench", "--target", tiny_pair_dirs[0], "--draft", tiny_pair_dirs[1], "--dtype", "float32",
                 "--policies", "ar", "--limit", "1", "--max-new-tokens", "2", "--repeats", "1",
                 "--out", str(out)])  # fmt: skip
    assert code == 0
    return json.loads(out.read_text())["environment"]["packed_linears"]


def test_load_pair_packs_on_cpu_unless_switched_off_and_reports_say_which(tiny_pair_dirs, monkeypatch, tmp_path):
    from dynatree_core.decoding.pairs import load_pair

    pair = load_pair(*tiny_pair_dirs, device="cpu", dtype="float32")
    assert is_packed(pair.target.model) and is_packed(pair.draft.model)
    assert isinstance(pair.target.model.lm_head, PackedLinear)
    assert _bench_says_packed(tiny_pair_dirs, tmp_path) is True
    assert not is_packed(load_pair(*tiny_pair_dirs, device="cpu", dtype="float32", pack=False).target.model)
    monkeypatch.setenv("DYNATREE_PACK", "0")
    assert not is_packed(load_pair(*tiny_pair_dirs, device="cpu", dtype="float32").target.model)
    assert _bench_says_packed(tiny_pair_dirs, tmp_path) is False


def test_decoding_with_a_packed_feature_draft_never_unpacks_a_weight(monkeypatch):
    """A packed layer's `.weight` is a dense copy made per read: decoding reads dtypes through
    packing.linear_dtype instead (every draft forward and pair of inputs once read fc.weight)."""
    from dynatree_core.drafts.feature import FeatureDraft

    target = copy.deepcopy(tiny_model("llama")).float()
    draft = FeatureDraft.from_target(target, None, seed=0).float()
    assert pack_linears(draft) > 0 and isinstance(draft.fc, PackedLinear)
    reads = []
    import traceback

    def weight(self):
        reads.append("".join(traceback.format_stack(limit=4)))
        return self.packed.to_dense()

    monkeypatch.setattr(PackedLinear, "weight", property(weight))
    for device_draft in (False, True):
        config = DecodeConfig(max_new_tokens=12, forward=ForwardSettings(device_draft=device_draft))
        generate(target, [1, 5, 7, 9], make_method("fixed_tree", {}), draft=draft, config=config)
        reads.clear()  # the first run builds the lean forward, which fuses weights once per model
        generate(target, [1, 5, 7, 9], make_method("fixed_tree", {}), draft=draft, config=config)
        assert reads == [], reads[0]
