"""Draft training on a tiny synthetic setup: losses are right and training reduces them."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_model

from dynatree_core.core.vocab import TokenMap
from dynatree_core.training.token.corpus import label_shard
from dynatree_core.training.token.train import TrainConfig, init_draft, kd_loss


def test_kd_loss_matches_a_naive_computation():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    topk_logp, topk_ids = torch.log_softmax(torch.randn(2, 3, 11), -1).topk(4, dim=-1)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, agree = kd_loss(logits, topk_ids, topk_logp, mask, hard_weight=0.5)
    total, count, hits = 0.0, 0, 0
    for b in range(2):
        for t in range(3):
            if not mask[b, t]:
                continue
            logq = torch.log_softmax(logits[b, t], -1)
            p = torch.softmax(topk_logp[b, t], -1)
            total += -(p * logq[topk_ids[b, t]]).sum() - 0.5 * logq[topk_ids[b, t, 0]]
            count += 1
            top1 = int(topk_ids[b, t, 0])
            hits += int(int(logits[b, t, 1:].argmax()) + 1 == top1 and top1 != 0)
    assert loss.item() == pytest.approx(total.item() / count, rel=1e-5)
    assert agree.item() == pytest.approx(hits / count)


def test_training_steps_reduce_the_kd_loss():
    target = copy.deepcopy(tiny_model("llama")).float()
    gen = np.random.default_rng(0)
    ids = gen.integers(1, 90, size=(16, 24)).astype(np.uint16)
    lengths = np.full(16, 24, dtype=np.int16)
    labels = label_shard(target, ids, lengths, k=8, batch=8)
    cfg = TrainConfig(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    token_map = TokenMap([-1, *range(0, 60)], VOCAB)  # a reduced vocabulary: 60 of 96 tokens
    draft = init_draft(target, cfg, token_map)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    x = token_map.to_draft(torch.from_numpy(ids.astype(np.int64)))
    tid = token_map.to_draft(torch.from_numpy(labels["topk_ids"].astype(np.int64)))
    tlp = torch.from_numpy(labels["topk_logp"].astype(np.float32))
    mask = torch.ones(16, 24, dtype=torch.bool)
    losses = []
    for _ in range(40):
        loss, _ = kd_loss(draft(input_ids=x).logits, tid, tlp, mask, 0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses[::10]


def test_labels_are_the_targets_top_k():
    target = copy.deepcopy(tiny_model("qwen2")).float()
    ids = np.array([[5, 9, 3, 7, 0, 0]], dtype=np.uint16)
    labels = label_shard(target, ids, np.array([4], dtype=np.int16), k=5, batch=1)
    logp = torch.log_softmax(target(input_ids=torch.tensor([[5, 9, 3, 7]])).logits[0], -1)
    top, tok = logp.topk(5, dim=-1)
    assert (labels["topk_ids"][0, :4] == tok.numpy()).all()
    np.testing.assert_allclose(labels["topk_logp"][0, :4], top.detach().numpy(), atol=2e-3)


def test_compute_ledger_sums_stages_and_reaches_the_model_card(tmp_path, monkeypatch):
    import json

    from dynatree_core.training.card import token_card as model_card
    from dynatree_core.training.ledger import record, totals

    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path))
    record("label", 10.0, tokens=100, item="shard 0")
    record("label", 5.5, tokens=50, item="shard 1")
    record("train", 30.0, tokens=900, run=str(tmp_path / "run"))
    record("train", 99.0, tokens=900, run=str(tmp_path / "other-run"))
    spent = totals(run=tmp_path / "run")
    assert spent["label"] == {"seconds": 15.5, "items": 2, "tokens": 150}
    assert spent["train"]["seconds"] == 30.0
    assert totals()["train"]["seconds"] == 129.0
    run = tmp_path / "run"
    run.mkdir()
    cfg = dict(TrainConfig().__dict__)
    (run / "curve.json").write_text(json.dumps({"config": cfg, "curve": []}))
    card = model_card("d", run, None, "make draft")
    assert "| label | 16 | 2 | 150 |" in card and "| total | 46 " in card


def test_a_tests_training_stages_leave_the_users_ledger_alone(tmp_path, monkeypatch):
    from dynatree_core.core.cache_dir import cache_dir
    from dynatree_core.training.ledger import ledger_path, record, totals

    monkeypatch.delenv("DYNATREE_CACHE")  # without this module's cache override: the cache a user's run writes to
    users = cache_dir() / "draft-runs" / "compute.jsonl"
    before = users.read_bytes() if users.exists() else None
    record("answers", 0.5, tokens=12, item="questions 0")
    assert (users.read_bytes() if users.exists() else None) == before
    assert ledger_path() != users and totals()["answers"]["tokens"] == 12


def test_batches_can_oversample_onpolicy_windows():
    from dynatree_core.training.token.train import LabelledCorpus

    data = LabelledCorpus.__new__(LabelledCorpus)
    data.train_rows = np.arange(100)
    data.source = np.array([0] * 10 + [1] * 90, dtype=np.int8)
    rng = np.random.default_rng(0)
    rows = data.sample(rng, 8, onpolicy_share=0.5)
    assert len(set(rows.tolist())) == 8
    assert (data.source[rows] == 0).sum() == 4
    uniform = data.sample(rng, 8)
    assert len(set(uniform.tolist())) == 8 and set(uniform.tolist()) <= set(range(100))


# ----- the feature draft's training (training/feature/train.py) -----------------------------------------
@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Training stages write to the cache (runs, data): these tests to their own."""
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))


def _feature_setup(tmp_path, n=24, width=48):
    from dynatree_core.training.feature.labels import FeatureCorpus, label_features

    target = copy.deepcopy(tiny_model("llama")).float()
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, size=(n, width)).astype(np.uint16)
    lengths = np.full(n, width, dtype=np.int16)
    lengths[::5] = width // 2
    heldout = np.zeros(n, dtype=bool)
    heldout[-4:] = True
    source = np.zeros(n, dtype=np.int8)
    source[: n // 2] = 1
    corpus = tmp_path / "corpus.npz"
    np.savez(corpus, ids=ids, lengths=lengths, heldout=heldout, source=source)
    computed = label_features(corpus, tmp_path / "features", target, log=lambda m: None)
    return target, corpus, FeatureCorpus(corpus, tmp_path / "features"), computed


def test_feature_labels_are_the_targets_hidden_states_and_resume(tmp_path):
    from dynatree_core.training.feature.labels import label_features

    target, corpus, data, computed = _feature_setup(tmp_path)
    assert computed == [0] and len(data.train_rows) == 20 and len(data.eval_rows) == 4
    x, f, valid = data.batch(np.array([0, 5]), torch.device("cpu"))
    with torch.no_grad():
        expected = target.base_model(input_ids=x, attention_mask=valid.long()).last_hidden_state
    torch.testing.assert_close(f[valid], expected[valid], rtol=2e-3, atol=2e-3)  # stored as float16
    assert label_features(corpus, tmp_path / "features", target, log=lambda m: None) == [], "a present shard is redone"


def test_feature_kd_loss_matches_a_naive_computation(tmp_path):
    from dynatree_core.drafts.feature import FeatureDraft
    from dynatree_core.training.feature.train import feature_kd_loss

    target, _, data, _ = _feature_setup(tmp_path)
    draft = FeatureDraft.from_target(target, TokenMap([-1, *range(1, VOCAB)], VOCAB), seed=2)
    x, f, valid = data.batch(np.array([0, 1]), torch.device("cpu"))
    loss, parts = feature_kd_loss(draft, x, f, valid, noise=0.0, ce_weight=0.1)
    total, count = 0.0, 0
    for b in range(2):
        n = int(valid[b].sum())
        embeds = draft.inputs(x[b, 1:n], f[b, : n - 1])[None]
        pred = draft.lm.model(inputs_embeds=embeds, position_ids=torch.arange(1, n)[None]).last_hidden_state[0]
        for j in range(n - 1):
            reg = torch.nn.functional.smooth_l1_loss(pred[j], f[b, j + 1])
            logq = torch.log_softmax(draft.lm.lm_head(pred[j])[1:], -1)
            p = torch.softmax(draft.lm.lm_head(f[b, j + 1])[1:], -1)
            total += float((reg - 0.1 * (p * logq).sum()).detach())
            count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-4)
    assert 0.0 <= parts["agreement"] <= 1.0


def test_feature_training_reduces_the_loss_resumes_and_saves(tmp_path):
    from dynatree_core.drafts.feature import FeatureDraft
    from dynatree_core.training.feature.train import (
        FeatureTrainConfig,
        agreement_by_depth,
        feature_kd_loss,
        train_feature_draft,
    )

    target, _, data, _ = _feature_setup(tmp_path)
    token_map = TokenMap([-1, *range(1, VOCAB)], VOCAB)
    fixed = data.batch(np.array([1, 2, 3, 4]), torch.device("cpu"))
    before = FeatureDraft.from_target(target, token_map, seed=0)
    with torch.no_grad():
        start = feature_kd_loss(before, *fixed, noise=0.0, ce_weight=0.1)[1]
    cfg = FeatureTrainConfig(steps=300, batch=4, lr=1e-2, warmup=5, eval_every=50, log_every=25, device="cpu")
    out = tmp_path / "run"
    logs: list[str] = []
    train_feature_draft(target, token_map, data, out, dataclasses.replace(cfg, steps=50), log=logs.append)
    draft = train_feature_draft(target, token_map, data, out, cfg, log=logs.append)
    assert any("resumed at step 50" in m for m in logs)
    with torch.no_grad():
        end = feature_kd_loss(draft, *fixed, noise=0.0, ce_weight=0.1)[1]
    assert end["regression"] < 0.85 * start["regression"] and end["agreement"] > start["agreement"], (start, end)
    loaded = FeatureDraft.load(out / "draft", target)
    by_depth = agreement_by_depth(loaded, target.get_output_embeddings(), data, data.eval_rows, depths=3)
    assert len(by_depth) == 3 and all(0.0 <= a <= 1.0 for a in by_depth)
    assert by_depth == agreement_by_depth(draft, target.get_output_embeddings(), data, data.eval_rows, depths=3)
    from dynatree_core.training.card import export_feature_draft

    export_feature_draft(out, tmp_path / "shipped", target, quality={"agreement": 0.5}, command="make draft-feature")
    card = (tmp_path / "shipped" / "README.md").read_text()
    assert "| 150 |" in card and "make draft-feature" in card and '"agreement": 0.5' in card
    shipped = FeatureDraft.load(tmp_path / "shipped", target)  # bfloat16 on disk, float32 again here
    assert shipped.dtype == torch.float32
    from safetensors.torch import load_file

    assert "lm.lm_head.weight" not in load_file(tmp_path / "shipped" / "feature_draft.safetensors"), "head rows saved"


def test_a_wall_time_budget_ends_training_resumes_and_decays_the_rate_over_time(tmp_path, monkeypatch):
    """budget_s: equal-compute runs. The clock is faked (each step costs 10 s), so the run stops
    after exactly 5 steps whatever the step limit, resumes with the time spent so far, and the
    cosine schedule follows the time, not the step limit."""
    import dynatree_core.training.trainer as trainer_mod
    from dynatree_core.training.feature.train import FeatureTrainConfig, train_feature_draft

    clock = iter(range(0, 100_000, 10))  # every read 10 s later; a step reads it at its start and end
    monkeypatch.setattr(trainer_mod.time, "perf_counter", lambda: float(next(clock)))
    target, _, data, _ = _feature_setup(tmp_path)
    token_map = TokenMap([-1, *range(1, VOCAB)], VOCAB)
    cfg = FeatureTrainConfig(
        steps=1000, batch=2, lr=1e-2, warmup=1, eval_every=1000, log_every=1, device="cpu", budget_s=50.0
    )
    logs: list[str] = []
    train_feature_draft(
        target, token_map, data, tmp_path / "run", dataclasses.replace(cfg, budget_s=30.0), log=logs.append
    )
    train_feature_draft(target, token_map, data, tmp_path / "run", cfg, log=logs.append)
    assert any("resumed at step 3" in m for m in logs)
    steps = [m for m in logs if " loss " in m]
    assert len(steps) == 5, logs
    curve = json.loads((tmp_path / "run" / "curve.json").read_text())["curve"]
    assert [c["step"] for c in curve] == [3, 5] and curve[-1]["train_s"] >= 50
    rates = [float(m.split(" lr ")[1].split()[0]) for m in steps]
    assert rates[0] == pytest.approx(1e-2) and rates[-1] < rates[2] < rates[0]  # decays with the time spent


def test_a_run_killed_between_evaluations_resumes_from_its_last_log_line(tmp_path, monkeypatch):
    import dynatree_core.training.trainer as trainer_mod
    from dynatree_core.training.feature.train import FeatureTrainConfig, train_feature_draft

    target, _, data, _ = _feature_setup(tmp_path)
    token_map = TokenMap([-1, *range(1, VOCAB)], VOCAB)
    cfg = FeatureTrainConfig(steps=8, batch=2, lr=1e-2, warmup=1, eval_every=1000, log_every=3, device="cpu")
    calls = []

    def killed_at_step_8(stage, seconds, **kw):  # a kill at the third log point (step 8), before its checkpoint
        calls.append(kw["item"])
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, "record", killed_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        train_feature_draft(target, token_map, data, tmp_path / "run", cfg, log=lambda m: None)
    assert calls == ["steps to 3", "steps to 6", "steps to 8"]
    logs: list[str] = []
    monkeypatch.setattr(trainer_mod, "record", lambda *a, **k: None)
    train_feature_draft(target, token_map, data, tmp_path / "run", cfg, log=logs.append)
    assert any("resumed at step 6" in m for m in logs), logs


def test_agreement_by_depth_equals_drafting_each_chain_separately(tmp_path):
    """Depth 1 and 2 of agreement_by_depth against a naive loop: for every pair j, a causal
    forward over the true pairs up to the root, then the child read with the root's predicted
    feature, as the FeatureDrafter does."""
    from dynatree_core.drafts.feature import FeatureDraft
    from dynatree_core.training.feature.train import agreement_by_depth

    target, _, data, _ = _feature_setup(tmp_path)
    draft = FeatureDraft.from_target(target, None, seed=4)
    rows = data.eval_rows[:2]
    head = target.get_output_embeddings()
    got = agreement_by_depth(draft, head, data, rows, depths=2)
    hits, totals = [0, 0], [0, 0]
    with torch.no_grad():
        for r in rows:
            x, f, valid = data.batch(np.array([r]), torch.device("cpu"))
            n = int(valid.sum())
            for j in range(1, n):  # pair j = (f_{j-1}, x_j) predicts x_{j+1}, the target's argmax of head(f_j)
                greedy = int(head(f[0, j]).argmax())
                embeds = draft.inputs(x[0, 1 : j + 1], f[0, :j])[None]
                out = draft.lm.model(inputs_embeds=embeds, position_ids=torch.arange(1, j + 1)[None])
                hits[0] += int(draft.lm.lm_head(out.last_hidden_state[0, -1]).argmax()) == greedy
                totals[0] += 1
                if j >= 2:  # the same node one level deeper: its parent (pair j-1) was the root
                    root = draft.lm.model(inputs_embeds=embeds[:, :-1], position_ids=torch.arange(1, j)[None])
                    parent_feature = root.last_hidden_state[0, -1]
                    child = draft.inputs(x[0, j : j + 1], parent_feature[None])
                    both = torch.cat([embeds[0, :-1], child])[None]
                    out2 = draft.lm.model(inputs_embeds=both, position_ids=torch.arange(1, j + 1)[None])
                    hits[1] += int(draft.lm.lm_head(out2.last_hidden_state[0, -1]).argmax()) == greedy
                    totals[1] += 1
    assert got == pytest.approx([hits[0] / totals[0], hits[1] / totals[1]])


def test_init_from_keeps_the_starting_layer_and_takes_the_head_of_this_runs_token_map(tmp_path):
    """A draft started from a saved one (--init-from) keeps its fc and layer, while its frozen head
    is the target's rows for the run's own token map, even when the saved draft used another map."""
    from dynatree_core.drafts.feature import FeatureDraft
    from dynatree_core.training.feature.train import FeatureTrainConfig, train_feature_draft

    target, _, data, _ = _feature_setup(tmp_path)
    start_map = TokenMap([-1, *range(1, VOCAB)], VOCAB)
    run_map = TokenMap([-1, *range(VOCAB - 1, 0, -1)], VOCAB)  # same size, other order
    start = FeatureDraft.from_target(target, start_map, seed=3)
    start.save(tmp_path / "start")
    cfg = FeatureTrainConfig(steps=1, batch=2, lr=0.0, warmup=1, eval_every=100, log_every=1, device="cpu")
    draft = train_feature_draft(target, run_map, data, tmp_path / "run", cfg, init_from=tmp_path / "start", log=print)
    rows = target.get_output_embeddings().weight.detach().float()[run_map.draft_to_target.clamp(min=0)]
    torch.testing.assert_close(draft.lm.lm_head.weight.float(), rows.to(draft.lm.lm_head.weight.device))
    torch.testing.assert_close(draft.fc.weight.float(), start.fc.weight.float())


# ----- checkpoints: written whole, resumed only by the same run ------------------------------------
def _torch_save_dies_midway(monkeypatch):
    """torch.save that writes part of the file, then fails (a full disk, a kill while saving)."""

    def dies(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 partial")
        raise OSError("no space left on device")

    monkeypatch.setattr(torch, "save", dies)


def test_an_interrupted_checkpoint_write_keeps_the_previous_one_and_leaves_no_partial_file(tmp_path, monkeypatch):
    from dynatree_core.core.weights import save_whole

    path = tmp_path / "checkpoint.pt"
    save_whole({"step": 1}, path)
    _torch_save_dies_midway(monkeypatch)
    with pytest.raises(OSError, match="no space"):
        save_whole({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == {"step": 1}, "the previous checkpoint, whole"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"], "no temporary or partial file left"


def test_a_feature_run_killed_while_checkpointing_resumes_from_its_previous_checkpoint(tmp_path, monkeypatch):
    from dynatree_core.training.feature.train import FeatureTrainConfig, train_feature_draft

    target, _, data, _ = _feature_setup(tmp_path)
    token_map = TokenMap([-1, *range(1, VOCAB)], VOCAB)
    cfg = FeatureTrainConfig(steps=2, batch=2, lr=1e-2, warmup=1, eval_every=100, log_every=2, device="cpu")
    out = tmp_path / "run"
    train_feature_draft(target, token_map, data, out, cfg, log=lambda m: None)
    _torch_save_dies_midway(monkeypatch)
    with pytest.raises(OSError, match="no space"):
        train_feature_draft(target, token_map, data, out, dataclasses.replace(cfg, steps=4), log=lambda m: None)
    monkeypatch.undo()
    assert torch.load(out / "checkpoint.pt", weights_only=False)["state"]["step"] == 2
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint.pt"]
    logs: list[str] = []
    train_feature_draft(target, token_map, data, out, dataclasses.replace(cfg, steps=4), log=logs.append)
    assert any("resumed at step 2" in m for m in logs), logs


@pytest.mark.parametrize(
    "other,needle",
    [
        (dict(cfg=dict(lr=5e-3)), "lr 0.01 there, 0.005 now"),
        (dict(cfg=dict(ce_weight=0.2)), "ce_weight 0.1 there, 0.2 now"),
        (dict(token_map=TokenMap([-1, *range(VOCAB - 1, 0, -1)], VOCAB)), "token_map"),
    ],
    ids=["lr", "loss-weight", "token-map"],
)
def test_a_feature_run_resumed_with_other_settings_is_refused_naming_them(tmp_path, other, needle):
    from dynatree_core.errors import DynaTreeError
    from dynatree_core.training.feature.train import FeatureTrainConfig, train_feature_draft

    target, _, data, _ = _feature_setup(tmp_path)
    token_map = TokenMap([-1, *range(1, VOCAB)], VOCAB)
    cfg = FeatureTrainConfig(steps=1, batch=2, lr=1e-2, warmup=1, eval_every=100, log_every=1, device="cpu")
    out = tmp_path / "run"
    train_feature_draft(target, token_map, data, out, cfg, log=lambda m: None)
    before = (out / "checkpoint.pt").read_bytes()
    again = dataclasses.replace(cfg, steps=2, **other.get("cfg", {}))  # a longer schedule alone would resume
    with pytest.raises(DynaTreeError, match="other settings") as caught:
        train_feature_draft(target, other.get("token_map", token_map), data, out, again, log=lambda m: None)
    assert needle in str(caught.value) and str(out / "checkpoint.pt") in str(caught.value), str(caught.value)
    assert (out / "checkpoint.pt").read_bytes() == before, "the refused run wrote nothing"


def test_the_token_draft_trainer_checkpoints_whole_and_resumes_only_the_same_run(tmp_path, tiny_pair_dirs):
    """training/token/train.py: the checkpoint is written whole (never in place); a rerun continues it,
    a rerun with another draft shape or learning rate is one error naming the settings."""
    from dynatree_core.core.models import load_model
    from dynatree_core.errors import DynaTreeError
    from dynatree_core.training.token.corpus import TOPK, checksum
    from dynatree_core.training.token.train import train

    target = load_model(tiny_pair_dirs[0], device="cpu", dtype="float32").model
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 300, size=(12, 16)).astype(np.uint16)
    lengths = np.full(12, 16, dtype=np.int16)
    heldout = np.zeros(12, dtype=bool)
    heldout[-2:] = True
    np.savez(tmp_path / "corpus.npz", ids=ids, lengths=lengths, heldout=heldout, source=np.zeros(12, dtype=np.int8))
    (tmp_path / "labels").mkdir()
    labels = label_shard(target, ids, lengths, k=TOPK, batch=4)
    np.savez(tmp_path / "labels" / "shard_00000.npz", checksum=checksum(ids), **labels)
    cfg = TrainConfig(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=64, steps=2, batch=4,
                      warmup=1, eval_every=2, log_every=1)  # fmt: skip
    out = tmp_path / "run"
    args = (tmp_path / "corpus.npz", tmp_path / "labels")
    train(out, *args, cfg, target_spec=tiny_pair_dirs[0])
    assert torch.load(out / "checkpoint.pt", weights_only=False)["run"]["target"] == tiny_pair_dirs[0]
    for change, needle in ((dict(hidden=16), "hidden 32 there, 16 now"), (dict(lr=1e-3), "lr 0.002 there")):
        with pytest.raises(DynaTreeError, match="other settings") as caught:
            train(out, *args, dataclasses.replace(cfg, steps=4, **change), target_spec=tiny_pair_dirs[0])
        assert needle in str(caught.value), str(caught.value)
    train(out, *args, dataclasses.replace(cfg, steps=4), target_spec=tiny_pair_dirs[0])  # the same run: resumes
    assert torch.load(out / "checkpoint.pt", weights_only=False)["state"]["step"] == 4
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint.pt"]


# ----- the one loop every recipe calls (training/trainer.py) --------------------------------------
def _toy_recipe(seen_lrs: list[float]):
    from dynatree_core.training.trainer import Recipe

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(16, 3), torch.randn(16, 1)

    def batches(state):
        while True:
            yield (x, y), {"cursor": state.get("cursor", 0) + 1}

    def loss(batch, parts):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1]), {}, len(batch[0]), len(batch[0])

    def point(state, loss):
        return {"step": state["step"], "loss": loss}

    return Recipe(model, list(model.parameters()), batches, loss, point, lambda out: seen_lrs.append(-1.0), run={})


def test_the_one_loop_warms_up_decays_clips_at_the_recipes_value_and_resumes(tmp_path, monkeypatch):
    """Warm-up then cosine to zero by steps, the recipe's own clip, evaluations at their cadence,
    and a rerun for a longer schedule continues the checkpoint's place (step, data, curve)."""
    from dynatree_core.training import trainer

    clips, lrs = [], []
    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda p, c: clips.append(c) or real_clip(p, c))
    monkeypatch.setattr(trainer, "record", lambda *a, **k: None)
    loop = trainer.Loop("toy", lr=0.1, warmup=2, clip=0.25, steps=4, log_every=2, eval_every=2, autocast="")
    logs: list[str] = []
    state = trainer.train(_toy_recipe(lrs), tmp_path, loop, log=logs.append)
    assert state["step"] == 4 and state["cursor"] == 4 and lrs == [-1.0], "ran 4 steps, then saved once"
    assert set(clips) == {0.25} and [p["step"] for p in state["curve"]] == [2, 4]
    rates = [float(m.split(" lr ")[1].split()[0]) for m in logs if " loss " in m]
    assert rates == pytest.approx([trainer.lr_at(loop, s, s / 4) for s in (1, 3)], rel=1e-2)
    assert trainer.lr_at(loop, 0, 0.0) == pytest.approx(0.05) and trainer.lr_at(loop, 9, 1.0) == 0.0
    longer = dataclasses.replace(loop, steps=6)
    saved = trainer.open_checkpoint(tmp_path / "checkpoint.pt", {})
    again = trainer.train(_toy_recipe(lrs), tmp_path, longer, saved=saved, log=logs.append)
    assert any("resumed at step 4" in m for m in logs) and again["cursor"] == 6
    assert [p["step"] for p in again["curve"]] == [2, 4, 6]


def test_the_prompt_material_read_from_data_is_what_the_recipes_were_built_with():
    """assets/draft-data/prompts.json holds the lists that were literals in the code; the recipes
    draw from them with seeded generators, so their order and content are pinned here."""
    import hashlib

    from dynatree_core.training.prompts import DATA, sample_prompts

    lists = {k: v for k, v in DATA.items() if k != "_about"}
    sizes = {k: len(v) for k, v in lists.items() if isinstance(v, list)}
    assert sizes == {"topics": 82, "chat_templates": 15, "code_chat": 12, "plain_openings": 9, "plain_code": 6,
                     "debian_ask": 4, "doc_ask": 4, "code_ask": 4, "man_ask": 3, "fortune_ask": 3}  # fmt: skip
    assert {k: len(v) for k, v in lists["written_ask"].items()} == dict.fromkeys(
        ("pydoc", "stdlib", "manpages", "fortunes"), 3
    )
    digest = hashlib.sha256(json.dumps(lists, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]
    assert digest == "54da5ff677d1679a"
    assert sample_prompts(2, seed=17) == [
        ("Chapter 1\n\nThe morning I first learned about Python programming,", False),
        ("Many people do not know that social media", False),
    ]


def test_every_command_line_of_make_draft_and_make_draft_feature_parses():
    """`make -n draft draft-feature`: each training command line is one the CLI accepts."""
    import re
    import shlex
    import shutil
    import subprocess

    from dynatree_core.core.presets import REPO_ROOT
    from dynatree_core.training.__main__ import parser

    if shutil.which("make") is None:
        pytest.skip("no make")
    text = subprocess.run(["make", "-n", "draft", "draft-feature"], capture_output=True, text=True, cwd=REPO_ROOT)
    lines = re.sub(r"\\\n\s*", " ", text.stdout).splitlines()
    commands = [seg for line in lines for seg in re.findall(r"-m dynatree_core\.training (.*?)(?:\|\||;|$)", line)]
    shell = {"${init:+--init-from $init}": "--init-from x", "$budget": "60", "$k": "1", "$init": "x"}
    for seg in commands:
        for k, v in shell.items():
            seg = seg.replace(k, v)
        parser().parse_args(shlex.split(seg))
    names = [seg.split()[0] for seg in commands]
    assert names[:6] == ["gen-data", "corpus", "label", "train", "quality", "export"]
    assert {"answers", "answers-relabel", "vocab-map", "train-feature", "answers-written", "train-packed"} <= set(names)
