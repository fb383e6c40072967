"""The one-sitting GPU recipe (training/gpu/, `draft-gpu`) on the CPU with a tiny target and a tiny pack:
every stage runs, a stopped run resumes without redoing a stage, the export carries its card with the
pack's sources, follow-up jobs become two-turn conversations, and nothing is written outside the run."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from dynatree_core.core.models import load_model
from dynatree_core.errors import DynaTreeError
from dynatree_core.training.__main__ import main
from dynatree_core.training.answers import sources
from dynatree_core.training.answers.pack import write_pack
from dynatree_core.training.answers.store import AnswerStore
from dynatree_core.training.gpu import recipe

QUESTION = "Why is the sky blue?"


def _write_pack(path, n: int = 20, follow: int = 2) -> list[sources.Job]:
    """A pack of `n` short jobs over three sources; the first `follow` ask for one follow-up turn."""
    kinds = ("templates", "debian", "pydoc")
    jobs = [
        sources.Job(
            kinds[i % 3], f"Tell me about topic {i}.", i % 4 != 3, 0.0 if i % 2 else 0.7, 6, follow_ups=int(i < follow)
        )
        for i in range(n)
    ]
    counts = {k: sum(j.source == k for j in jobs) for k in kinds}
    lines = "\n".join(json.dumps(j.to_json(), ensure_ascii=False) for j in jobs)
    header = {
        "format": "dynatree-prompt-pack",
        "version": 1,
        "sha256_of_jobs": hashlib.sha256(lines.encode()).hexdigest(),
        "sources": {k: {"passages": c, "prompts": c, "chars": 30 * c} for k, c in counts.items()},
    }
    write_pack(path, header, jobs)
    return jobs


def _files(root) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A cache and a home of their own (the recipe must leave both empty), question writing that
    always yields one question (the tiny random target writes none) and 8 of the OOD prompts."""
    from dynatree_core.measure import prompt_sets

    for name in ("cache", "home"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sources, "question_from_answer", lambda text: QUESTION)
    every = prompt_sets.load_prompts
    monkeypatch.setattr(prompt_sets, "load_prompts", lambda name: every(name)[::8])
    return tmp_path


def _args(sandbox, target: str, *more: str) -> list[str]:
    """A budget the tiny stages never reach (they finish) and 2 s of training (a later flag wins)."""
    return ["draft-gpu", "--pack", str(sandbox / "pack.jsonl.gz"), "--out", str(sandbox / "run"),
            "--target", target, "--device", "cpu", "--dtype", "float32", "--batch-rows", "4", "--shard-jobs", "8",
            "--budget-s", "600", "--train-s", "2", "--ood-max-new", "4", *more]  # fmt: skip


def test_every_stage_runs_resumes_and_exports_only_under_the_run(sandbox, tiny_pair_dirs, monkeypatch, capsys):
    target = tiny_pair_dirs[0]
    _write_pack(sandbox / "pack.jsonl.gz")
    run = sandbox / "run"
    with pytest.raises(SystemExit) as stopped:  # a call out of time stops, saying a rerun continues it
        main(_args(sandbox, target, "--until", "answers", "--stop-after-s", "1e-9"))
    assert stopped.value.code == 3
    main(_args(sandbox, target, "--until", "answers"))
    book = json.loads((run / "stages.json").read_text())["stages"]
    assert book["answers"]["done"] and "follow" not in book, "--until answers stops after the answers"
    shards = {k: v for k, v in _files(run / "answers").items() if k.startswith("main_")}
    assert len([k for k in shards if k.endswith(".npz")]) == 3, "20 jobs in shards of 8"
    assert all(AnswerStore(run / "answers", run / "answer-features").has_teacher("main", k) for k in range(3)), (
        "the teacher is kept while decoding"
    )

    main(_args(sandbox, target, "--until", "relabel"))
    teacher = {k: v for k, v in _files(run / "answer-features").items() if k.endswith(".teacher.npz")}
    assert len(teacher) == 3 + 2 and any(k.startswith("follow1_") for k in teacher), "every answer shard's teacher"
    in_time = recipe.GpuRun.call_left
    monkeypatch.setattr(recipe.GpuRun, "call_left", lambda self: 0.3)  # a call with 0.3 s left when training starts
    with pytest.raises(SystemExit):
        main(_args(sandbox, target, "--train-s", "3"))
    monkeypatch.setattr(recipe.GpuRun, "call_left", in_time)
    stopped = json.loads((run / "stages.json").read_text())["stages"]["train"]
    assert not stopped["done"] and stopped["items"] >= 1 and (run / "train" / "checkpoint.pt").exists()
    capsys.readouterr()
    main(_args(sandbox, target, "--train-s", "3"))
    assert f"resumed at step {stopped['items']}" in capsys.readouterr().out, "training continues its checkpoint"
    after = _files(run)
    assert all(after[f"answers/{k}"] == t for k, t in shards.items()), "a resumed run does not answer again"
    assert all(after[f"answer-features/{k}"] == t for k, t in teacher.items()), "nor relabel again"

    summary = json.loads((run / "summary.json").read_text())
    assert all(summary["stages"][s]["done"] for s in recipe.STAGES), summary
    assert summary["stages"]["answers"]["tokens"] > 0 and summary["device"] == "cpu"
    assert 0 < summary["export_bytes"] <= recipe.EXPORT_MB * 2**20
    card = (run / "export" / "README.md").read_text()
    assert "The prompt pack" in card and "| templates | 7 | 7 | 210 | 9 |" in card, card  # + a question, a follow-up
    assert "| out-of-distribution |" in card and "draft-gpu" in card and str(sandbox) not in card and target not in card
    assert "train-packed" in card.split("## Compute")[1], "the card's compute comes from the run's own ledger"
    assert (run / "compute.jsonl").exists() and (run / "train" / "checkpoint.pt").exists()
    assert not any((sandbox / "cache").iterdir()) and not any((sandbox / "home").iterdir()), (
        "the recipe writes nothing outside its run directory"
    )
    assert {p.name for p in sandbox.iterdir()} == {"cache", "home", "pack.jsonl.gz", "run"}, "not even a ledger"
    main(_args(sandbox, target, "--train-s", "3"))
    assert _files(run) == after | {"summary.json": _files(run)["summary.json"]}, "a finished run does nothing again"

    book = json.loads((run / "stages.json").read_text())
    book["stages"]["export"]["done"] = False
    (run / "stages.json").write_text(json.dumps(book))
    monkeypatch.setattr(recipe, "EXPORT_MB", 1e-4)
    with pytest.raises(DynaTreeError, match="over the"):
        main(_args(sandbox, target))


def test_a_follow_up_job_becomes_a_two_turn_conversation(sandbox, tiny_pair_dirs):
    target = tiny_pair_dirs[0]
    jobs = _write_pack(sandbox / "pack.jsonl.gz", n=4, follow=2)
    main(_args(sandbox, target, "--until", "follow"))
    store = AnswerStore(sandbox / "run" / "answers", sandbox / "run" / "answer-features")
    tokenizer = load_model(target, device="cpu", dtype="float32").tokenizer
    asked = [s for k in store.shards("ask1") for s in store.sequences("ask1", k)]
    followed = [s for k in store.shards("follow1") for s in store.sequences("follow1", k)]
    assert len(asked) == len(followed) == 2, "one question and one answer per job asking for a follow-up"
    assert not store.shards("ask2"), "one round: no job asked for two"
    for (ids, plen, src), job in zip(followed, jobs[:2], strict=True):
        prompt = tokenizer.decode(ids[:plen])
        assert prompt.count("<|im_start|>user") == 2 and prompt.count("<|im_start|>assistant") == 2, prompt
        assert job.text in prompt and prompt.index(job.text) < prompt.index(QUESTION), "first turn, then the question"
        assert src == sources.SOURCES.index(job.source), "a follow-up keeps the source it continues"
        assert len(ids) > plen, "the target answered the follow-up question"
    assert np.load(store.features_path("follow1", 0)).shape[0] == sum(len(ids) - 1 for ids, _, _ in followed)


def test_prior_answers_are_relabelled_and_trained_on_beside_the_packs_own(sandbox, tiny_pair_dirs):
    """`--prior-answers`: an answer store's id shards (here an earlier run's) come in as stages
    `prior-S`, get their features and teacher in the relabel stage and are trained on; the card
    says how many answer tokens came from before and keeps the pack's table to the pack's answers."""
    import shutil

    target = tiny_pair_dirs[0]
    _write_pack(sandbox / "pack.jsonl.gz", n=8, follow=0)
    main(_args(sandbox, target, "--until", "answers", "--out", str(sandbox / "earlier")))
    prior = sandbox / "prior"
    prior.mkdir()
    for path in (sandbox / "earlier" / "answers").glob("main_*.npz"):
        shutil.copy(path, prior / path.name)
    shutil.copy(prior / "main_00000.npz", prior / "written_00003.npz")  # a second stage, shards as numbered
    with pytest.raises(SystemExit, match="no answer store at"):
        main(_args(sandbox, target, "--prior-answers", str(sandbox / "none")))
    main(_args(sandbox, target, "--prior-answers", str(prior)))
    run = sandbox / "run"
    store = AnswerStore(run / "answers", run / "answer-features")
    assert store.shards("prior-main") == [0] and store.shards("prior-written") == [3]
    assert all(store.has_features(s, k) and store.has_teacher(s, k) for s in ("prior-main", "prior-written")
               for k in store.shards(s))  # fmt: skip
    data = json.loads((run / "train" / "curve.json").read_text())["data"]
    assert data["prior"]["stages"] == ["prior-main", "prior-written"] and data["prior"]["answer_tokens"] > 0
    own = sum(row["answer_tokens"] for row in data["pack_answers"].values())
    assert sum(row["answer_tokens"] for row in data["sources"].values()) == own + data["prior"]["answer_tokens"]
    card = (run / "export" / "README.md").read_text()
    assert f"Also trained on {data['prior']['answer_tokens']:,} answer tokens made before this run" in card
    assert "--prior-answers prior" in card and str(sandbox) not in card, "the directory's name, no machine path"
    assert "| templates | 3 | 3 | 90 | 3 |" in card, "the pack's table counts the pack's own answers"


def test_the_teacher_kept_while_decoding_is_the_teacher_forced_one(tmp_path, tiny_pair_dirs, monkeypatch):
    from dynatree_core.training.answers import store as answer_store
    from dynatree_core.training.answers.decode_batch import BatchDecoder
    from dynatree_core.training.answers.store import decode_shard, relabel

    target = load_model(tiny_pair_dirs[0], device="cpu", dtype="float32")
    store = AnswerStore(tmp_path / "ids", tmp_path / "features")
    jobs = [
        sources.Job("pydoc", f"Say something about {w}.", i % 2 == 0, 0.7 * (i % 2), 5) for i, w in enumerate("abcde")
    ]
    decode_shard(store, BatchDecoder(target.model), target, "main", 0, jobs, batch=2, seed=0, teacher=True, log=print)
    kept = dict(np.load(store.teacher_path("main", 0)))
    store.teacher_path("main", 0).unlink()
    store.features_path("main", 0).unlink()
    copies, copy = [], answer_store.host_f16
    monkeypatch.setattr(answer_store, "host_f16", lambda t: copies.append(t.shape) or copy(t))
    assert relabel(store, target, teacher=True, stages=("main",), log=print) == 1
    assert len(copies) == 1, "a group's features come back in one copy, not one per sequence"
    forced = dict(np.load(store.teacher_path("main", 0)))
    loss = np.isfinite(forced["lse"])
    assert loss.any() and np.array_equal(np.isfinite(kept["lse"]), loss), "the same loss positions"
    np.testing.assert_allclose(kept["lse"][loss], forced["lse"][loss], rtol=1e-4)
    top, want = kept["logits"][loss].astype(np.float32), forced["logits"][loss].astype(np.float32)
    np.testing.assert_allclose(top, want, atol=2e-3)
    clear = want[:, 0] - want[:, 1] > 2e-3  # no near-tie at the top: the same argmax
    assert (kept["ids"][loss][clear, 0] == forced["ids"][loss][clear, 0]).all() and clear.any()


@pytest.mark.parametrize("limit", [["--budget-s", "1e-3"], ["--answer-tokens", "1"]], ids=["share", "token-goal"])
def test_the_answers_stop_at_their_share_of_the_budget_or_the_token_goal(sandbox, tiny_pair_dirs, limit):
    _write_pack(sandbox / "pack.jsonl.gz", follow=0)
    main(_args(sandbox, tiny_pair_dirs[0], "--until", "answers", *limit))
    book = json.loads((sandbox / "run" / "stages.json").read_text())["stages"]
    assert book["answers"]["done"] and book["answers"]["items"] == 1, "the first shard always, then no more"


def test_make_draft_gpu_runs_a_command_line_the_cli_accepts():
    import re
    import shlex
    import shutil
    import subprocess

    from dynatree_core.core.presets import REPO_ROOT
    from dynatree_core.training.__main__ import parser

    if shutil.which("make") is None:
        pytest.skip("no make")
    text = subprocess.run(["make", "-n", "draft-gpu"], capture_output=True, text=True, cwd=REPO_ROOT).stdout
    line = re.findall(r"-m dynatree_core\.training (draft-gpu .*)", re.sub(r"\\\n\s*", " ", text))
    assert len(line) == 1, text
    args = parser().parse_args(shlex.split(line[0]))
    assert args.budget_s == 1500 and args.pack.name == "prompt-pack.jsonl.gz" and args.until == "export"


def test_a_missing_or_broken_pack_is_one_line_naming_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="no prompt pack at .*prompt-pack"):
        main(["draft-gpu", "--pack", str(tmp_path / "none.jsonl.gz"), "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists(), "nothing is written for a run that cannot start"
    (tmp_path / "bad.jsonl.gz").write_text("not a pack\n")
    with pytest.raises(SystemExit, match="not a dynatree-prompt-pack file"):
        main(["draft-gpu", "--pack", str(tmp_path / "bad.jsonl.gz"), "--out", str(tmp_path / "run")])


def test_answer_profile_counts_the_decoding_it_profiles(tmp_path, tiny_pair_dirs):
    """benchmarks/answer_profile.py (the GPU sitting's look at the answers' time) on the CPU: its
    counts are the decoded rows' own, and the host table names the forward's ops."""
    from benchmarks import answer_profile

    jobs = _write_pack(tmp_path / "pack.jsonl.gz", n=6, follow=0)
    out = tmp_path / "profile.json"
    report = answer_profile.main(["--pack", str(tmp_path / "pack.jsonl.gz"), "--target", tiny_pair_dirs[0],
                                  "--device", "cpu", "--dtype", "float32", "--jobs", "6", "--batch", "4",
                                  "--profile-jobs", "3", "--profile-new", "2", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == report
    timed, profiled = report["timed"], report["profiled"]
    assert timed["jobs"] == 6 and 0 < timed["answer_tokens"] <= sum(j.max_new for j in jobs)
    assert timed["rows_per_step"] * timed["steps"] == pytest.approx(timed["answer_tokens"], abs=timed["steps"])
    eager = report["timed_eager"]  # the same jobs, the step not captured: the same greedy/seeded tokens
    assert eager["answer_tokens"] == timed["answer_tokens"] and eager["steps"] == timed["steps"]
    assert timed["speed_over_eager"] > 0
    assert profiled["jobs"] == 3 and profiled["answer_tokens"] <= 6 and profiled["device_busy_share"] is None
    assert report["device_top"] == [] and any("mm" in row["op"] for row in report["host_top"])


def test_train_profile_times_the_recipes_step_without_touching_the_run(sandbox, tiny_pair_dirs):
    """benchmarks/train_profile.py on the CPU: the recipe's training step over a run's answers, timed
    through the loop and then profiled, written to a scratch folder (the run's files stay as they were)."""
    from benchmarks import train_profile

    _write_pack(sandbox / "pack.jsonl.gz", follow=0)
    main(_args(sandbox, tiny_pair_dirs[0], "--until", "follow"))
    run = sandbox / "run"
    main(_args(sandbox, tiny_pair_dirs[0], "--until", "train"))  # the run's token map exists, as in a real run
    before = _files(run)
    report = train_profile.main(["--run", str(run), "--target", tiny_pair_dirs[0], "--device", "cpu",
                                 "--seconds", "1", "--profile-steps", "2", "--pairs-per-step", "16"])  # fmt: skip
    assert _files(run) == before, "the profile writes nothing into the run"
    timed, profiled = report["timed"], report["profiled"]
    assert timed["steps"] >= 1 and timed["pairs_per_s_by_block"] and all(r > 0 for r in timed["pairs_per_s_by_block"])
    assert timed["answer_pairs"] > 0 and profiled["steps"] >= 1 and profiled["device_busy_share"] is None
    assert report["device_top"] == [] and any("mm" in row["op"] for row in report["host_top"])
