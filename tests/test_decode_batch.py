"""Batched one-pass draft data (training/answers/decode_batch.py): the decoded tokens and the features
kept while decoding equal what the stock HF model computes separately."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_greedy, tiny_model

from dynatree_core.errors import DynaTreeError
from dynatree_core.forward import capture
from dynatree_core.measure.launches import counting_waits
from dynatree_core.training.answers import decode_batch
from dynatree_core.training.answers.decode_batch import BatchDecoder
from dynatree_core.training.answers.decode_ops import sample_rows

LEAN_ARCHS = ("llama", "qwen2")
PROMPTS = [[5, 9, 14], [3, 7, 22, 41, 8, 2, 60], [11], [30, 31, 32, 33, 34]]


def hf_features(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()


@pytest.mark.parametrize("batch", [64, 2])  # 2: finished rows take the next prompts (continuous batching)
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_greedy_rows_equal_hf_greedy_and_features_equal_a_separate_forward(arch, batch):
    model = tiny_model(arch)
    limits = [9, 4, 12, 1]  # rows finish at different steps: refills, then the tail compacts
    rows = BatchDecoder(model, prefill_rows=3).generate(
        PROMPTS, max_new=limits, temperature=[0.0] * 4, eos=frozenset(), seed=0, batch=batch
    )
    for prompt, limit, row in zip(PROMPTS, limits, rows, strict=True):
        assert row.prompt_len == len(prompt)
        assert row.ids.tolist() == prompt + hf_greedy(model, prompt, limit), "batched greedy differs from HF greedy"
        assert row.features.shape == (len(row.ids) - 1, model.config.hidden_size)
        want = hf_features(model, row.ids.tolist())[:-1]
        # float16 storage: compare at its resolution
        np.testing.assert_allclose(row.features.astype(np.float64), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("span", [128, 4])  # 4: the span changes every few steps, older graphs released
def test_the_captured_step_decodes_what_the_eager_one_does(monkeypatch, span):
    """The step as a captured graph per span (stand-in graphs on the CPU: the captured function
    replayed over its own input buffers) gives HF's greedy rows and the eager path's features and
    teachers; the tail (after the first compaction) runs eagerly."""
    monkeypatch.setattr(capture, "STAND_IN_DEVICES", ("cpu",))
    monkeypatch.setattr(decode_batch, "SPAN", span)
    model = tiny_model("llama")
    limits = [9, 4, 12, 1]
    kw = dict(max_new=limits, temperature=[0.0] * 4, eos=frozenset(), seed=0, batch=2, teacher=True)
    before = capture.REPLAYS["step"]
    decoder = BatchDecoder(model, graphs=True)
    rows = decoder.generate(PROMPTS, **kw)
    assert capture.REPLAYS["step"] > before, "the whole batch's steps replay a captured graph"
    assert decoder.captured.endswith("graphs"), decoder.captured
    eager = BatchDecoder(model, graphs=False).generate(PROMPTS, **kw)
    for prompt, limit, row, ref in zip(PROMPTS, limits, rows, eager, strict=True):
        assert row.ids.tolist() == prompt + hf_greedy(model, prompt, limit)
        np.testing.assert_allclose(row.features.astype(np.float64), ref.features, rtol=2e-3, atol=2e-3)
        assert np.array_equal(row.teacher["ids"][:, 0], ref.teacher["ids"][:, 0])
        np.testing.assert_allclose(row.teacher["lse"], ref.teacher["lse"], rtol=1e-6)


def test_sampled_rows_draw_only_where_hot_and_keep_their_teacher():
    """Mixed temperatures in one batch: greedy rows equal HF greedy whatever the sampled rows do,
    and every row's teacher has one row per answer token."""
    model = tiny_model("qwen2")
    limits = [6, 6, 6, 6]
    rows = BatchDecoder(model).generate(
        PROMPTS, max_new=limits, temperature=[0.0, 1.0, 0.0, 1.0], eos=frozenset(), seed=3, batch=4, teacher=True
    )
    for i in (0, 2):
        assert rows[i].ids.tolist() == PROMPTS[i] + hf_greedy(model, PROMPTS[i], limits[i])
    k = min(32, model.config.vocab_size)
    for row in rows:
        assert row.teacher["ids"].shape == (len(row.ids) - row.prompt_len, k), "a teacher row per answer token"


def test_eos_ends_a_row_and_is_kept():
    model = tiny_model("llama")
    free = BatchDecoder(model).generate(PROMPTS[:2], max_new=[8, 8], temperature=[0.0, 0.0], eos=frozenset(), seed=0)
    stop = int(free[0].ids[len(PROMPTS[0]) + 2])  # the row's third answer token
    rows = BatchDecoder(model).generate(
        PROMPTS[:2], max_new=[8, 8], temperature=[0.0, 0.0], eos=frozenset({stop}), seed=0
    )
    first = rows[0].ids[len(PROMPTS[0]) :].tolist()
    assert first[-1] == stop and stop not in first[:-1], "the row must end at its first EOS, EOS kept"
    assert len(rows[0].features) == len(rows[0].ids) - 1


def test_teacher_forced_features_equal_hf():
    model = tiny_model("qwen2")
    seqs = [PROMPTS[1] + [4, 4, 9], PROMPTS[0]]
    for seq, row in zip(seqs, BatchDecoder(model).teacher_forced(seqs, taps=(0, 1)), strict=True):
        want = hf_features(model, seq)[:-1]
        np.testing.assert_allclose(row["features"].double().numpy(), want, rtol=2e-3, atol=2e-3)
        with torch.no_grad():
            hidden = model.base_model(input_ids=torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        for i in (0, 1):  # the tapped layer inputs (core/taps.py) come out of the same forward
            np.testing.assert_allclose(row["taps"][:, i].double().numpy(), hidden[i][0].double().numpy(), atol=1e-6)


def test_sampling_follows_temperature_and_is_seeded():
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0]] * 2000)
    temps = torch.tensor([0.0] * 1000 + [1.0] * 1000)
    a = sample_rows(logits, temps, torch.Generator().manual_seed(1))
    b = sample_rows(logits, temps, torch.Generator().manual_seed(1))
    assert torch.equal(a, b), "the same seed must give the same draws"
    assert (a[:1000] == 1).all(), "temperature 0 is greedy"
    share = (a[1000:] == 2).float().mean().item()
    assert 0.40 < share < 0.52, f"token 2 should be drawn ~47% of the time at temperature 1, got {share:.2f}"
    assert not (a[1000:] == 3).any(), "top-p 0.95 drops the improbable tail"


def test_non_llama_target_is_refused_clearly():
    with pytest.raises(DynaTreeError, match="Llama-family"):
        BatchDecoder(tiny_model("gpt2"))


@pytest.mark.parametrize("temperature", [[0.0] * 4, [0.0, 1.0, 0.0, 1.0]])
def test_decoding_never_waits_on_the_devices_values_beyond_its_explicit_reads(temperature):
    """The loop's only reads are its explicit copies (a step's sampled tokens, a refill's harvest):
    no op sizes its output by the device's values or reads a scalar (on a GPU each drains the
    queue), all-greedy batches included (whose sampling rows the host knows to be none)."""
    model = tiny_model("llama")
    with counting_waits() as waits:
        BatchDecoder(model).generate(PROMPTS, max_new=[9, 4, 12, 5], temperature=temperature, eos=frozenset(),
                                     seed=0, batch=2, teacher=True)  # fmt: skip
    assert waits.total == 0, dict(waits.sites)
