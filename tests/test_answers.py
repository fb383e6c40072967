"""On-policy answer shards (training/answers/store.py, sources.py): stages, resumption, features that
equal a separate forward, and an out-of-distribution set disjoint from every training source."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dynatree_core.core.models import load_model
from dynatree_core.core.presets import REPO_ROOT as REPO
from dynatree_core.measure.prompt_sets import load_prompts, ood_categories
from dynatree_core.training.answers import sources
from dynatree_core.training.answers import store as answers
from dynatree_core.training.answers.decode_batch import BatchDecoder
from dynatree_core.training.answers.decode_ops import host_f16


def _pool(seed=0, log=print):
    questions = [sources.Job("self-instruct", sources.QUESTION_ASK.format(topic=t), True, 1.0, 6) for t in "abc"]
    pool = [
        sources.Job("debian", "What is the package foo used for?", True, 0.0, 5),
        sources.Job("pydoc", "The quick brown fox", False, 0.7, 7),
        sources.Job("fortunes", "What does this saying mean?\n\nHaste makes waste.", True, 1.0, 4),
    ]
    return questions, pool


@pytest.fixture
def tiny_target(tiny_pair_dirs):
    return load_model(tiny_pair_dirs[0], device="cpu", dtype="float32")


def test_stages_write_resumable_shards_whose_features_equal_a_separate_forward(tmp_path, monkeypatch, tiny_target):
    monkeypatch.setattr(answers.sources, "build_pool", _pool)
    monkeypatch.setattr(answers, "SHARD_JOBS", 2)
    monkeypatch.setattr(answers.sources, "question_from_answer", lambda text: "Why is the sky blue?")
    store = answers.AnswerStore(tmp_path / "ids", tmp_path / "features")
    written = answers.generate(store, tiny_target, batch=2, log=lambda m: None)
    # questions: 3 jobs -> 2 shards; main: 3 pool + 3 answered questions -> 3 shards
    assert [len(store.shards(s)) for s in answers.STAGES] == [2, 3] and written == 5
    main = sources.load_jobs(store.ids_dir / "main.jobs.gz")
    assert sorted(j.source for j in main).count("self-instruct") == 3, "the target's own questions join the pool"
    assert answers.generate(store, tiny_target, batch=2, log=lambda m: None) == 0, "a finished run writes nothing again"

    decoder = BatchDecoder(tiny_target.model)
    stored = np.load(store.features_path("main", 1))
    seqs = store.sequences("main", 1)
    want = np.concatenate(
        [host_f16(r["features"]) for r in decoder.teacher_forced([ids.tolist() for ids, _, _ in seqs])]
    )
    assert stored.shape == (sum(len(ids) - 1 for ids, _, _ in seqs), tiny_target.model.config.hidden_size)
    np.testing.assert_allclose(stored.astype(np.float32), want.astype(np.float32), atol=2e-2, rtol=1e-2)
    assert all(store.has_features(s, k) for s in answers.STAGES for k in store.shards(s))

    store.features_path("main", 1).unlink()  # a fresh clone: ids committed, features not
    assert not store.has_features("main", 1)
    assert answers.relabel(store, tiny_target, log=lambda m: None) == 1
    np.testing.assert_allclose(np.load(store.features_path("main", 1)).astype(np.float32), stored, atol=2e-2)


def test_main_shards_caps_the_main_stage_in_all_so_a_rerun_writes_nothing(tmp_path, monkeypatch, tiny_target):
    monkeypatch.setattr(answers.sources, "build_pool", _pool)
    monkeypatch.setattr(answers, "SHARD_JOBS", 2)
    monkeypatch.setattr(answers.sources, "question_from_answer", lambda text: "Why is the sky blue?")
    store = answers.AnswerStore(tmp_path / "ids", tmp_path / "features")
    run = dict(stages=("questions", "main"), main_shards=2, batch=2, log=lambda m: None)
    assert answers.generate(store, tiny_target, max_shards=3, **run) == 3  # 2 question shards, then 1 of main
    assert answers.generate(store, tiny_target, **run) == 1, "resumed: main ends at 2 shards in all, not 2 more"
    assert [len(store.shards(s)) for s in ("questions", "main")] == [2, 2]
    assert answers.generate(store, tiny_target, **run) == 0


def test_the_source_pool_has_every_offline_kind_it_can_find():
    questions, pool = sources.build_pool(0, sizes=dict.fromkeys(sources.SOURCES[:6], 20), log=lambda m: None)
    kinds = {j.source for j in pool}
    assert "templates" in kinds and questions, "the generator and self-instruct need nothing installed"
    assert all(0 < len(j.text) <= sources.MAX_CHARS + 200 for j in pool)
    assert {j.temperature for j in pool} & {0.0} and {j.temperature for j in pool} - {0.0}, "greedy and sampled"


def _shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_ood_set_covers_the_categories_and_shares_no_text_with_training_sources():
    assert set(ood_categories()) >= {"multi_turn", "translation", "summarization", "qa", "math", "rag", "code"}
    ood = load_prompts("ood")
    assert all(len([p for p in ood if p.domain == f"ood/{c}"]) >= 8 for c in ood_categories())
    assert any(p.history for p in ood), "multi-turn prompts carry earlier turns"
    lists = sorted((REPO / "assets" / "draft-data" / "answers").glob("*.jobs.gz"))
    assert lists, "the committed job lists of the draft's data are missing"
    pool = [j for path in lists for j in sources.load_jobs(path)]
    assert len(pool) >= 20_000, "the draft's data answers at least 20,000 prompts"
    training = set().union(*(_shingles(" ".join([j.text, *(t for u in j.history for t in u)])) for j in pool))
    training |= set().union(*(_shingles(t) for t, _ in sources.sample_prompts(3000, seed=17)))
    for p in ood:
        shared = _shingles(" ".join([p.text, *(t for turn in p.history for t in turn)])) & training
        assert not shared, f"OOD prompt shares text with the training pool: {' '.join(next(iter(shared)))!r}"


def test_windows_count_answer_tokens_only_and_a_rebuilt_map_covers_them(tmp_path, monkeypatch, tiny_target):
    from dynatree_core.training.answers.windows import AnswerCorpus, answer_ids, coverage, frequency_map, token_counts

    monkeypatch.setattr(answers.sources, "build_pool", _pool)
    monkeypatch.setattr(answers, "SHARD_JOBS", 2)
    store = answers.AnswerStore(tmp_path / "ids", tmp_path / "features")
    answers.generate(store, tiny_target, stages=("questions",), batch=2, log=lambda m: None)
    data = AnswerCorpus(store, stages=("questions",), window=6, heldout=False)
    seqs = [s for k in store.shards("questions") for s in store.sequences("questions", k)]
    assert data.tokens() == sum(len(ids) - 1 for ids, _, _ in seqs), "every position with a feature, in windows"
    x, f, valid, answer = data.batch(np.arange(len(data)), torch.device("cpu"), with_loss_mask=True)
    for b, (_, _, _, start, length, plen, _) in enumerate(data.rows):  # prompt positions are context only
        want = [start + j + 1 >= plen and j < length for j in range(x.shape[1])]
        assert answer[b].tolist() == want, f"window {b}: the loss must count exactly the answer tokens"
    assert answer.any() and not answer.all()
    ids = answer_ids(store, ("questions",))
    vocab = tiny_target.model.config.vocab_size
    full = frequency_map(token_counts(store, vocab), len(set(ids.tolist())) + 1)
    assert coverage(full, ids) == 1.0, "a map of every answer token covers every answer token"
    assert coverage(frequency_map(token_counts(store, vocab), 2), ids) < 1.0


def test_the_recipe_runs_end_to_end_for_any_llama_target(tmp_path, monkeypatch, tiny_pair_dirs):
    """answers -> OOD answers -> vocabulary map -> KD training on the answers -> OOD report,
    through the training CLI, for a target given as --target (a tiny local model)."""
    import json

    from dynatree_core.training.__main__ import main

    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(answers.sources, "build_pool", _pool)
    monkeypatch.setattr(answers, "SHARD_JOBS", 2)
    monkeypatch.setattr(answers.sources, "question_from_answer", lambda text: "Why is the sky blue?")
    target = tiny_pair_dirs[0]
    main(["answers", "--target", target, "--batch", "4", "--dtype", "float32"])
    main(["ood-answers", "--target", target, "--dtype", "float32"])
    main(["vocab-map", "--target", target, "--sizes", "2048", "--current", "", "--out", str(tmp_path / "map")])
    run = tmp_path / "run"
    main(
        ["train-feature", "--data", "answers", "--target", target, "--token-map", str(tmp_path / "map")]
        + ["--loss", "kd", "--steps", "4", "--batch", "2", "--eval-every", "2", "--out", str(run)]
    )
    out = tmp_path / "quality.json"
    main(["feature-quality", "--answers", "--target", target, "--draft", str(run / "draft")]
         + ["--no-token-draft", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert len(report["out-of-distribution"][str(run / "draft")]["agreement_by_depth"]) == 4
    assert report["out-of-distribution"]["windows"] >= 64, "every OOD prompt's answer is measured"
    with pytest.raises(SystemExit, match="--dest"):  # never over the shipped draft of another target
        main(["export-feature", "--target", target, "--run", str(run)])
    stage2 = tmp_path / "stage-2"  # a second stage from the first one's weights (KD), as the recipe runs
    main(
        ["train-feature", "--data", "answers", "--target", target, "--token-map", str(tmp_path / "map")]
        + ["--init-from", str(run / "draft"), "--steps", "2", "--batch", "2", "--eval-every", "2", "--out", str(stage2)]
    )
    shipped = tmp_path / "shipped"
    main(["export-feature", "--target", target, "--run", str(stage2), "--dest", str(shipped)])
    staged = (shipped / "README.md").read_text()
    assert "| 1 (run) | kd | 4 |" in staged and "| 2 (this run) | kd | 2 |" in staged, staged
    assert "started from" not in staged.split("Trained in stages")[0], "the stage table names the start"
    assert "| random initialisation |" in staged and "| the previous stage |" in staged
    main(["export-feature", "--target", target, "--run", str(run), "--dest", str(shipped), "--quality", str(out)])
    card = (shipped / "README.md").read_text()
    assert "Trained in stages" not in card, "a one-stage run has no stage table"
    curve = json.loads((run / "curve.json").read_text())
    seen, positions = curve["curve"][-1]["seen"], curve["data"]["training_answer_positions"]
    assert seen > 0 and positions > 0 and f"{seen / positions:.2f} passes" in card
    assert "- loss (kd): smooth L1 to the target's next feature" in card
    assert "| **all** |" in card and "| out-of-distribution |" in card and "**this draft**" in card
    assert str(tmp_path) not in card, "the card names no path of the machine"
    from dynatree_core.drafts.feature import FeatureDraft

    FeatureDraft.load(shipped, load_model(target, device="cpu", dtype="float32").model)  # loads for that target


def test_a_bench_over_both_prompt_sets_reports_each_side_apart():
    from dynatree_core.measure.bench import BenchReport

    def row(label, domain, tps, tpi):
        return {"label": label, "domain": domain, "throughput_tps": tps, "tokens_per_iteration": tpi}

    rows = [row("ar", "chat", 10, 1), row("ar", "ood/qa", 10, 1), row("ar", "ood/math", 20, 1)]
    rows += [row("fixed_tree", "chat", 20, 3), row("fixed_tree", "ood/qa", 15, 2), row("fixed_tree", "ood/math", 30, 2)]
    lines = BenchReport({}, {}, [], rows).by_prompt_set()
    assert "| fixed_tree | 2.00 | 3.00 | 1.50 | 2.00 |" in lines, lines
    assert not BenchReport({}, {}, [], rows[:1] + rows[3:4]).by_prompt_set(), "one side only: no split table"
    assert {p.domain for p in load_prompts("chat,ood:qa")} == {"chat", "ood/qa"}


def test_sequences_read_each_member_once(tmp_path, monkeypatch):
    """A shard's sequences come from one read of each ids member: an NpzFile inflates a member on
    every access, so reading it per sequence made an 8192-job GPU shard take minutes (quadratic)."""
    store = answers.AnswerStore(tmp_path / "ids", tmp_path / "features")
    seqs = [(np.arange(i, i + 5 + i % 3), 2 + i % 2) for i in range(40)]
    store.write_ids("main", 0, seqs, ["debian"] * 40, np.full(40, np.nan, np.float16), 1000)
    reads = []
    real = np.lib.npyio.NpzFile.__getitem__
    monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", lambda self, key: reads.append(key) or real(self, key))
    got = store.sequences("main", 0)
    assert [(ids.tolist(), plen) for ids, plen, _ in got] == [(ids.tolist(), plen) for ids, plen in seqs]
    assert len(reads) == len(set(reads)) <= 4, reads
