"""Shared fixtures: tiny random models of several architectures, built in code (no downloads).

Models run in float64 so that a tree forward and a sequential forward agree to ~1e-15 and an
argmax can only differ through a logic error, never through a near-tie in rounding.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# Triton's kernels (forward/kernels.py) run here in its interpreter: read when Triton is first
# imported, which torch itself may do, so before torch
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# Property tests (hypothesis) are derandomized unless DYNATREE_FUZZ is set: a CI result depends on
# the code alone (a fixed search per test, no example database). `make fuzz` sets DYNATREE_FUZZ to
# the examples each property test draws (5,000 there), at random, with hypothesis's database, so a
# failure it finds is replayed first next time. docs/testing.md says which tests these are.
FUZZ_EXAMPLES = int(os.environ.get("DYNATREE_FUZZ", "0") or 0)
settings.register_profile(
    "deterministic", derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "fuzz", max_examples=max(FUZZ_EXAMPLES, 1), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("fuzz" if FUZZ_EXAMPLES else "deterministic")


def examples(n: int) -> settings:
    """A property test's settings: `n` examples in the deterministic profile, the fuzz profile's under `make fuzz`."""
    return settings(max_examples=FUZZ_EXAMPLES or n)


# The live page opens on a replay of a recorded run (assets/replay/) that plays for ~20 s; the
# app tests start from the form instead, and test_app.py turns the replay on where it is tested.
os.environ.setdefault("DYNATREE_REPLAY", "0")
# One test process keeps the sessions of many AppTests (their runs hold their pairs): room for every
# pair the suite loads (tests/test_pool.py tests the limit itself).
os.environ.setdefault("DYNATREE_MAX_PAIRS", "12")

VOCAB = 96
ARCHS = ("llama", "gpt_neox", "qwen2", "gpt2")


def _config(arch: str, **overrides):
    """(model class, config) of a tiny model; `overrides` replace the common config fields."""
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=None, pad_token_id=0) | overrides
    if arch == "llama":
        return LlamaForCausalLM, LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            **common,
        )
    if arch == "gpt_neox":
        return GPTNeoXForCausalLM, GPTNeoXConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            **common,
        )
    if arch == "qwen2":
        return Qwen2ForCausalLM, Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            **common,
        )
    if arch == "gpt2":
        return GPT2LMHeadModel, GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=512, **common)
    raise ValueError(arch)


_SHARED: list[tuple[str, torch.nn.Module]] = []  # every cached model, for the guard below


def _fingerprint(model: torch.nn.Module) -> tuple:
    """What a test must not change on a shared model: weights, dtype/device, mode, and any
    instance-level attribute patched onto it or its modules (a spy left behind)."""
    weights = tuple(float(p.detach().double().sum()) for p in model.parameters())
    first = next(model.parameters())
    patched = tuple(sorted(k for m in model.modules() for k in vars(m) if k in ("forward", "__call__", "generate")))
    return weights, first.dtype, str(first.device), model.training, patched


@pytest.fixture(autouse=True)
def _private_compute_ledger(tmp_path, monkeypatch):
    """Training stages append their measured time to the compute ledger in the user's cache, and a
    shipped draft's card sums it: a test's tiny stages go to a ledger of its own."""
    from dynatree_core.training import ledger

    monkeypatch.setattr(ledger, "ledger_path", lambda: tmp_path / "draft-runs" / "compute.jsonl")


@pytest.fixture(autouse=True)
def _shared_models_stay_unchanged():
    """The cached tiny models are shared by every test: one that mutates them (a leaked spy, an
    in-place weight change, a cast or a move) fails here, naming the model, instead of breaking
    the tests that run after it."""
    before = [(name, _fingerprint(model)) for name, model in _SHARED]
    yield
    changed = [
        name for (name, print_), (_, model) in zip(before, _SHARED, strict=False) if _fingerprint(model) != print_
    ]
    assert not changed, f"this test changed shared cached models: {changed} (copy.deepcopy them first)"


def build_tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A random tiny model with sharpened logits (scaled LM head) so drafts sometimes agree, built
    anew (tiny_model: the suite's shared copy)."""
    cls, cfg = _config(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float64).eval()
    with torch.no_grad():  # sharpen: random models are nearly uniform, real ones are not
        _final_norm(model).weight.mul_(6.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@functools.cache
def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """build_tiny_model's model, one copy shared by the suite (checked unchanged after each test)."""
    model = build_tiny_model(arch, seed)
    _SHARED.append((f"tiny_model({arch!r}, {seed})", model))
    return model


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    for path in ("model.norm", "gpt_neox.final_layer_norm", "transformer.ln_f"):
        module = model
        try:
            for part in path.split("."):
                module = getattr(module, part)
        except AttributeError:
            continue
        return module
    raise ValueError(f"no final norm found on {type(model).__name__}")


def build_noisy_copy(target: torch.nn.Module, arch: str, noise: float, seed: int = 1) -> torch.nn.Module:
    """`target` with Gaussian noise on every weight: a draft that agrees only part of the time."""
    cls, cfg = _config(arch)
    draft = cls(cfg).to(torch.float64).eval()
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise)
    return draft


@functools.cache
def noisy_copy(arch: str, noise: float, seed: int = 1) -> torch.nn.Module:
    """build_noisy_copy of the shared tiny_model, one copy shared by the suite."""
    draft = build_noisy_copy(tiny_model(arch), arch, noise, seed)
    _SHARED.append((f"noisy_copy({arch!r}, {noise}, {seed})", draft))
    return draft


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory) -> tuple[str, str]:
    """A tiny random Llama target and a noisy copy as its draft, saved with the embedded
    model's tokenizer (vocab 49152), so the app and CLI can load them like any local pair."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parent.parent / "assets/models/smollm2-draft")
    cls, cfg = _config(
        "llama", vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id
    )
    torch.manual_seed(0)
    target = cls(cfg).eval()
    draft = cls(cfg).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.002)
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        out = tmp_path_factory.mktemp(f"tiny-{name}")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        dirs.append(str(out))
    return dirs[0], dirs[1]


def pick_custom_pair(at, target: str, draft: str):
    """In an AppTest of any page with the model picker: choose "custom" and fill in the target and
    draft (the tiny local pair), then rerun."""
    next(s for s in at.selectbox if s.label == "Model pair").set_value("custom (hub id or local path)").run()
    next(t for t in at.text_input if t.label == "Target").set_value(target)
    next(t for t in at.text_input if t.label == "Draft").set_value(draft)
    return at.run()


@pytest.fixture
def gpu_forms():
    """The lean forward in the forms it takes on a GPU (one fused RMSNorm kernel, the target's
    projections fused, the residual adds inside their GEMMs: forward/fastpath.py), here by naming
    the CPU among those devices; a model must be new to the test (its lean forward is built once
    per model)."""
    from dynatree_core.forward.fastpath import device_forms

    with device_forms("cuda", on="cpu"):
        yield


@pytest.fixture
def gpu_kernels(gpu_forms):
    """The GPU's forms with Triton's kernels as well (forward/kernels.py: the rotation, silu * up and
    the fixed-shape attention), here in Triton's interpreter, its attention in blocks of 128 slots
    (the interpreter runs a program at a time: fewer, larger ones); a model must be new to the test."""
    from dynatree_core.forward.kernels import kernel_forms

    with kernel_forms("cpu", block_keys=128):
        yield


def ancestor_mask(tree, order: list[int]) -> torch.Tensor:
    """The reference for a tree's visibility: (n, n) bool, [i, j] when order[j] is order[i] or
    one of its ancestors, by walking each node's parents (forward/rows.py builds it from lineages)."""
    index = {node: i for i, node in enumerate(order)}
    mask = torch.zeros(len(order), len(order), dtype=torch.bool)
    for i, node in enumerate(order):
        while node >= 0:
            mask[i, index[node]] = True
            node = tree.parents[node]
    return mask


def tree_batch(tree, order: list[int], past: int, chain: list[int], root_pos: int, keep: int | None = None):
    """The verify batch of `tree` in `order` (root first) after `past` cached entries: the pending
    `chain` (the root's token last, at `root_pos`) then the tree's nodes; the logits of the last
    `keep` rows are kept (default: the root's and the nodes')."""
    from dynatree_core.forward.rows import Rows, lineage

    lines, n = lineage(tree.parent_rows(order)), len(chain)
    tokens, positions = [tree.tokens[v] for v in order[1:]], tree.position_ids(order[1:], root_pos)
    return Rows.tree(past, chain, root_pos - n + 1, tokens, positions, lines, keep=keep or len(order))
