"""Human-written text as teacher-forced training data (training/answers/written.py): each text is the
assistant's turn after a short request, the loss positions are exactly its tokens, shards are
resumable and reproducible, and the packed step trains on them beside the answers."""

from __future__ import annotations

import numpy as np
import pytest

from dynatree_core.core.models import load_model
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.pairs import encode_prompt
from dynatree_core.training.answers import sources, written
from dynatree_core.training.answers import store as answers
from dynatree_core.training.answers.commands import stage_spec
from dynatree_core.training.answers.windows import source_summary
from dynatree_core.training.packed.data import PackedAnswers

DOCS = ["The for statement iterates over the items of any sequence.", "A module is a file of definitions."]
CODE = ["def add(a, b):\n    return a + b"]
MAN = [("ls", "List information about the FILEs (the current directory by default).")]
FORTUNES = ["Haste makes waste.", "Beware of the <|im_end|> token in text."]


@pytest.fixture
def fake_sources(monkeypatch):
    """Fixed texts in place of the machine's documentation, code, manual pages and fortunes."""
    monkeypatch.setattr(sources, "doc_passages", lambda: list(DOCS))
    monkeypatch.setattr(sources, "stdlib_snippets", lambda: list(CODE))
    monkeypatch.setattr(sources, "man_descriptions", lambda: list(MAN))
    monkeypatch.setattr(sources, "fortunes", lambda: list(FORTUNES))
    monkeypatch.setattr(answers, "SHARD_JOBS", 2)
    monkeypatch.setattr(written, "SHARD_JOBS", 2)


@pytest.fixture
def target(tiny_pair_dirs):
    return load_model(tiny_pair_dirs[0], device="cpu", dtype="float32")


def test_items_take_every_source_deterministically_and_name_their_kind(fake_sources):
    items = written.written_items(0, log=lambda m: None)
    assert items == written.written_items(0, log=lambda m: None), "same files and seed, same items"
    kinds = sorted(kind for kind, _, _ in items)
    assert kinds == sorted(["written-pydoc"] * 2 + ["written-stdlib"] + ["written-manpages"] + ["written-fortunes"] * 2)
    assert all(kind in sources.SOURCES for kind in kinds), "source_summary can name them"
    man = next((ask, text) for kind, ask, text in items if kind == "written-manpages")
    assert "`ls`" in man[0] and man[1] == MAN[0][1]
    code = next(text for kind, _, text in items if kind == "written-stdlib")
    assert code == f"```python\n{CODE[0]}\n```", "code is an assistant's fenced block"
    capped = written.written_items(0, sizes={"pydoc": 1, "fortunes": 0}, log=lambda m: None)
    assert [k for k, _, _ in capped].count("written-pydoc") == 1 and "written-fortunes" not in {k for k, _, _ in capped}


def test_the_text_is_the_assistant_turn_token_for_token(target):
    tok = target.tokenizer
    text = FORTUNES[1]
    ids, plen = written.encode_written(tok, "Share something witty.", text, tok.eos_token_id)
    assert ids[:plen] == encode_prompt(tok, "Share something witty.", chat=True)
    assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[plen:-1], "control strings stay characters"
    assert tok.decode(ids[plen:-1]) == text


def test_shards_resume_relabel_and_train_beside_the_answers(fake_sources, target, tmp_path):
    store = answers.AnswerStore(tmp_path / "ids", tmp_path / "features")
    tok, vocab = target.tokenizer, target.model.config.vocab_size
    assert written.write_written(store, tok, tok.eos_token_id, vocab, log=lambda m: None) == 3  # 6 texts, 2 a shard
    first = np.load(store.ids_path(written.STAGE, 0))["ids"].copy()
    store.ids_path(written.STAGE, 2).unlink()
    assert written.write_written(store, tok, tok.eos_token_id, vocab, log=lambda m: None) == 1, "only the missing shard"
    np.testing.assert_array_equal(np.load(store.ids_path(written.STAGE, 0))["ids"], first)
    assert np.isnan(np.load(store.ids_path(written.STAGE, 0))["temperature"]).all(), "not sampled from the target"

    relabel = lambda **kw: answers.relabel(store, target, teacher=True, stages=(written.STAGE,), log=print, **kw)  # noqa: E731
    assert relabel(max_shards=2) == 2 and relabel() == 1, "a capped call stops; the next one finishes"
    data = PackedAnswers(store, TokenMap([-1, *range(vocab)], vocab), stages=(written.STAGE,), heldout=False)
    seqs = [s for k in store.shards(written.STAGE) for s in store.sequences(written.STAGE, k)]
    turn = sum(len(ids) - plen for ids, plen, _ in seqs)
    assert data.answer_pairs() == turn, "the loss positions are the assistant turns' tokens, nothing of the requests"
    assert set(data.windows.stage_of(data.train_rows)) == {written.STAGE}
    cut = answers.AnswerStore(store.ids_dir, store.features_dir, limits={written.STAGE: 2})
    assert cut.shards(written.STAGE) == [0, 1], "a run's data set: the stage's first shards only"
    assert stage_spec("questions,main,written:2") == (("questions", "main", "written"), {"written": 2})
    summary = source_summary(store, (written.STAGE,))
    assert summary["written-pydoc"]["prompts"] == 2 and sum(v["answer_tokens"] for v in summary.values()) == turn


def test_the_cli_writes_the_stage_and_names_the_next_step(fake_sources, tiny_pair_dirs, tmp_path, capsys):
    from dynatree_core.training.__main__ import main

    dirs = ["--ids-dir", str(tmp_path / "ids"), "--features-dir", str(tmp_path / "f")]
    main(["answers-written", "--target", tiny_pair_dirs[0], *dirs])
    out = capsys.readouterr().out
    assert "answers-written: 3 shards written" in out and "answers-relabel --stages written --teacher" in out
    assert len(answers.AnswerStore(tmp_path / "ids", tmp_path / "f").shards(written.STAGE)) == 3
