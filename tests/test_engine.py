"""Greedy exactness and the engine's structural promises, on tiny random models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import ARCHS, ancestor_mask, hf_greedy, noisy_copy, tiny_model

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.core.tree import Status
from dynatree_core.decoding.engine import DecodeConfig, decode, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.errors import DynaTreeError

PROMPTS = ([1, 5, 7, 9, 11], [3], [42, 17, 8, 8, 8, 8, 60, 2, 90, 33, 12, 4])
POLICIES = (
    ("linear", {"k": 4}),
    ("fixed_tree", {}),
    ("fixed_tree", {"tau": 0.0, "branch": 3, "depth": 5, "budget": 24}),
    ("fixed_tree", {"tau": 0.1, "branch": 2, "depth": 8, "budget": 6}),
    ("dynatree", {}),
    ("dynatree", {"adaptive_branch": False, "dynamic_depth": False, "history": False, "budget": 12}),
    ("dyspec", {}),
    ("dyspec", {"budget": 7, "depth": 3}),
    ("dyspec_threshold", {"threshold": 0.01}),
    ("eagle2", {}),
    ("eagle2", {"total": 5, "topk": 2}),
    ("salf", {}),
    ("salf", {"th": 0.0, "nodes": 12, "batch": 3}),
    ("delayed", {}),
    ("delayed", {"k": 3, "l1": 0, "l2": 4}),
    ("delayed_auto", {"warmup": 1}),
    ("ngram", {}),
    ("ngram", {"max_n": 1, "branches": 5, "depth": 3}),
    ("recycle", {}),
    ("recycle", {"ranked": False, "k": 2, "depth": 3, "branch": 8, "budget": 5}),
    ("recycle", {"ranked": True, "depth": 5, "budget": 10}),
    ("suffix", {}),
    ("suffix", {"min_match": 1, "branches": 3, "depth": 4, "budget": 6}),
    ("joined_fixed_tree", {}),
    ("joined_dynatree", {}),
    ("fixed_tree", {"retrieved": 4, "recycled": 6, "budget": 8}),
    ("eagle2", {"recycled": 4}),
    ("salf", {"retrieved": 6}),
    ("dyspec", {"retrieved": 3, "recycled": 3}),
    ("delayed", {"recycled": 5}),
    ("hf_assisted", {}),
    ("hf_prompt_lookup", {}),
    ("hf_generate", {}),
    ("hf_static", {}),
)
DRAFTS = ("same", "noisy", "unrelated")


def draft_for(arch: str, kind: str) -> torch.nn.Module:
    if kind == "same":
        return tiny_model(arch)
    if kind == "noisy":
        return noisy_copy(arch, 0.01)
    return tiny_model(arch, seed=123)


@pytest.mark.parametrize("draft_kind", DRAFTS)
@pytest.mark.parametrize("policy_name,params", POLICIES)
def test_greedy_output_equals_target_greedy(arch, draft_kind, policy_name, params):
    target, draft = tiny_model(arch), draft_for(arch, draft_kind)
    for prompt in PROMPTS:
        reference = hf_greedy(target, prompt, 30)
        ar = generate(target, prompt, make_method("ar"), config=DecodeConfig(max_new_tokens=30))
        assert ar.token_ids == reference, "our AR loop must equal HF generate(do_sample=False)"
        result = generate(
            target, prompt, make_method(policy_name, params), draft=draft, config=DecodeConfig(max_new_tokens=30)
        )
        assert result.token_ids == reference, f"{policy_name} {params} diverged from target greedy"


@pytest.mark.parametrize("order", ["bfs", "dfs"])
def test_node_order_does_not_change_output(order):
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.01)
    ref = hf_greedy(target, PROMPTS[0], 25)
    result = generate(
        target,
        PROMPTS[0],
        make_method("fixed_tree", {"tau": 0.0}),
        draft=draft,
        config=DecodeConfig(max_new_tokens=25, order=order),
    )
    assert result.token_ids == ref


def _count_forwards(model: torch.nn.Module) -> tuple[list[int], object]:
    """Count the model's forwards with a hook on its rotary embedding, which both the stock HF
    forward and the lean forward (forward/fastpath.py) call exactly once per forward; models without
    one are counted at the model itself (they always take the HF forward)."""
    calls: list[int] = []
    base = getattr(model, "model", None)
    counted = base.rotary_emb if base is not None and hasattr(base, "rotary_emb") else model
    handle = counted.register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("policy_name,params", [("ar", {}), *POLICIES])
def test_exactly_one_target_forward_per_iteration(policy_name, params):
    target, draft = tiny_model("qwen2"), noisy_copy("qwen2", 0.01)
    calls, handle = _count_forwards(target)
    try:
        result = generate(
            target, PROMPTS[0], make_method(policy_name, params), draft=draft, config=DecodeConfig(max_new_tokens=30)
        )
    finally:
        handle.remove()
    assert len(calls) == result.iterations == result.target_forwards, "one target forward per iteration"


def test_draft_expands_one_level_per_forward():
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.01)
    calls, handle = _count_forwards(draft)
    try:
        records = list(
            decode(
                target,
                PROMPTS[0],
                make_method("fixed_tree", {"tau": 0.0, "branch": 3}),
                draft=draft,
                config=DecodeConfig(max_new_tokens=30),
            )
        )
    finally:
        handle.remove()
    for r in records:
        expanded_levels = {r.tree.depths[n] for n in range(len(r.tree)) if r.tree.status[n] == Status.KEPT}
        assert r.draft_forwards == len(expanded_levels), "one draft forward per expanded level"
    assert len(calls) == sum(r.draft_forwards for r in records)


def test_draft_cache_stays_in_sync_with_a_perfect_draft():
    """With draft == target, a linear chain of k is accepted in full every iteration; a draft
    cache out of sync (missing or stale KV) would show up as rejections."""
    target = tiny_model("gpt_neox")
    result = generate(
        target, PROMPTS[2], make_method("linear", {"k": 4}), draft=target, config=DecodeConfig(max_new_tokens=41)
    )
    assert [len(r.committed) for r in result.records] == [5] * 8 + [1]
    assert result.acceptance_rate == 1.0


def test_budget_is_never_exceeded():
    target, draft = tiny_model("llama"), tiny_model("llama")
    for budget in (1, 3, 7, 20):
        policy = make_method("fixed_tree", {"tau": 0.0, "branch": 4, "depth": 6, "budget": budget})
        for r in decode(target, PROMPTS[0], policy, draft=draft, config=DecodeConfig(max_new_tokens=20)):
            assert r.drafted <= budget
            assert len(r.order) == len(r.mask) == len(r.position_ids) == len(r.target_tokens)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 13])
def test_max_new_tokens_is_exact(n):
    target = tiny_model("llama")
    ref = hf_greedy(target, PROMPTS[0], n)
    for policy_name, params in POLICIES:
        result = generate(
            target, PROMPTS[0], make_method(policy_name, params), draft=target, config=DecodeConfig(max_new_tokens=n)
        )
        assert result.token_ids == ref and result.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("policy_name,params", POLICIES)
def test_eos_inside_the_tree_stops_generation(policy_name, params):
    target = tiny_model("qwen2")
    ref = hf_greedy(target, PROMPTS[0], 30)
    k = 9
    eos = ref[k]
    first = ref.index(eos)  # the first occurrence ends generation
    result = generate(
        target,
        PROMPTS[0],
        make_method(policy_name, params),
        draft=target,
        config=DecodeConfig(max_new_tokens=30, eos_token_ids=frozenset({eos})),
    )
    assert result.token_ids == ref[: first + 1]
    assert result.stop_reason == "eos"


def test_context_limit_ends_cleanly():
    target = tiny_model("llama")
    prompt = PROMPTS[0]
    ref = hf_greedy(target, prompt, 7)
    result = generate(
        target,
        prompt,
        make_method("fixed_tree", {"tau": 0.0}),
        draft=target,
        config=DecodeConfig(max_new_tokens=50, context_length=len(prompt) + 7),
    )
    assert result.token_ids == ref and result.stop_reason == "context_limit"


def test_bad_inputs_raise_clear_errors():
    target = tiny_model("llama")
    with pytest.raises(DynaTreeError, match="empty"):
        list(decode(target, [], make_method("ar")))
    with pytest.raises(DynaTreeError, match="context"):
        list(decode(target, list(range(20)), make_method("ar"), config=DecodeConfig(context_length=10)))
    with pytest.raises(DynaTreeError, match="needs a draft"):
        list(decode(target, [1, 2], make_method("linear")))


@pytest.mark.parametrize("arch_name", ARCHS)
def test_records_describe_what_the_target_saw(arch_name):
    target, draft = tiny_model(arch_name), noisy_copy(arch_name, 0.01)
    prompt = PROMPTS[0]
    committed = len(prompt)
    for r in decode(
        target, prompt, make_method("fixed_tree", {"tau": 0.0}), draft=draft, config=DecodeConfig(max_new_tokens=20)
    ):
        assert r.prefix_len == committed - 1, "the root sits at the last committed position"
        assert r.position_ids == [r.prefix_len + r.tree.depths[n] for n in r.order]
        assert torch.equal(r.mask_matrix(), ancestor_mask(r.tree, r.order))
        path_tokens = [r.tree.tokens[n] for n in r.accepted]
        assert r.committed[: len(path_tokens)] == path_tokens
        committed += len(r.committed)


def test_reduced_vocabulary_draft_stays_exact_and_agrees():
    """A draft over a token subset (core/vocab.py) maps ids in and log-probs out; output stays exact,
    and with the target's own weights restricted to the subset it still gets accepted."""
    from dynatree_core.core.vocab import TokenMap

    target = tiny_model("llama")
    subset = list(range(0, 96, 2)) + [1, 3, 5]  # half the vocabulary
    token_map = TokenMap([-1, *subset], 96)
    cls, cfg = type(target), type(target.config).from_dict({**target.config.to_dict(), "vocab_size": len(token_map)})
    draft = cls(cfg).to(torch.float64).eval()
    state = target.state_dict()
    rows = torch.tensor([0, *subset])  # OTHER reuses token 0's row; it is masked out anyway
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][rows]
    state["lm_head.weight"] = state["lm_head.weight"][rows]
    draft.load_state_dict(state)
    for prompt in PROMPTS:
        ref = hf_greedy(target, prompt, 30)
        result = generate(
            target,
            prompt,
            make_method("fixed_tree", {"tau": 0.0}),
            draft=draft,
            config=DecodeConfig(max_new_tokens=30),
            draft_token_map=token_map,
        )
        assert result.token_ids == ref
        for r in result.records:
            assert all(r.tree.tokens[n] in set(subset) for n in range(1, len(r.tree))), "only subset tokens drafted"
    assert result.mean_accepted_length > 0.3, "the restricted target should often agree with itself"


def test_cpu_memory_counts_weights_and_the_largest_caches():
    from dynatree_core.forward.kv import SLACK
    from dynatree_core.runs.metrics import kv_bytes_per_token, weight_bytes

    target, draft = tiny_model("llama"), noisy_copy("llama", 0.01)
    prompt, n = PROMPTS[0], 20
    config = DecodeConfig(max_new_tokens=n, forward=ForwardSettings(static_cache=False))
    ar = generate(target, prompt, make_method("ar"), config=config)
    # Expected sizes from the tiny Llama's config by hand (conftest._config: hidden 32, MLP 64,
    # 2 layers, 4 query / 2 key-value heads of 8, vocabulary 96, untied head, float64), not from
    # the helpers under test: K and V x 2 layers x 2 kv heads x 8 dims x 8 bytes.
    per_token = 2 * 2 * 2 * 8 * 8
    layer = 32 * 32 * 2 + 32 * (2 * 8) * 2 + 32 * 64 * 3 + 2 * 32  # q, o; k, v (GQA); gate, up, down; norms
    params = 96 * 32 * 2 + 2 * layer + 32  # embedding, head, layers, final norm
    rotary = 2 * 4  # inv_freq and original_inv_freq: head_dim / 2 each
    assert kv_bytes_per_token(target) == per_token
    assert weight_bytes(target) == (params + rotary) * 8
    # AR's concatenated cache peaks at prompt + n - 1 tokens (the last token is never fed back)
    assert ar.peak_memory_mb == pytest.approx((weight_bytes(target) + per_token * (len(prompt) + n - 1)) / 2**20)
    hf = generate(target, prompt, make_method("hf_generate"), config=config)
    assert hf.peak_memory_mb == pytest.approx(ar.peak_memory_mb)  # the config-sized estimate agrees
    # the static cache holds its whole buffer from the first forward: prompt + n + slack slots
    static = generate(
        target,
        prompt,
        make_method("ar"),
        config=dataclasses.replace(config, forward=dataclasses.replace(config.forward, static_cache=True)),
    )
    buffer = per_token * (len(prompt) + n + SLACK)
    assert static.peak_memory_mb == pytest.approx((weight_bytes(target) + buffer) / 2**20)
    tree = generate(target, prompt, make_method("fixed_tree", {"tau": 0.0}), draft=draft, config=config)
    biggest = max(len(r.order) - 1 + r.chain_len for r in tree.records)  # nodes + pending in one forward
    assert tree.peak_memory_mb >= (weight_bytes(target) + weight_bytes(draft) + per_token * biggest) / 2**20
    assert tree.peak_memory_mb > ar.peak_memory_mb


def test_the_static_cache_reference_says_whether_generate_compiled_it():
    """hf_static is what a user who wants speed calls: generate compiles it on CUDA only, and its
    forward path says which happened (a CPU run must not claim a compiled reference)."""
    target, prompt = tiny_model("llama"), [1, 5, 7, 9, 11]
    config = DecodeConfig(max_new_tokens=12)
    static = generate(target, prompt, make_method("hf_static"), config=config)
    assert static.token_ids == hf_greedy(target, prompt, 12)
    device = target.get_input_embeddings().weight.device
    on_cpu = "hf+static (not compiled: generate compiles on cuda / xpu only)"
    if device.type in ("cuda", "xpu"):
        assert static.forward_path.startswith("hf+static+compiled (cache ")
    else:
        assert static.forward_path == on_cpu
