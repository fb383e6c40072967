"""hf_static brings its own StaticCache, sized in buckets and kept per model, and warms each size once.

Given `cache_implementation="static"`, HF generate sizes the cache at prompt + max_new_tokens, so on
CUDA every prompt of a new length recompiled the decoding step inside the timed call (measured on
an H200: 28 tokens/s against 56 for eager generate). These tests run on CPU, where nothing compiles:
the warm-up branch is taken by declaring CPU a compiling device and counting generate calls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import hf_greedy, tiny_model
from transformers import StaticCache

from dynatree_core.decoding import baselines
from dynatree_core.decoding.baselines import STATIC_CACHE_BUCKET, STATIC_CACHES, static_cache_len
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method

N = 12
SHORT, LONG = [1, 5, 7, 9, 11], [42, 17, 8, 8, 8, 8, 60, 2, 90, 33, 12, 4, 7, 3, 21]


def _own_llama() -> torch.nn.Module:
    """A private copy of the tiny Llama: the caches hf_static keeps on it stay out of the shared one."""
    return copy.deepcopy(tiny_model("llama"))


def _static(model, prompt, n=N):
    return generate(model, prompt, make_method("hf_static"), config=DecodeConfig(max_new_tokens=n))


def _cache_for(model, prompt, n=N) -> StaticCache:
    weight = model.get_input_embeddings().weight
    return STATIC_CACHES[model][(static_cache_len(len(prompt), n), weight.dtype, str(weight.device))]


def test_cache_sizes_are_prompt_plus_new_rounded_up_to_the_bucket():
    assert STATIC_CACHE_BUCKET == 256
    assert static_cache_len(5, 12) == 256 and static_cache_len(100, 156) == 256
    assert static_cache_len(100, 157) == 512 and static_cache_len(1, 0) == 256


def test_hf_static_tokens_equal_hf_generate_and_our_ar_on_prompts_of_two_lengths():
    model = _own_llama()
    config = DecodeConfig(max_new_tokens=N)
    for prompt in (SHORT, LONG):
        static = _static(model, prompt)
        eager = generate(model, prompt, make_method("hf_generate"), config=config)
        ar = generate(model, prompt, make_method("ar"), config=config)
        assert static.token_ids == eager.token_ids == ar.token_ids == hf_greedy(model, prompt, N)
        cache = _cache_for(model, prompt)  # generate ran on our cache: it holds this prompt's tokens
        assert isinstance(cache, StaticCache) and cache.layers[0].max_cache_len == STATIC_CACHE_BUCKET
        assert int(cache.get_seq_length()) == len(prompt) + N - 1  # the last token is never fed back


def test_prompts_in_one_bucket_share_one_cache_and_a_longer_one_gets_another():
    model = _own_llama()
    long_prompt = list(range(1, 95)) * 3  # 282 tokens: prompt + N falls in the second bucket
    first = _static(model, SHORT)
    cache = _cache_for(model, SHORT)
    again = _static(model, LONG)
    assert _cache_for(model, LONG) is cache, "prompt + max_new in the same bucket: the same cache object"
    _static(model, long_prompt)
    other = _cache_for(model, long_prompt)
    assert other is not cache and other.layers[0].max_cache_len == 2 * STATIC_CACHE_BUCKET
    assert len(STATIC_CACHES[model]) == 2
    # the shared cache is emptied before each use: a rerun reads no stale prefix
    assert _static(model, SHORT).token_ids == first.token_ids == hf_greedy(model, SHORT, N)
    assert _static(model, LONG).token_ids == again.token_ids == hf_greedy(model, LONG, N)


def test_a_cache_never_serves_another_dtype_or_model():
    model = _own_llama()
    _static(model, SHORT)
    cache64 = _cache_for(model, SHORT)
    model.to(torch.float32)
    result = _static(model, SHORT)  # a float64 cache reused here would fail on its buffers' dtype
    assert _cache_for(model, SHORT) is not cache64 and len(STATIC_CACHES[model]) == 2
    assert result.token_ids == hf_greedy(model, SHORT, N) and result.dtype == "float32"
    other = _own_llama()
    assert other not in STATIC_CACHES, "caches live on the model they were made for"


def test_other_baselines_pass_no_cache_and_keep_none():
    model = _own_llama()
    for name in ("hf_generate", "hf_prompt_lookup"):
        method = make_method(name)
        kwargs = method.generate_kwargs_for(model, SHORT, None, DecodeConfig(max_new_tokens=N))
        assert "past_key_values" not in kwargs and kwargs == method.generate_kwargs(None)
        generate(model, SHORT, method, config=DecodeConfig(max_new_tokens=N))
    assert model not in STATIC_CACHES


def _count_generates(model, monkeypatch) -> list[dict]:
    """Record the keyword arguments of every generate call on `model` (the call still runs)."""
    calls: list[dict] = []
    real = model.generate

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", counting)
    return calls


def test_where_generate_compiles_each_cache_size_is_warmed_once_untimed(monkeypatch):
    model = _own_llama()
    monkeypatch.setattr(baselines, "AUTO_COMPILE_DEVICES", ("cuda", "xpu", "cpu"))
    reference = hf_greedy(model, SHORT, N)
    calls = _count_generates(model, monkeypatch)
    first = _static(model, SHORT)
    assert len(calls) == 2, "first use of the size: one warm-up generate, then the timed one"
    assert calls[0]["past_key_values"] is calls[1]["past_key_values"] is _cache_for(model, SHORT)
    assert first.iterations == N, "the warm-up's forwards are not counted in the timed run"
    assert first.forward_path == f"hf+static+compiled (cache {STATIC_CACHE_BUCKET} tokens, warmed per size)"
    assert first.token_ids == reference, "the cache is emptied after the warm-up"
    _static(model, LONG)  # same size: already warm
    assert len(calls) == 3
    _static(model, list(range(1, 95)) * 3)  # a new size: warmed once more
    assert len(calls) == 5


def test_where_generate_does_not_compile_there_is_no_warm_up(monkeypatch):
    model = _own_llama()
    calls = _count_generates(model, monkeypatch)
    result = _static(model, SHORT)
    assert len(calls) == 1 and "past_key_values" in calls[0]
    assert result.forward_path == "hf+static (not compiled: generate compiles on cuda / xpu only)"


def test_the_warm_up_and_the_cache_are_outside_the_timed_call(monkeypatch):
    """A slow warm-up (the compile it stands for) must not reach the run's wall time."""
    import time

    model = _own_llama()
    monkeypatch.setattr(baselines, "AUTO_COMPILE_DEVICES", ("cuda", "xpu", "cpu"))
    real = model.generate
    seen: list[int] = []

    def slow_first(*args, **kwargs):
        seen.append(1)
        if len(seen) == 1:
            time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", slow_first)
    result = _static(model, SHORT)
    assert len(seen) == 2 and result.wall_s < 1.0


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "qwen2"])
def test_hf_static_with_its_own_cache_is_exact_on_other_architectures(arch):
    model = copy.deepcopy(tiny_model(arch))
    for prompt in (SHORT, LONG):
        assert _static(model, prompt).token_ids == hf_greedy(model, prompt, N)
