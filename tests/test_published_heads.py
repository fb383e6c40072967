"""Published EAGLE heads (drafts/published.py): tiny checkpoints written in each published layout
(its own config keys and weight names, random weights, a tiny Llama target) load, their logits
equal a naive forward written here from the layout's definition, every tree policy drafts with
them exactly, a fused draft exported in the eagle3 layout loads back with the same logits and holds
only what SGLang's and vLLM's EAGLE-3 readers load (a draft they cannot compute is refused), and a
head that does not fit its target, or whose config or tensors disagree, is one clear error."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import hf_greedy
from safetensors.torch import save_file
from test_engine import POLICIES, PROMPTS

from dynatree_core.core.taps import eagle3_taps
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting import POLICIES as REGISTRY
from dynatree_core.drafts.fused import FusedDraft
from dynatree_core.drafts.heads import is_head_dir, load_head
from dynatree_core.drafts.published import export_eagle3, layout_of
from dynatree_core.errors import DynaTreeError

H, V, L, HEADS, KV, MLP_SIZE = 32, 96, 8, 4, 2, 64
DRAFTED = [(n, p) for n, p in POLICIES if n in REGISTRY and REGISTRY[n].needs_draft_model]
LAYOUTS = ("eagle1", "eagle3-safeailab", "eagle3-specforge", "eagle3-speculators")


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=MLP_SIZE, num_hidden_layers=L,
                         num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)  # sharpened, as conftest's tiny models
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _rand(*shape, scale=0.2):
    return torch.randn(*shape, dtype=torch.float32) * scale


def _layer(prefix: str, width: int, *, input_norm: bool = True, hidden_norm: bool = False) -> dict:
    w = {
        f"{prefix}self_attn.q_proj.weight": _rand(HEADS * 8, width),
        f"{prefix}self_attn.k_proj.weight": _rand(KV * 8, width),
        f"{prefix}self_attn.v_proj.weight": _rand(KV * 8, width),
        f"{prefix}self_attn.o_proj.weight": _rand(H, HEADS * 8),
        f"{prefix}mlp.gate_proj.weight": _rand(MLP_SIZE, H),
        f"{prefix}mlp.up_proj.weight": _rand(MLP_SIZE, H),
        f"{prefix}mlp.down_proj.weight": _rand(H, MLP_SIZE),
        f"{prefix}post_attention_layernorm.weight": 1 + _rand(H, scale=0.1),
    }
    if input_norm:
        w[f"{prefix}input_layernorm.weight"] = 1 + _rand(H, scale=0.1)
    if hidden_norm:
        w[f"{prefix}hidden_norm.weight"] = 1 + _rand(H, scale=0.1)
    return w


def _llama_fields() -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H, intermediate_size=MLP_SIZE,
                num_attention_heads=HEADS, num_key_value_heads=KV, num_hidden_layers=1, rms_norm_eps=1e-6,
                max_position_embeddings=512, vocab_size=V, rope_theta=10000.0, tie_word_embeddings=False)  # fmt: skip


def write_head(tmp_path, layout: str, target, draft_vocab: int = 40):
    """A random head in `layout`'s files; returns (directory, its weights, the taps it reads)."""
    torch.manual_seed(1)
    out = tmp_path / layout
    out.mkdir()
    embed = target.model.embed_tokens.weight.detach().float()
    used = torch.sort(torch.randperm(V)[:draft_vocab]).values
    if layout == "eagle1":
        w = _layer("layers.0.", H, input_norm=False) | {"fc.weight": _rand(H, 2 * H), "fc.bias": _rand(H)}
        w["embed_tokens.weight"] = embed.clone()
        torch.save(w, out / "pytorch_model.bin")
        (out / "config.json").write_text(json.dumps(_llama_fields() | {"bias": True}))
        return out, w, None
    prefix = "layers.0." if layout == "eagle3-speculators" else "midlayer."
    w = _layer(prefix, 2 * H, hidden_norm=True) | {"fc.weight": _rand(H, 3 * H), "norm.weight": 1 + _rand(H, scale=0.1)}
    w |= {"lm_head.weight": _rand(draft_vocab, H, scale=1.0), "d2t": used - torch.arange(draft_vocab)}
    w["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True)
    fields = _llama_fields() | {"draft_vocab_size": draft_vocab}
    taps = eagle3_taps(L)
    if layout == "eagle3-specforge":
        taps = (1, 4, 6)
        fields["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in taps]}
        w |= {f"fc_norm.{i}.weight": 1 + _rand(H, scale=0.1) for i in range(3)}
    if layout == "eagle3-speculators":
        taps = (2, 3, 5)
        fields = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": _llama_fields(), "draft_vocab_size": draft_vocab,
                  "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": list(taps)}  # fmt: skip
        w["embed_tokens.weight"] = embed.clone()
        w["input_norm.weight"] = 1 + _rand(3 * H, scale=0.1)
    if layout == "eagle3-safeailab":
        torch.save(w, out / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(fields))
    return out, w, taps


def _rms(x, weight, eps=1e-6):
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, positions, dim=8, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions[:, None].double() * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def naive_layer(w: dict, prefix: str, x_attn, resid, positions):
    """One Llama decoder layer as the layouts define it, causal over the rows (float64)."""
    g = lambda n: w[prefix + n].double()  # noqa: E731
    t = x_attn.shape[0]
    q = (x_attn @ g("self_attn.q_proj.weight").T).view(t, HEADS, 8).transpose(0, 1)
    k = (x_attn @ g("self_attn.k_proj.weight").T).view(t, KV, 8).transpose(0, 1)
    v = (x_attn @ g("self_attn.v_proj.weight").T).view(t, KV, 8).transpose(0, 1)
    q, k = _rope(q, positions), _rope(k, positions)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(8) + torch.full((t, t), -math.inf).triu(1)
    a = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(t, -1)
    h = resid + a @ g("self_attn.o_proj.weight").T
    m = _rms(h, g("post_attention_layernorm.weight"))
    mlp = (torch.nn.functional.silu(m @ g("mlp.gate_proj.weight").T) * (m @ g("mlp.up_proj.weight").T)) @ g(
        "mlp.down_proj.weight"
    ).T
    return h + mlp


def naive_logits(layout: str, w: dict, taps, target, ids: list[int]) -> torch.Tensor:
    """(n - 1, V) target-vocabulary logits of the head at level 1 over the pairs of `ids`: pair j
    reads the target's state(s) at j and the token j + 1 (-inf where the draft cannot propose)."""
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([ids[:-1]]), output_hidden_states=True)
    embed = w["embed_tokens.weight"].double() if "embed_tokens.weight" in w else target.model.embed_tokens.weight
    e = embed[torch.tensor(ids[1:])]
    positions = torch.arange(1, len(ids))
    if layout == "eagle1":
        f = out.last_hidden_state[0]
        x = torch.cat([e, f], -1) @ w["fc.weight"].double().T + w["fc.bias"].double()
        h = naive_layer(w, "layers.0.", x, x, positions)
        return h @ target.lm_head.weight.T
    states = [out.hidden_states[t][0] for t in taps]
    if "fc_norm.0.weight" in w:
        states = [_rms(s, w[f"fc_norm.{i}.weight"].double()) for i, s in enumerate(states)]
    cat = torch.cat(states, -1)
    if "input_norm.weight" in w:
        cat = _rms(cat, w["input_norm.weight"].double())
    prefix = "layers.0." if layout == "eagle3-speculators" else "midlayer."
    g = cat @ w["fc.weight"].double().T
    hidden = _rms(g, w[prefix + "hidden_norm.weight"].double())
    x = torch.cat([_rms(e, w[prefix + "input_layernorm.weight"].double()), hidden], -1)
    resid = hidden if layout == "eagle3-speculators" else g  # norm_before_residual
    h = naive_layer(w, prefix, x, resid, positions)
    draft_logits = _rms(h, w["norm.weight"].double()) @ w["lm_head.weight"].double().T
    full = torch.full((len(ids) - 1, V), -math.inf, dtype=torch.float64)
    full[:, torch.arange(len(w["d2t"])) + w["d2t"]] = draft_logits
    return full


def head_logits(draft, target, ids: list[int], vocab: int = V) -> torch.Tensor:
    """The loaded head's level-1 logits over the pairs of `ids`, through its drafting forward."""
    from dynatree_core.drafts.heads import make_drafter
    from dynatree_core.forward.kv import KVState
    from dynatree_core.forward.rows import Rows

    drafter = make_drafter(draft, [], vocab)
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([ids[:-1]]), output_hidden_states=True)
        taps = drafter.taps  # the final state alone (EAGLE-1) or layer inputs (EAGLE-3)
        final = out.last_hidden_state[0]
        feats = final if taps == (-1,) else torch.stack([out.hidden_states[t][0] for t in taps], 1)
        rows = drafter._pair_rows(torch.tensor(ids[1:]), feats, fused=True)
        n = len(ids) - 1
        kv = drafter.kv
        assert isinstance(kv, KVState)
        logits = kv.run(Rows.batch(0, ids[1:], 1, keep=n, embeds=rows)).logits
    return logits if draft.token_map is None else draft.token_map.to_target_logp(logits)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_published_layout_loads_and_its_logits_equal_a_naive_forward(tmp_path, target, layout):
    path, w, taps = write_head(tmp_path, layout, target)
    assert layout_of(path) == {"eagle1": "eagle1", "eagle3-speculators": "speculators"}.get(layout, "eagle3")
    assert is_head_dir(str(path))
    draft = load_head(str(path), target)
    assert draft.kind == ("feature" if layout == "eagle1" else "fused")
    if taps is not None:
        assert draft.taps == taps, "the layer ids are read in the layout's own convention"
    ids = [5, 17, 3, 44, 9, 60, 2, 31]
    want = naive_logits(layout, w, taps, target, ids)
    got = head_logits(draft, target, ids)
    if layout == "eagle1":
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    else:  # compare as log-probabilities over the draft's tokens (the engine's view)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), "the draft proposes exactly d2t's tokens"
        torch.testing.assert_close(got.double()[finite], torch.log_softmax(want, -1)[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy_name,params", DRAFTED)
def test_every_tree_policy_is_greedy_exact_with_each_published_layout(tmp_path, target, layout, policy_name, params):
    path, _, _ = write_head(tmp_path, layout, target)
    draft = load_head(str(path), target)
    for prompt in PROMPTS[:2]:
        result = generate(
            target, prompt, make_method(policy_name, params), draft=draft, config=DecodeConfig(max_new_tokens=16)
        )
        assert result.token_ids == hf_greedy(target, prompt, 16), f"{layout} {policy_name} diverged"


def test_a_fused_draft_exports_to_eagle3_and_loads_back_with_identical_logits(tmp_path, target):
    token_map = TokenMap([-1, *range(0, V, 3)], V)
    draft = FusedDraft.from_target(target, token_map, seed=3, fc_norm="none")
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))  # the export stores bfloat16: compare what survives it
    out = export_eagle3(draft, tmp_path / "eagle3", target_name="tiny")
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == list(draft.taps)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [t - 1 for t in draft.taps]
    assert layout_of(out) == "eagle3" and config["draft_vocab_size"] == len(token_map) - 1
    back = load_head(str(out), target)
    ids = [5, 17, 3, 44, 9, 60, 2, 31]
    torch.testing.assert_close(head_logits(back, target, ids), head_logits(draft, target, ids))


def test_fixed_tap_scales_are_folded_into_fc_and_the_export_loads_back_with_identical_logits(tmp_path, target):
    """fc_norm "scale" (a fixed factor a tap): the export has no such weight, fc's columns of tap i
    carry s_i instead, so both engines compute the draft as trained (powers of two: the fold is exact)."""
    token_map = TokenMap([-1, *range(0, V, 3)], V)
    draft = FusedDraft.from_target(target, token_map, seed=3, fc_norm="scale")
    with torch.no_grad():
        draft.tap_scale.copy_(torch.tensor([0.5, 4.0, 0.125]))
    out = export_eagle3(draft, tmp_path / "eagle3", target_name="tiny", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["dynatree"]["fc_norm"] == "none"
    back = load_head(str(out), target)
    assert back.fc_norm_kind == "none"
    ids = [5, 17, 3, 44, 9, 60, 2, 31]
    torch.testing.assert_close(head_logits(back, target, ids), head_logits(draft, target, ids), rtol=0, atol=0)
    plain = FusedDraft.from_target(target, token_map, seed=3, fc_norm="none")
    assert not torch.allclose(head_logits(plain, target, ids), head_logits(draft, target, ids)), "the scales count"


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda f: f.__setitem__("hidden_size", 64), "hidden size"),
        (lambda f: f.__setitem__("vocab_size", 200), "vocabulary"),
        (lambda f: f.__setitem__("eagle_config", {"eagle_aux_hidden_state_layer_ids": [1, 4, 40]}), "layers"),
        (lambda f: f.__setitem__("num_hidden_layers", 2), "one layer only"),
    ],
)
def test_a_head_that_does_not_fit_its_target_is_one_clear_error(tmp_path, target, change, needle):
    path, _, _ = write_head(tmp_path, "eagle3-specforge", target)
    fields = json.loads((path / "config.json").read_text())
    change(fields)
    (path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(DynaTreeError, match=needle):
        load_head(str(path), target)


def _rewrite(path, w: dict) -> None:
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))


def _drop(name):
    return lambda w: w.pop(name)


SF = "eagle3-specforge"


@pytest.mark.parametrize(
    "layout,fields,tensors,needle",
    [
        (SF, {"num_attention_heads": 5}, None, "hidden_size 32 is not a multiple of num_attention_heads 5"),
        (SF, {"num_key_value_heads": 3}, None, "num_attention_heads 4 is not a multiple of num_key_valu"),
        (SF, {"head_dim": 16}, None, "head_dim 16 is not hidden_size / num_attention_heads"),
        (SF, {"intermediate_size": "64"}, None, "intermediate_size is '64'; a positive whole number"),
        (SF, {"draft_vocab_size": 41}, None, "draft_vocab_size is 41 but lm_head.weight has 40 rows"),
        (SF, {"target_hidden_size": 64}, None, "target_hidden_size 64 differs from the head's"),
        ("eagle3-speculators", {"transformer_layer_config": _llama_fields() | {"num_attention_heads": 3}}, None,
         "hidden_size 32 is not a multiple of num_attention_heads 3"),
        ("eagle1", {"num_attention_heads": 6}, None, "hidden_size 32 is not a multiple of num_attention_heads 6"),
        (SF, None, _drop("lm_head.weight"), "no lm_head.weight"),
        (SF, None, lambda w: w.__setitem__("d2t", w["d2t"][:-1]), "d2t has shape (39,)"),
        (SF, None, lambda w: w["t2d"].fill_(True), "t2d marks 96 target tokens, not the 40"),
        (SF, None, _drop("midlayer.mlp.up_proj.weight"), "missing 1 (midlayer.mlp.up_proj.weight)"),
        (SF, None, lambda w: w.__setitem__("midlayer.extra.weight", torch.ones(H)),
         "unexpected 1 (midlayer.extra.weight)"),
        (SF, None, lambda w: w.__setitem__("norm.weight", torch.ones(H + 1)),
         "mis-shaped (file vs model) 1 (norm.weight (33,) vs (32,))"),
        (SF, None, _drop("fc_norm.2.weight"), "missing 1 (fc_norm.2.weight)"),
        ("eagle1", None, _drop("fc.bias"), "missing 1 (fc.bias)"),
        ("eagle1", None, lambda w: w.__setitem__("norm.weight", torch.ones(H)), "unexpected 1 (norm.weight)"),
    ],
)  # fmt: skip
def test_a_head_whose_config_or_tensors_disagree_is_one_line_naming_what(tmp_path, target, layout, fields, tensors,
                                                                         needle):  # fmt: skip
    """Checked before any module is made (no transformers traceback), and the weights load whole
    or not at all: a missing, extra or mis-shaped tensor is named, never left at its random init."""
    path, w, _ = write_head(tmp_path, layout, target)
    if fields is not None:
        (path / "config.json").write_text(json.dumps(json.loads((path / "config.json").read_text()) | fields))
    if tensors is not None:
        tensors(w)
        if layout == "eagle1":
            torch.save(w, path / "pytorch_model.bin")
        else:
            _rewrite(path, w)
    with pytest.raises(DynaTreeError) as caught:
        load_head(str(path), target)
    assert needle in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_an_inconsistent_head_is_one_error_line_in_the_cli(capsys, tiny_pair_dirs, tmp_path):
    from test_cli import run_cli

    from dynatree_core.core.models import load_model

    tiny = load_model(tiny_pair_dirs[0], device="cpu", dtype="float32").model
    vocab = tiny.config.vocab_size
    head = export_eagle3(FusedDraft.from_target(tiny, TokenMap([-1, *range(0, vocab, 5)], vocab), taps=(1, 1, 1),
                                                fc_norm="none"), tmp_path / "head")  # fmt: skip
    fields = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(fields | {"num_attention_heads": 5}))
    code, _, err = run_cli(capsys, "generate", "--target", tiny_pair_dirs[0], "--draft", str(head), "--prompt", "hi",
                           "--max-new-tokens", "4")  # fmt: skip
    lines = [line for line in err.splitlines() if line.startswith("error:")]  # (loading shows progress bars)
    assert code == 2 and len(lines) == 1 and err.splitlines()[-1] == lines[0] and "Traceback" not in err, err
    assert "not a multiple of num_attention_heads 5" in lines[0]


# What each engine's EAGLE-3 reader loads (docs/published-heads.md): its parameters, and
# the parameter a file's tensor name reaches (q/k/v stacked into qkv_proj, gate/up into gate_up_proj).
# SGLang's LlamaForCausalLMEagle3 skips a name it has no parameter for, silently; vLLM's
# Eagle3LlamaForCausalLM refuses it. Both skip t2d (the mask d2t already implies).
STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
           "up_proj": "gate_up_proj"}  # fmt: skip
LAYER_PARAMS = ("hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight")  # fmt: skip
OPTIONAL = {"model.embed_tokens.weight"}  # absent: the target's embedding (both engines)
SGLANG_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "hot_token_id", *OPTIONAL} | {
    f"model.midlayer.{n}" for n in LAYER_PARAMS
}
VLLM_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id", *OPTIONAL} | {
    f"model.layers.0.{n}" for n in LAYER_PARAMS
}


def _stacked(name: str) -> str:
    return ".".join(STACKED.get(part, part) for part in name.split("."))


def sglang_param(name: str) -> str | None:
    """llama_eagle3.py load_weights: d2t -> hot_token_id (d2t + arange), t2d skipped, `model.` prefix."""
    if name in ("d2t", "t2d"):
        return {"d2t": "hot_token_id"}.get(name)
    return _stacked(name if name.startswith("lm_head.") else f"model.{name}")


def vllm_param(name: str) -> str | None:
    """llama_eagle3.py load_weights: midlayer. -> layers.0., d2t -> draft_id_to_target_id, t2d skipped."""
    if name in ("d2t", "t2d"):
        return {"d2t": "draft_id_to_target_id"}.get(name)
    name = name.replace("midlayer.", "layers.0.", 1)
    return _stacked(name if name.startswith("lm_head.") else f"model.{name}")


def engine_reading(names, to_param, params: set[str]) -> tuple[list[str], set[str]]:
    """(tensors the engine has no parameter for, required parameters no tensor reaches)."""
    reached = {to_param(n) for n in names} - {None}
    unread = [n for n in names if to_param(n) is not None and to_param(n) not in params]
    return unread, params - OPTIONAL - reached


def test_the_eagle3_export_holds_what_sglang_and_vllm_read_and_nothing_else(tmp_path, target):
    from safetensors import safe_open

    token_map = TokenMap([-1, *range(0, V, 3)], V)
    draft = FusedDraft.from_target(target, token_map, taps=(1, 4, 6), seed=2, fc_norm="none")
    out = export_eagle3(draft, tmp_path / "eagle3")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for engine, to_param, params in (("SGLang", sglang_param, SGLANG_PARAMS), ("vLLM", vllm_param, VLLM_PARAMS)):
        unread, unset = engine_reading(list(tensors), to_param, params)
        assert not unread, f"{engine} has no place for {unread}"
        assert not unset, f"{engine} would leave {unset} unloaded"
    config = json.loads((out / "config.json").read_text())
    d, hd = len(token_map) - 1, config["head_dim"]
    assert config["hidden_size"] == H and hd * config["num_attention_heads"] == H and config["num_hidden_layers"] == 1
    assert tensors["fc.weight"].shape == (H, 3 * (config.get("target_hidden_size") or H))
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (config["num_attention_heads"] * hd, 2 * H)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (config["num_key_value_heads"] * hd, 2 * H)
    assert tensors["lm_head.weight"].shape == (config["draft_vocab_size"], H) and config["draft_vocab_size"] == d
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (d,)
    slots = torch.arange(d) + tensors["d2t"]  # both engines: target id = draft slot + d2t
    assert torch.equal(slots, token_map.draft_to_target[1:])
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (V,) and int(tensors["t2d"].sum()) == d
    # SGLang: the class by architectures, SGLang's layer ids, an untied own head, an fc without bias
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["tie_word_embeddings"] is False
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 3, 5], "use_aux_hidden_state": True}
    assert not config.get("bias", False) and "fc.bias" not in tensors
    # vLLM: its layer ids at the top level, the flat config's fields, rope_theta where older readers look
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6] and not config["norm_before_residual"]
    for key in ("num_key_value_heads", "intermediate_size", "hidden_act", "rms_norm_eps", "max_position_embeddings"):
        assert key in config, key
    assert config["vocab_size"] == V
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0


@pytest.mark.parametrize("fc_norm,needle", [("per_tap", "fc_norm per_tap"), ("concat", "fc_norm concat")])
def test_the_eagle3_export_refuses_a_draft_the_engines_would_compute_differently(tmp_path, target, fc_norm, needle):
    """Per-tap or joined tap norms: SGLang would drop their weights (serving another draft) and
    vLLM would refuse them; an RMS norm does not fold into fc. Refused, saying what exports."""
    draft = FusedDraft.from_target(target, TokenMap([-1, *range(0, V, 3)], V), taps=(1, 4, 6), fc_norm=fc_norm)
    unread, _ = engine_reading(list(draft.state_dict()), sglang_param, SGLANG_PARAMS)
    assert unread and all("norm" in n for n in unread), "the engines' readers have no place for these norms"
    with pytest.raises(DynaTreeError, match="--fc-norm none") as caught:
        export_eagle3(draft, tmp_path / "eagle3")
    assert needle in str(caught.value) and not (tmp_path / "eagle3").exists()


def test_export_feature_writes_a_fused_run_in_the_eagle3_layout(tmp_path, tiny_pair_dirs):
    from dynatree_core.core.models import load_model
    from dynatree_core.training.__main__ import main

    target = load_model(tiny_pair_dirs[0], device="cpu", dtype="float32").model
    vocab = target.config.vocab_size
    token_map = TokenMap([-1, *range(0, vocab, 7)], vocab)
    FusedDraft.from_target(target, token_map, taps=(1, 1, 1), seed=5, fc_norm="none").save(
        tmp_path / "run" / "draft", with_head=False
    )  # a frozen head is saved as "the target's rows" and rebuilt at load
    meta = json.loads((tmp_path / "run" / "draft" / "fused_draft.json").read_text())
    assert meta["head"] == "target rows"
    draft = load_head(str(tmp_path / "run" / "draft"), target)
    main(["export-feature", "--layout", "eagle3", "--target", tiny_pair_dirs[0], "--run", str(tmp_path / "run"),
          "--dest", str(tmp_path / "eagle3"), "--dtype", "float32"])  # fmt: skip
    assert layout_of(tmp_path / "eagle3") == "eagle3"
    assert json.loads((tmp_path / "eagle3" / "config.json").read_text())["torch_dtype"] == "float32"
    back = load_head(str(tmp_path / "eagle3"), target)
    assert back.taps == (1, 1, 1)
    ids = [5, 17, 3, 44, 9, 60, 2, 31]
    assert torch.equal(head_logits(back, target, ids, vocab), head_logits(draft, target, ids, vocab))
    with pytest.raises(SystemExit, match="--dest"):
        main(["export-feature", "--layout", "eagle3", "--target", tiny_pair_dirs[0], "--run", str(tmp_path / "run")])


def warm_hub_cache(monkeypatch, tmp_path, repo: str, files) -> None:
    """`files` (a directory) as the Hugging Face cache's snapshot of hub repo `repo`, with the hub
    unreachable (HF_HUB_OFFLINE): what a user who downloaded a head once has, offline."""
    import shutil

    import huggingface_hub.constants as hub

    cache, rev = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(files, repo_dir / "snapshots" / rev)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(rev)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_head_named_by_a_hub_id_loads_from_a_warm_cache_offline(tmp_path, target, monkeypatch):
    from dynatree_core.drafts.published import hub_head_dir

    path, _, _ = write_head(tmp_path, "eagle3-specforge", target)
    warm_hub_cache(monkeypatch, tmp_path, "someone/tiny-eagle3", path)
    cached = hub_head_dir("someone/tiny-eagle3")
    assert cached is not None and layout_of(cached) == "eagle3"
    ids = [5, 17, 3, 44, 9, 60]
    torch.testing.assert_close(head_logits(load_head(str(cached), target), target, ids),
                               head_logits(load_head(str(path), target), target, ids))  # fmt: skip
    assert hub_head_dir("someone/not-downloaded") is None, "not cached offline: the LM loader's clear error follows"
    assert hub_head_dir(str(path)) is None and hub_head_dir("embedded") is None, "paths and presets are not hub ids"
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "config.json").write_text(json.dumps(_llama_fields() | {"num_hidden_layers": 4}))
    warm_hub_cache(monkeypatch, tmp_path / "other", "someone/small-lm", lm)
    assert hub_head_dir("someone/small-lm") is None, "a standalone LM is not a head (no weights fetched for it)"


def test_load_pair_drafts_with_a_hub_id_head_and_a_missing_one_is_one_error(tmp_path, tiny_pair_dirs, monkeypatch):
    from dynatree_core.core.models import load_model
    from dynatree_core.decoding.pairs import load_pair

    tiny = load_model(tiny_pair_dirs[0], device="cpu", dtype="float32").model
    vocab = tiny.config.vocab_size
    token_map = TokenMap([-1, *range(0, vocab, 5)], vocab)
    export_eagle3(FusedDraft.from_target(tiny, token_map, taps=(1, 1, 1), fc_norm="none"), tmp_path / "export")
    warm_hub_cache(monkeypatch, tmp_path, "someone/tiny-pair-eagle3", tmp_path / "export")
    pair = load_pair(tiny_pair_dirs[0], "someone/tiny-pair-eagle3", device="cpu", dtype="float32")
    assert pair.draft.model.kind == "fused" and pair.draft.model.taps == (1, 1, 1)
    ids = pair.target.tokenizer("The quick brown fox")["input_ids"]
    out = generate(pair.target.model, ids, make_method("fixed_tree"), draft=pair.draft.model,
                   config=DecodeConfig(max_new_tokens=12))  # fmt: skip
    assert out.token_ids == hf_greedy(pair.target.model, ids, 12)
    with pytest.raises(DynaTreeError, match="not in the local HF cache"):
        load_pair(tiny_pair_dirs[0], "someone/never-downloaded", device="cpu", dtype="float32")


def test_the_presets_name_public_pairs_with_their_heads_and_say_they_need_network(capsys):
    from dynatree_core.cli import main
    from dynatree_core.core.presets import PRESETS
    from dynatree_core.decoding.pairs import token_draft_for

    heads = [p for p in PRESETS.values() if p.head and not p.offline]
    assert {p.draft.split("/")[0] for p in heads} >= {"yuhuili", "lmsys", "RedHatAI"}, "SafeAILab, SpecForge, vLLM"
    assert [p.name for p in PRESETS.values() if p.head and p.offline] == ["embedded-eagle3"], "the shipped fused draft"
    assert token_draft_for("embedded") == PRESETS["embedded-token"].draft, "the fused draft is not the assistant"
    assert token_draft_for("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.2-1B-Instruct", (
        "a head is never the HF baselines' assistant"
    )
    main(["presets"])
    lines = capsys.readouterr().out.splitlines()
    for p in PRESETS.values():
        line = next(x for x in lines if x.startswith(f"{p.name}:"))
        assert ("needs network" in line) == (not p.offline), line
        assert ("(head)" in line) == p.head, line
