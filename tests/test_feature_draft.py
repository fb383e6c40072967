"""The feature-level draft (drafts/feature.py): exact with every policy, fed the target's own
features from the verification forward, its cache equal to a recomputation, saved and loaded."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, hf_greedy, tiny_model
from test_engine import POLICIES, PROMPTS

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.core.tree import Reason, Status
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.engine import DecodeConfig, decode, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting import POLICIES as REGISTRY
from dynatree_core.drafts.feature import FeatureDraft, FeatureDrafter
from dynatree_core.errors import DynaTreeError

PATHS = {
    "lean": ForwardSettings(),
    "static": ForwardSettings(fast_forward=False),
    "dynamic": ForwardSettings(static_cache=False),
}


def feature_draft(arch: str, seed: int = 0, token_map: TokenMap | None = None) -> FeatureDraft:
    return FeatureDraft.from_target(tiny_model(arch), token_map, seed=seed)


DRAFTED = [(n, p) for n, p in POLICIES if n in REGISTRY and REGISTRY[n].needs_draft_model]


@pytest.mark.parametrize("policy_name,params", DRAFTED)
def test_greedy_output_equals_target_greedy_with_a_feature_draft(arch, policy_name, params):
    target, draft = tiny_model(arch), feature_draft(arch)
    for prompt in PROMPTS:
        result = generate(
            target, prompt, make_method(policy_name, params), draft=draft, config=DecodeConfig(max_new_tokens=30)
        )
        assert result.token_ids == hf_greedy(target, prompt, 30), f"{policy_name} {params} diverged"


@pytest.mark.parametrize("path", PATHS)
def test_a_reduced_vocabulary_feature_draft_is_exact_on_every_forward_path(path):
    target = tiny_model("llama")
    token_map = TokenMap([-1, *range(0, 96, 2)], 96)  # half the vocabulary: odd ids are never proposed
    draft = feature_draft("llama", token_map=token_map)
    config = DecodeConfig(max_new_tokens=30, forward=PATHS[path])
    for prompt in PROMPTS:
        result = generate(target, prompt, make_method("fixed_tree"), draft=draft, config=config)
        assert result.token_ids == hf_greedy(target, prompt, 30)
        assert all(tok % 2 == 0 for r in result.records for tok in r.tree.tokens[1:]), "an unmapped id was drafted"


def _record_pairs(monkeypatch) -> list[tuple[torch.Tensor, list[int]]]:
    pairs: list[tuple[torch.Tensor, list[int]]] = []
    original = FeatureDrafter.add_features

    def spy(self, features, tokens):
        pairs.append((features.clone(), list(tokens)))
        return original(self, features, tokens)

    monkeypatch.setattr(FeatureDrafter, "add_features", spy)
    return pairs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch_name", ARCHS)
def test_the_features_handed_over_equal_a_separate_forward(arch_name, path, monkeypatch):
    """The drafter receives, for every committed token after the first, the target's final hidden
    state at the position before it, taken from the verification forwards: the same vectors a
    separate forward over the whole committed sequence computes."""
    pairs = _record_pairs(monkeypatch)
    target, draft = tiny_model(arch_name), feature_draft(arch_name)
    prompt = PROMPTS[2]
    config = DecodeConfig(max_new_tokens=25, forward=PATHS[path])
    result = generate(target, prompt, make_method("fixed_tree", {"tau": 0.0, "branch": 2}), draft=draft, config=config)
    sequence = prompt + result.token_ids
    tokens = [t for _, toks in pairs for t in toks]
    features = torch.cat([f for f, _ in pairs])
    assert tokens == sequence[1 : 1 + len(tokens)] and len(tokens) == len(sequence) - 1
    with torch.no_grad():
        expected = target.base_model(input_ids=torch.tensor([sequence[:-1]])).last_hidden_state[0]
    torch.testing.assert_close(features, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("path", PATHS)
def test_the_draft_cache_equals_a_recomputation(path, monkeypatch):
    """Each root expansion reads the confirmed pairs through the draft's compacted cache; a fresh
    causal forward over all the pairs so far must give the same distribution."""
    pairs = _record_pairs(monkeypatch)
    roots: list[tuple[int, torch.Tensor]] = []
    original = FeatureDrafter._root  # the root's forward, whichever way the tree is drafted

    def spy(self, then):
        out = original(self, then)
        roots.append((sum(len(t) for _, t in pairs), self.to_logp(out[0]).clone()))
        return out

    monkeypatch.setattr(FeatureDrafter, "_root", spy)
    target, draft = tiny_model("llama"), feature_draft("llama", seed=3)
    generate(
        target,
        PROMPTS[0],
        make_method("dynatree", {"budget": 10}),
        draft=draft,
        config=DecodeConfig(max_new_tokens=30, forward=PATHS[path]),
    )
    assert len(roots) > 3
    tokens = torch.tensor([t for _, toks in pairs for t in toks])
    features = torch.cat([f for f, _ in pairs])
    for n, logp in roots:
        with torch.no_grad():
            embeds = draft.inputs(tokens[:n], features[:n])[None]
            logits = draft.lm(inputs_embeds=embeds, position_ids=torch.arange(1, n + 1)[None]).logits[0, -1]
        torch.testing.assert_close(logp[0], torch.log_softmax(logits.float(), -1), rtol=1e-7, atol=1e-7)


def test_the_first_iteration_is_the_prefill_and_later_ones_draft():
    target, draft = tiny_model("qwen2"), feature_draft("qwen2")
    records = list(
        decode(target, PROMPTS[2], make_method("fixed_tree"), draft=draft, config=DecodeConfig(max_new_tokens=20))
    )
    first = records[0]
    assert len(first.tree) == 1 and first.tree.reason[0] == Reason.NO_FEATURES.value and first.draft_forwards == 0
    assert len(first.committed) == 1
    assert all(r.draft_forwards >= 1 and len(r.tree) > 1 for r in records[1:-1]), "later iterations must draft"


def test_one_target_forward_per_iteration_and_one_draft_forward_per_level():
    """Counted on the HF path (the lean path calls no modules): the target's base model runs once
    per iteration, hidden states included; the draft's once per expanded level."""
    target, draft = tiny_model("llama"), feature_draft("llama")
    target_calls, draft_calls = [], []
    hooks = [
        target.base_model.register_forward_hook(lambda *a: target_calls.append(1)),
        draft.lm.model.register_forward_hook(lambda *a: draft_calls.append(1)),
    ]
    try:
        records = list(
            decode(
                target,
                PROMPTS[0],
                make_method("fixed_tree", {"tau": 0.0, "branch": 2}),
                draft=draft,
                config=DecodeConfig(max_new_tokens=30, forward=ForwardSettings(static_cache=False)),
            )
        )
    finally:
        for h in hooks:
            h.remove()
    assert len(target_calls) == len(records)
    assert len(draft_calls) == sum(r.draft_forwards for r in records) > len(records)
    levels = [len({r.tree.depths[n] for n in range(len(r.tree)) if r.tree.status[n] == Status.KEPT}) for r in records]
    assert [r.draft_forwards for r in records] == levels


def test_saved_and_loaded_draft_drafts_the_same(tmp_path):
    target = tiny_model("llama")
    token_map = TokenMap([-1, *range(1, 96, 3)], 96)
    draft = feature_draft("llama", seed=5, token_map=token_map)
    draft.save(tmp_path)
    loaded = FeatureDraft.load(tmp_path, target)
    config = DecodeConfig(max_new_tokens=20)
    a = generate(target, PROMPTS[0], make_method("dynatree"), draft=draft, config=config)
    b = generate(target, PROMPTS[0], make_method("dynatree"), draft=loaded, config=config)
    assert [r.tree.tokens for r in a.records] == [r.tree.tokens for r in b.records]
    with pytest.raises(DynaTreeError, match="feature draft"):
        FeatureDraft.load(tmp_path / "missing", target)
    with pytest.raises(DynaTreeError, match="width"):
        from transformers import LlamaConfig, LlamaForCausalLM

        wider = LlamaForCausalLM(
            LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=96)
        )
        FeatureDraft.load(tmp_path, wider)


@pytest.mark.parametrize("kind", ["feature", "fused"])
@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda w, k: w.pop(k), "missing 1 ({k})"),
        (lambda w, k: w.__setitem__(k.replace("weight", "extra"), w[k].clone()), "unexpected 1 ({x})"),
        (lambda w, k: w.__setitem__(k, w[k][:-1]), "mis-shaped (file vs model) 1 ({k} "),
    ],
    ids=["missing", "unexpected", "mis-shaped"],
)
def test_a_saved_draft_loads_whole_or_is_one_error_naming_the_tensor(tmp_path, kind, change, needle):
    """A tensor missing from a saved draft, one too many or one of another shape: one DynaTreeError
    naming it, never a draft that keeps a random tensor (the loaders are strict)."""
    from safetensors.torch import load_file, save_file

    from dynatree_core.drafts.fused import FusedDraft
    from dynatree_core.drafts.heads import load_head

    target, token_map = tiny_model("llama"), TokenMap([-1, *range(1, 96, 3)], 96)
    if kind == "fused":
        FusedDraft.from_target(target, token_map, taps=(1, 1, 1)).save(tmp_path)
        name, weights = "midlayer.post_attention_layernorm.weight", tmp_path / "fused_draft.safetensors"
    else:
        FeatureDraft.from_target(target, token_map).save(tmp_path)
        name, weights = "lm.model.layers.0.post_attention_layernorm.weight", tmp_path / "feature_draft.safetensors"
    load_head(str(tmp_path), target)  # whole: loads
    state = load_file(str(weights))
    change(state, name)
    save_file(state, str(weights))
    with pytest.raises(DynaTreeError) as caught:
        load_head(str(tmp_path), target)
    message = str(caught.value)
    assert needle.format(k=name, x=name.replace("weight", "extra")) in message and str(tmp_path) in message, message
    assert "\n" not in message


def test_hf_assisted_refuses_a_feature_draft():
    target, draft = tiny_model("llama"), feature_draft("llama")
    with pytest.raises(DynaTreeError, match="feature draft"):
        generate(target, PROMPTS[0], make_method("hf_assisted"), draft=draft, config=DecodeConfig(max_new_tokens=4))


def test_a_saved_feature_draft_loads_as_a_pair_runs_exact_and_says_its_kind(tiny_pair_dirs, tmp_path):
    """load_pair attaches a feature-draft directory to the target (packed on CPU); runs report
    draft_kind, and the engine (the live page) says which kind it loaded."""
    from dynatree_core.core.packing import is_packed
    from dynatree_core.decoding.pairs import load_pair
    from dynatree_core.live.engine import Engine, PairSpec

    target_dir = tiny_pair_dirs[0]
    base = load_pair(target_dir, need_draft=False, pack=False)
    FeatureDraft.from_target(base.target.model, TokenMap([-1, *range(0, 4000)], 49152), seed=1).save(tmp_path)
    pair = load_pair(target_dir, str(tmp_path))
    assert isinstance(pair.draft.model, FeatureDraft) and is_packed(pair.draft.model)
    config = DecodeConfig(max_new_tokens=16, eos_token_ids=pair.target.eos_token_ids)
    prompt = [1, 17, 4, 99, 250, 7]
    ar = generate(pair.target.model, prompt, make_method("ar"), config=config)
    run = generate(pair.target.model, prompt, make_method("dynatree"), draft=pair.draft.model, config=config)
    assert run.token_ids == ar.token_ids and run.draft_kind == "feature" and ar.draft_kind == ""
    token_run = generate(pair.target.model, prompt, make_method("linear"), draft=pair.target.model, config=config)
    assert token_run.draft_kind == "token"
    engine = Engine(PairSpec(target_dir, str(tmp_path)))
    try:
        assert engine.wait_ready(300).draft_kind == "feature"
    finally:
        engine.close()
