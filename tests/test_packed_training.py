"""The cheap training step (training/packed/data.py, step.py, train.py) and the fused-feature draft (drafts/fused.py):
packed rows compute what separate windows compute, the query-side shortcut changes nothing, the
compact teacher is the target's distribution, the fused draft is exact with every policy and its
training forward is its drafting forward, and a stopped long run resumes the same schedule."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import hf_greedy, tiny_model
from test_answers import _pool
from test_engine import POLICIES, PROMPTS

from dynatree_core.core.models import load_model
from dynatree_core.core.taps import FINAL, eagle3_taps
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting import POLICIES as REGISTRY
from dynatree_core.drafts.feature import FeatureDraft
from dynatree_core.drafts.fused import FusedDraft
from dynatree_core.errors import DynaTreeError
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows
from dynatree_core.measure.launches import counting_waits
from dynatree_core.training.answers import store as answers
from dynatree_core.training.feature.depth import depth_mask, unrolled_predictions
from dynatree_core.training.packed.data import PackedAnswers, PackedBatch, level_mask, pack_rows, prefetch
from dynatree_core.training.packed.step import (
    PackedTrainConfig,
    packed_loss,
    plan_step,
    root_ok,
    soft_ce,
    unrolled_outputs,
)
from dynatree_core.training.packed.train import train_packed

TAPS = (0, 1, FINAL)  # the tiny targets have 2 layers: both layer inputs and the final state
DRAFTED = [(n, p) for n, p in POLICIES if n in REGISTRY and REGISTRY[n].needs_draft_model]


def _full_map(vocab: int = 96) -> TokenMap:
    return TokenMap([-1, *range(vocab)], vocab)


def _packed(windows, hidden: int, *, taps: int = 0, row: int = 12) -> PackedBatch:
    """Windows (ids (n,), states (n, [taps,] H)) packed in order into rows of `row` pair slots."""
    shape = (1, row, taps, hidden) if taps else (1, row, hidden)
    tokens, positions = torch.zeros(1, row, dtype=torch.long), torch.zeros(1, row, dtype=torch.long)
    inputs, seg = torch.zeros(shape, dtype=torch.float64), torch.full((1, row), -1)
    at = 0
    for s, (x, f) in enumerate(windows):
        n = len(x) - 1
        tokens[0, at : at + n], inputs[0, at : at + n] = x[1:], f[:-1]
        positions[0, at : at + n], seg[0, at : at + n] = torch.arange(1, n + 1), s
        at += n
    real = seg >= 0
    return PackedBatch(tokens, inputs, None, positions, seg, real, real, None, None, int(real.sum()))


def test_first_fit_decreasing_never_overflows_a_row_and_keeps_every_window():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(1, 513, size=int(rng.integers(1, 40))).tolist()
        rows = pack_rows(lengths, 512)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in r) <= 512 for r in rows)
        assert len(rows) <= max(1, -(-2 * sum(lengths) // 512)), "FFD uses at most about twice the optimum"


@pytest.mark.parametrize("level", [1, 2, 3])
def test_each_window_of_a_packed_row_gets_the_depth_mask_it_would_get_alone(level):
    seg = torch.tensor([[0] * 6 + [1] * 4 + [-1] * 2])
    mask = level_mask(seg, level)
    alone = depth_mask(level, 6, torch.ones(1, 6, dtype=torch.bool))[:, :, (level - 1) * 6 :]
    first = torch.cat([mask[:, :, :6, m * 12 : m * 12 + 6] for m in range(level)], -1)
    assert torch.equal(first, alone)
    blocked = torch.finfo(torch.float32).min
    assert (mask[0, 0, 6:10][:, [m * 12 + j for m in range(level) for j in range(6)]] == blocked).all(), (
        "no window sees another"
    )


@pytest.mark.parametrize("level", [1, 3])
def test_the_level_mask_is_built_on_the_windows_device(level):
    """No host tensor in the build (a step on a GPU would build it on the host and copy it over):
    on the meta device any host tensor mixed in raises."""
    seg = torch.tensor([[0] * 6 + [1] * 4 + [-1] * 2])
    mask = level_mask(seg.to("meta"), level)
    assert mask.device.type == "meta" and mask.shape == level_mask(seg, level).shape


def _two_windows(hidden: int, taps: int = 0):
    gen = torch.Generator().manual_seed(3)
    shape = lambda n: (n, taps, hidden) if taps else (n, hidden)  # noqa: E731
    return [
        (torch.randint(0, 96, (n,), generator=gen), torch.randn(shape(n), dtype=torch.float64, generator=gen))
        for n in (7, 5)
    ]


def test_packed_levels_equal_the_unrolled_predictions_of_each_window_alone():
    draft = FeatureDraft.from_target(tiny_model("llama"), _full_map()).double()
    windows = _two_windows(32)
    with torch.no_grad():
        outs = unrolled_outputs(draft, _packed(windows, 32), 3)
        at = 0
        for x, f in windows:
            n = len(x) - 1
            alone = unrolled_predictions(draft, x[None], f[None], torch.ones(1, n + 1, dtype=torch.bool), steps=3)
            for level in range(3):  # rows whose chain starts inside the window
                torch.testing.assert_close(outs[level][0, at + level : at + n], alone[level][0, level:n])
            at += n


@pytest.mark.parametrize("kind", ["feature", "fused"])
def test_computing_only_what_the_last_level_needs_changes_no_output(kind):
    target = tiny_model("llama")
    if kind == "fused":
        draft, batch = (
            FusedDraft.from_target(target, _full_map(), taps=TAPS).double(),
            _packed(_two_windows(32, 3), 32, taps=3),
        )
    else:
        draft, batch = FeatureDraft.from_target(target, _full_map()).double(), _packed(_two_windows(32), 32)
    last = torch.zeros(1, 12, dtype=torch.bool)
    last[0, [2, 4, 5, 8, 9]] = True
    with torch.no_grad():
        full = unrolled_outputs(draft, batch, 3)
        part, valid = unrolled_outputs(draft, batch, 3, last=last)[-1]
    torch.testing.assert_close(part[valid], full[2][last])


def test_the_fused_training_forward_is_its_drafting_forward():
    """Level 1 over a window's pairs equals the drafter's forward (own_forward over the static
    cache) reading the same pairs causally: training teaches the function that drafts."""
    target = tiny_model("llama")
    draft = FusedDraft.from_target(target, _full_map(), taps=TAPS).double()
    x, f = _two_windows(32, 3)[0]
    with torch.no_grad():
        trained = unrolled_outputs(draft, _packed([(x, f)], 32, taps=3, row=6), 1)[0][0]
        kv = KVState(draft, [])
        rows = draft.pair_inputs(x[1:], draft.fuse(f[:-1]))
        out = kv.run(Rows.batch(0, x[1:].tolist(), 1, keep=6, embeds=rows, hidden=True))
    torch.testing.assert_close(out.states, trained)
    torch.testing.assert_close(out.logits, draft.lm_head(draft.norm(trained)).float())


@pytest.mark.parametrize("policy_name,params", DRAFTED)
def test_greedy_output_equals_target_greedy_with_a_fused_draft(arch, policy_name, params):
    target = tiny_model(arch)
    draft = FusedDraft.from_target(target, _full_map(), taps=TAPS, seed=1)
    for prompt in PROMPTS:
        result = generate(
            target, prompt, make_method(policy_name, params), draft=draft, config=DecodeConfig(max_new_tokens=24)
        )
        assert result.token_ids == hf_greedy(target, prompt, 24), f"{policy_name} {params} diverged"
        assert result.draft_kind == "fused"


def test_the_taps_handed_over_equal_the_targets_hidden_states(monkeypatch):
    from dynatree_core.drafts.fused import FusedDrafter

    pairs = []
    original = FusedDrafter.add_features
    monkeypatch.setattr(
        FusedDrafter, "add_features", lambda self, f, t: (pairs.append(f.clone()), original(self, f, t))
    )
    target = tiny_model("llama")
    prompt = PROMPTS[1]
    result = generate(
        target, prompt, make_method("fixed_tree"), draft=FusedDraft.from_target(target, _full_map(), taps=TAPS)
    )
    sequence = prompt + result.token_ids
    got = torch.cat(pairs)
    with torch.no_grad():
        out = target.base_model(input_ids=torch.tensor([sequence[:-1]]), output_hidden_states=True)
    want = torch.stack([out.hidden_states[0][0], out.hidden_states[1][0], out.last_hidden_state[0]], dim=1)
    torch.testing.assert_close(got, want[: len(got)], rtol=1e-9, atol=1e-9)


def test_a_saved_fused_draft_loads_drafts_the_same_and_refuses_another_target(tmp_path):
    target = tiny_model("llama")
    token_map = TokenMap([-1, *range(0, 96, 2)], 96)
    draft = FusedDraft.from_target(target, token_map, taps=TAPS, seed=2)
    draft.save(tmp_path / "d")
    loaded = FusedDraft.load(tmp_path / "d", target)
    config = DecodeConfig(max_new_tokens=16)
    runs = [generate(target, PROMPTS[0], make_method("dynatree"), draft=d, config=config) for d in (draft, loaded)]
    assert [r.tree.tokens for r in runs[0].records] == [r.tree.tokens for r in runs[1].records]
    with pytest.raises(DynaTreeError, match="hidden size"):
        FusedDraft.load(tmp_path / "d", _wide_target())


def _wide_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    return LlamaForCausalLM(config).eval()


def test_eagle3_taps_are_the_published_layers():
    assert eagle3_taps(30) == (2, 15, 27) and eagle3_taps(32) == (2, 16, 29)
    with pytest.raises(ValueError):
        eagle3_taps(2)


def test_soft_cross_entropy_leaves_other_out_and_equals_the_explicit_sum():
    draft = FeatureDraft.from_target(tiny_model("llama"), _full_map()).double()
    h = torch.randn(5, 32, dtype=torch.float64)
    slots = torch.randint(1, 97, (5, 3))
    p = torch.softmax(torch.randn(5, 3, dtype=torch.float64), -1)
    ce, _ = soft_ce(draft, h, slots, p)
    logq = torch.log_softmax(draft.reduced_logits(h), -1)
    torch.testing.assert_close(ce.double(), -(p * logq.gather(1, slots)).sum(-1).mean(), rtol=1e-5, atol=1e-5)


def _teacher_batch(hidden: int, taps: int = 0) -> PackedBatch:
    """Two rows of two windows each, with a random teacher and goal (float64)."""
    gen = torch.Generator().manual_seed(0)
    seg = torch.tensor([[0] * 7 + [1] * 6 + [-1] * 3, [0] * 10 + [1] * 4 + [-1] * 2])
    positions = torch.zeros_like(seg)
    for r, s in [(r, s) for r in range(2) for s in range(2)]:
        positions[r, seg[r] == s] = torch.arange(1, int((seg[r] == s).sum()) + 1)
    shape = (2, 16, taps, hidden) if taps else (2, 16, hidden)
    real = seg >= 0
    counted = real & (torch.rand(seg.shape, generator=gen) < 0.8)  # a few real pairs the map cannot learn
    p = torch.softmax(torch.randn(2, 16, 3, generator=gen, dtype=torch.float64), -1) * counted[..., None]
    return PackedBatch(torch.randint(0, 96, seg.shape, generator=gen), torch.randn(shape, generator=gen,
                       dtype=torch.float64), torch.randn(2, 16, hidden, generator=gen, dtype=torch.float64),
                       positions, seg, real, counted, torch.randint(1, 97, (2, 16, 3), generator=gen), p,
                       int(real.sum()), int(real.sum()))  # fmt: skip


def _reference_loss(draft, batch: PackedBatch, cfg: PackedTrainConfig, share: torch.Tensor) -> torch.Tensor:
    """The module docstring's loss written with boolean masks over every slot's output."""
    fused = isinstance(draft, FusedDraft)
    outs = unrolled_outputs(draft, batch, cfg.levels)
    last = batch.counted & root_ok(batch.seg, cfg.levels) & (share if fused else True)
    total, weights = 0.0, 0.0
    for level, out in enumerate(outs, 1):
        rows = torch.zeros_like(last)
        rows[:, : 16 - (cfg.levels - level)] = last[:, cfg.levels - level :]
        rows &= batch.counted & root_ok(batch.seg, level)
        on = rows if fused else rows & share
        ce = soft_ce(draft, out[on], batch.teacher_slots[on], batch.teacher_p[on])[0]
        term = ce
        if not fused:
            reg = torch.nn.functional.smooth_l1_loss(out[rows].float(), batch.goal[rows].float(), reduction="none")
            term = cfg.ce_weight * ce + cfg.regression_weight * reg.mean(-1).mean()
        total, weights = total + cfg.level_decay ** (level - 1) * term, weights + cfg.level_decay ** (level - 1)
    return total / weights


@pytest.mark.parametrize("levels", [1, 3])
@pytest.mark.parametrize("kind", ["feature", "fused"])
def test_the_planned_step_takes_the_loss_of_its_definition_and_never_waits_for_the_device(kind, levels):
    """The step's choices (loss rows, where each level is computed, the CE's share) are planned on
    the host: its loss equals the definition's (boolean masks over every slot), and its forward and
    backward make no op that waits for the device's values (on a GPU each drains the kernel queue)."""
    target = tiny_model("llama")
    if kind == "fused":
        draft, batch = FusedDraft.from_target(target, _full_map(), taps=TAPS).double(), _teacher_batch(32, 3)
    else:
        draft, batch = FeatureDraft.from_target(target, _full_map()).double(), _teacher_batch(32)
    for ce_share in (1.0, 0.5):
        cfg = PackedTrainConfig(levels=levels, ce_share=ce_share)
        batch.plan = plan_step(batch, cfg, kind == "fused", torch.Generator().manual_seed(7))
        share = torch.rand(batch.seg.shape, generator=torch.Generator().manual_seed(7)) < ce_share
        with counting_waits() as waits:
            loss = packed_loss(draft, batch, cfg, parts=False)[0]
            loss.backward()
        assert waits.total == 0, f"the step waited for the device: {dict(waits.sites)}"
        torch.testing.assert_close(loss, _reference_loss(draft, batch, cfg, share))


def test_prefetch_keeps_the_order_with_several_workers_and_raises_their_failures():
    import threading
    import time

    def slow(i: int) -> int:  # later items often finish first
        time.sleep(0.002 * ((7 * i) % 5))
        return i * i

    assert list(prefetch(lambda: iter(range(40)), slow, workers=4)) == [i * i for i in range(40)]
    first = prefetch(lambda: iter(range(10**9)), slow, workers=3)
    assert [next(first) for _ in range(5)] == [0, 1, 4, 9, 16]
    first.close()  # an endless source stopped early: its threads end
    alive = lambda: [t.name for t in threading.enumerate() if t.name.startswith("prefetch")]  # noqa: E731
    for _ in range(100):
        if not alive():
            break
        time.sleep(0.02)
    assert not alive(), alive()

    def broken_make():
        yield 1
        raise ValueError("no shard")

    with pytest.raises(ValueError, match="no shard"):
        list(prefetch(broken_make, workers=2))
    with pytest.raises(ZeroDivisionError):
        list(prefetch(lambda: iter(range(3)), lambda i: 1 / (i - 2), workers=2))
    with pytest.raises(TimeoutError, match="no batch built in 0 s"):
        list(prefetch(lambda: iter(range(3)), lambda i: time.sleep(0.5), wait_s=0.05))

    def timed_out(item):
        raise TimeoutError("the build's own")

    with pytest.raises(TimeoutError, match="the build's own"):  # not taken for a stuck prefetch
        list(prefetch(lambda: iter(range(3)), timed_out, workers=2))


@pytest.fixture
def tiny_store(tmp_path, monkeypatch, tiny_pair_dirs):
    monkeypatch.setattr(answers.sources, "build_pool", _pool)
    monkeypatch.setattr(answers, "SHARD_JOBS", 2)
    target = load_model(tiny_pair_dirs[0], device="cpu", dtype="float32")
    store = answers.AnswerStore(tmp_path / "ids", tmp_path / "features")
    answers.generate(store, target, stages=("questions",), batch=2, log=lambda m: None)
    answers.relabel(store, target, taps=(0, 1), teacher=True, log=lambda m: None)
    return store, target


def test_relabel_stores_the_taps_and_the_compact_teacher_of_a_plain_forward(tiny_store):
    store, target = tiny_store
    ids, plen, _ = store.sequences("questions", 0)[0]
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([ids[:-1].tolist()]), output_hidden_states=True)
    n = len(ids) - 1
    taps = np.load(store.taps_path("questions", 0, (0, 1)))[:n].astype(np.float32)
    np.testing.assert_allclose(taps[:, 0], out.hidden_states[0][0].numpy(), atol=2e-3)
    np.testing.assert_allclose(taps[:, 1], out.hidden_states[1][0].numpy(), atol=2e-3, rtol=1e-2)
    teacher = np.load(store.teacher_path("questions", 0))
    loss_rows = np.arange(plen - 1, n)
    logits = out.logits[0].float()
    assert (teacher["ids"][loss_rows, 0] == logits[loss_rows].argmax(-1).numpy()).all()
    np.testing.assert_allclose(teacher["lse"][loss_rows], torch.logsumexp(logits[loss_rows], -1).numpy(), rtol=1e-3)
    assert np.isnan(teacher["lse"][: plen - 1]).all(), "no teacher at the prompt's context positions"
    assert answers.relabel(store, target, taps=(0, 1), teacher=True, log=lambda m: None) == 0, "nothing left to do"


@pytest.mark.parametrize("taps", [None, (0, 1)])
def test_packed_batches_count_the_answer_pairs_and_the_teacher_sums_to_one(tiny_store, taps):
    store, target = tiny_store
    vocab = target.model.config.vocab_size
    data = PackedAnswers(store, TokenMap([-1, *range(vocab)], vocab), taps=taps, stages=("questions",), heldout=False)
    rows = data.train_rows
    batch = data.batch(rows)
    assert int(batch.answer.sum()) == data.answer_pairs(rows), "every answer pair, nothing of the prompts"
    assert batch.pairs == int((batch.seg >= 0).sum()) and batch.seg.shape[1] == 512
    p = batch.teacher_p[batch.counted].sum(-1)
    torch.testing.assert_close(p, torch.ones_like(p))
    assert (batch.teacher_p[~batch.counted] == 0).all()


def test_fixed_tap_scales_bring_each_tap_to_a_mean_rms_of_one_and_survive_save_and_load(tiny_store, tmp_path):
    """fc_norm "scale": set from the data before training (train-packed), a factor a tap that makes its
    mean root-mean-square over real pairs 1; saved and loaded with the draft, and drafting reads it."""
    from dynatree_core.drafts.fused import FusedDraft
    from dynatree_core.training.packed.commands import set_tap_scale

    store, target = tiny_store
    vocab = target.model.config.vocab_size
    token_map = TokenMap([-1, *range(vocab)], vocab)
    data = PackedAnswers(store, token_map, taps=(0, 1), stages=("questions",), heldout=False)
    draft = FusedDraft.from_target(target.model, token_map, taps=(0, 1), fc_norm="scale")
    set_tap_scale(draft, data)
    batch = data.batch(data.train_rows)
    taps = batch.inputs[batch.seg >= 0].float() * draft.tap_scale[:, None]
    torch.testing.assert_close(taps.pow(2).mean(-1).sqrt().mean(0), torch.ones(2), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(draft.tap_scale, torch.ones(2)), "the taps' own scales are not 1 already"
    draft.save(tmp_path / "scaled")
    back = FusedDraft.load(tmp_path / "scaled", target.model)
    assert back.fc_norm_kind == "scale" and torch.equal(back.tap_scale, draft.tap_scale)
    sample = batch.inputs[:1, :4].float()
    torch.testing.assert_close(back.fuse(sample), draft.fuse(sample))
    plain = dict(draft.state_dict())
    plain["tap_scale"] = torch.ones(2)
    unscaled = FusedDraft.from_target(target.model, token_map, taps=(0, 1), fc_norm="scale")
    unscaled.load_state_dict(plain)
    assert not torch.allclose(unscaled.fuse(sample), draft.fuse(sample)), "the scale is read"


def test_a_stopped_run_resumes_the_same_schedule_and_its_curve_is_saved(tiny_store, tmp_path):
    store, target = tiny_store
    vocab = target.model.config.vocab_size
    token_map = TokenMap([-1, *range(vocab)], vocab)
    data = PackedAnswers(store, token_map, stages=("questions",), heldout=False)
    evals = {"heldout": (data, data.train_rows[:2])}
    ticks = iter(range(10**6))

    def clock() -> float:  # every reading advances one second; around reading 24 the run stands still two days
        t = next(ticks)
        return float(t + 86_400 * ((t >= 24) + (t >= 25)))  # (one of the two jumps falls inside a step)

    cfg = PackedTrainConfig(
        passes=6.0, pairs_per_step=8, log_every=1, eval_every_s=4, stop_after_s=5, warmup=1, eval_first=True
    )
    out = tmp_path / "run"

    def run() -> None:  # a fresh process's draft: everything else comes from the checkpoint
        draft = FeatureDraft.from_target(target.model, token_map)
        head = target.model.get_output_embeddings()
        train_packed(draft, data, out, cfg, target_head=head, evals=evals, clock=clock, log=lambda m: None)

    run()
    first = torch.load(out / "checkpoint.pt", weights_only=False)["state"]
    assert not (out / "draft").exists() and 0 < first["seen"] < 6 * data.answer_pairs()
    cfg.stop_after_s = 0
    run()
    done = torch.load(out / "checkpoint.pt", weights_only=False)["state"]
    assert done["step"] > first["step"] and done["seen"] >= 6 * data.answer_pairs(), "the schedule ran to its end"
    assert (out / "draft").exists()
    curve = json.loads((out / "curve.json").read_text())["curve"]
    assert [p["step"] for p in curve] == sorted(p["step"] for p in curve) and len(curve) >= 3
    assert all(len(p["heldout"]) == 4 for p in curve)
    assert done["spent_s"] <= done["step"], "the day the process stood still is not training time"


@pytest.mark.parametrize(
    "draft_options,settings,needle",
    [
        (dict(taps=(1, 1)), {}, "taps [0, 1] there, [1, 1] now"),
        (dict(fc_norm="none"), {}, "fc_norm 'per_tap' there, 'none' now"),
        ({}, dict(levels=2), "levels 1 there, 2 now"),
    ],
    ids=["taps", "fc_norm", "levels"],
)
def test_a_packed_run_resumed_for_another_draft_or_loss_is_refused_naming_it(tiny_store, tmp_path, draft_options,
                                                                              settings, needle):  # fmt: skip
    """The checkpoint records the draft's form and the loss; a rerun that differs is one error
    naming the settings, before any weight is loaded (a longer schedule alone resumes)."""
    store, target = tiny_store
    vocab = target.model.config.vocab_size
    token_map = TokenMap([-1, *range(vocab)], vocab)
    data = PackedAnswers(store, token_map, taps=(0, 1), stages=("questions",), heldout=False)
    cfg = PackedTrainConfig(passes=0.5, pairs_per_step=16, log_every=1, eval_every_s=0)
    head, out = target.model.get_output_embeddings(), tmp_path / "run"
    train_packed(FusedDraft.from_target(target.model, token_map, taps=(0, 1)), data, out, cfg, target_head=head,
                 log=lambda m: None)  # fmt: skip
    assert torch.load(out / "checkpoint.pt", weights_only=False)["run"]["taps"] == [0, 1]
    options = dict(taps=(0, 1)) | draft_options
    other = PackedTrainConfig(**{**cfg.__dict__, "passes": 1.0, **settings})
    with pytest.raises(DynaTreeError, match="other settings") as caught:
        train_packed(FusedDraft.from_target(target.model, token_map, **options), data, out, other, target_head=head,
                     log=lambda m: None)  # fmt: skip
    assert needle in str(caught.value), str(caught.value)
    logs: list[str] = []
    again = PackedTrainConfig(**{**cfg.__dict__, "passes": 1.0})
    train_packed(FusedDraft.from_target(target.model, token_map, taps=(0, 1)), data, out, again, target_head=head,
                 log=logs.append)  # fmt: skip
    assert any("resumed at step" in m for m in logs), logs


def test_a_paused_step_counts_the_recent_median_and_a_slow_one_counts_in_full():
    from dynatree_core.training.trainer import counted_s

    recent: list[float] = []
    assert counted_s(500.0, recent) == 500.0, "without a history every second counts"
    recent.clear()
    assert [counted_s(dt, recent) for dt in (1.0, 1.2, 0.9, 1.1, 1.0)] == [1.0, 1.2, 0.9, 1.1, 1.0]
    assert counted_s(3_600.0, recent) == 1.0, "an hour stopped (SIGSTOP) counts as a typical step"
    assert counted_s(4.0, recent) == 4.0, "a slower step (a busy machine, an eval) is still training time"


def test_a_fused_draft_for_another_target_is_one_error_line_in_the_cli(capsys, tiny_pair_dirs, tmp_path):
    from test_cli import run_cli

    FusedDraft.from_target(_wide_target(), _full_map(), taps=TAPS).save(tmp_path / "wide")
    code, _, err = run_cli(capsys, "generate", "--target", tiny_pair_dirs[0], "--draft", str(tmp_path / "wide"),
                           "--prompt", "hi", "--max-new-tokens", "4")  # fmt: skip
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "hidden size" in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("kind", ["feature", "fused"])
def test_a_packed_run_exports_with_a_card_of_its_passes_and_learning_curve(tiny_store, tmp_path, monkeypatch, kind):
    from dynatree_core.drafts.heads import load_head
    from dynatree_core.training.card import export_feature_draft

    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))
    store, target = tiny_store
    vocab = target.model.config.vocab_size
    token_map = TokenMap([-1, *range(vocab)], vocab)
    taps = (0, 1) if kind == "fused" else None
    data = PackedAnswers(store, token_map, taps=taps, stages=("questions",), heldout=False)
    cfg = PackedTrainConfig(passes=2.0, pairs_per_step=16, log_every=1, eval_every_s=1e-9, eval_first=True, levels=2)
    draft = (
        FusedDraft.from_target(target.model, token_map, taps=taps)
        if taps
        else FeatureDraft.from_target(target.model, token_map)
    )
    about = {"training_answer_positions": data.answer_pairs(), "training_windows": len(data.train_rows)}
    head = target.model.get_output_embeddings()
    train_packed(draft, data, tmp_path / "run", cfg, target_head=head, evals={"heldout": (data, data.train_rows[:2])},
                 about=about, log=lambda m: None)  # fmt: skip
    export_feature_draft(tmp_path / "run", tmp_path / "out", target.model, quality=None, command="train-packed ...")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "passes**" in card and "| stage | step | passes (all stages) | training s (all stages) |" in card
    assert "unrolled over the draft's own outputs for 2 levels" in card
    assert ("Fused-feature" in card) == (kind == "fused") and str(tmp_path) not in card
    assert load_head(str(tmp_path / "out"), target.model).kind == kind
    assert "from random initialisation" in card and "shipped in" not in card
    assert "autocast bfloat16, on the CPU;" in card
    info = json.loads((tmp_path / "run" / "curve.json").read_text())
    info["data"]["init_from"] = str(tmp_path / "out")  # the run started from the draft it now replaces
    (tmp_path / "run" / "curve.json").write_text(json.dumps(info))
    export_feature_draft(tmp_path / "run", tmp_path / "out", target.model, quality=None, command="train-packed ...")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "started from the draft shipped in" in card and "git history" in card
    info["data"]["init_from"] = str(tmp_path / "run" / "draft")  # a second stage from the first one's draft
    info["config"]["device"] = "cuda"  # ... trained on a GPU: the card says where each stage ran
    shutil.copytree(tmp_path / "run", tmp_path / "stage2")
    (tmp_path / "stage2" / "curve.json").write_text(json.dumps(info))
    export_feature_draft(tmp_path / "stage2", tmp_path / "out", target.model, quality=None, command="make ...")
    card = (tmp_path / "out" / "README.md").read_text()
    end = info["curve"][-1]
    each = end["seen"] / about["training_answer_positions"]
    assert "| 1 (run) | unrolled (2 levels) |" in card and "| 2 (this run) |" in card and "shipped in" in card
    assert "| CPU | the draft shipped in" in card and "| GPU (cuda) | the previous stage |" in card
    assert "autocast bfloat16, on the GPU (cuda);" in card
    assert f"| 2 | {end['step']} | {2 * each:.2f} | {2 * end['train_s']:.0f} |" in card  # counted over both stages
    assert f"**{2 * each:.2f} passes**" in card
    if kind == "fused":  # its head stayed frozen (train_head off): shipped as the target's rows, not saved
        from safetensors import safe_open

        assert json.loads((tmp_path / "out" / "fused_draft.json").read_text())["head"] == "target rows"
        with safe_open(str(tmp_path / "out" / "fused_draft.safetensors"), "pt") as f:
            assert "lm_head.weight" not in set(f.keys())


def test_the_card_says_which_rows_are_human_written_text_and_counts_passes_over_all_of_them():
    from dynatree_core.training.card import _data_lines

    row = {"prompts": 10, "prompt_tokens": 100, "answer_tokens": 400}
    data = {"training_windows": 4, "training_positions": 1_000, "training_answer_positions": 800}
    answers_only = _data_lines({"data": {**data, "sources": {"pydoc": row}}}, [{"seen": 1_600}])
    mixed = _data_lines({"data": {**data, "sources": {"pydoc": row, "written-pydoc": row}}}, [{"seen": 1_600}])
    assert not any("human-written" in line for line in answers_only)
    assert any("`written-*` are human-written text" in line for line in mixed)
    assert any("**2.00 passes**" in line for line in mixed) and "| **all** | 20 | 200 | 800 |" in mixed


def test_checkpoints_follow_their_interval_and_the_last_state_is_always_saved(tiny_store, tmp_path, monkeypatch):
    """`checkpoint_every_s`: a log line writes the checkpoint only once that long (on the loop's clock)
    has passed since the last one; 0 writes one at every log line; the run's end writes its state."""
    from dynatree_core.training import trainer

    store, target = tiny_store
    vocab = target.model.config.vocab_size
    token_map = TokenMap([-1, *range(vocab)], vocab)
    data = PackedAnswers(store, token_map, stages=("questions",), heldout=False)
    written: list[int] = []
    real = trainer._Run.checkpoint
    monkeypatch.setattr(trainer._Run, "checkpoint", lambda self: (written.append(self.state["step"]), real(self)))

    def run(every: float, out) -> dict:
        written.clear()
        ticks = iter(range(10**6))  # every reading of the clock advances one second
        cfg = PackedTrainConfig(passes=3.0, pairs_per_step=8, log_every=1, eval_every_s=0, warmup=1,
                                checkpoint_every_s=every)  # fmt: skip
        draft = FeatureDraft.from_target(target.model, token_map)
        head = target.model.get_output_embeddings()
        train_packed(draft, data, out, cfg, target_head=head, clock=lambda: float(next(ticks)), log=lambda m: None)
        return torch.load(out / "checkpoint.pt", weights_only=False)["state"]

    every_line = run(0.0, tmp_path / "a")
    steps = every_line["step"]
    assert steps >= 4 and written[:steps] == list(range(1, steps + 1)), "0: a checkpoint at every log line"
    spaced = run(5.0, tmp_path / "b")
    assert spaced["step"] == steps, "the same schedule"
    lines = written[:-1]  # the last entry is the run's end
    assert 1 <= len(lines) < steps and written[-1] == steps, f"checkpoints at steps {written} of {steps}"
    assert all(b - a >= 2 for a, b in zip(lines, lines[1:], strict=False)), "at most one per interval"
