"""The prompt pack (training/answers/pack.py): one file that reads back equal, the same for the same
machine and seed, every instruction kind, follow-up marks, counts that match, and no text of the
OOD prompt set."""

from __future__ import annotations

import gzip
import json
import random
import re

import pytest

from dynatree_core.measure.prompt_sets import load_prompts
from dynatree_core.training.answers import pack, sources
from dynatree_core.training.answers.passages import Passage, paragraph_runs, roff_glyphs

SMALL = dict(target_prompts=2000, max_files=30, log=lambda m: None)


@pytest.fixture(scope="module")
def built():
    """Two builds of the same small pack, made independently."""
    return pack.build_pack(0, **SMALL), pack.build_pack(0, **SMALL)


def test_the_pack_is_the_same_for_the_same_machine_and_seed(built):
    (header, jobs), (again, jobs_again) = built
    assert header == again and jobs == jobs_again, "two builds of one seed on one machine must be equal"
    other, _ = pack.build_pack(1, **SMALL)
    assert other["sha256_of_jobs"] != header["sha256_of_jobs"], "another seed draws other passages"


def test_the_file_reads_back_equal_and_is_one_gzip_of_json_lines(built, tmp_path):
    header, jobs = built[0]
    path = tmp_path / "pack.jsonl.gz"
    size = pack.write_pack(path, header, jobs)
    assert size == path.stat().st_size > 0
    lines = gzip.decompress(path.read_bytes()).decode().split("\n")
    assert json.loads(lines[0])["format"] == "dynatree-prompt-pack" and len(lines) == 1 + len(jobs)
    assert pack.read_pack(path) == (header, jobs)
    assert pack.write_pack(tmp_path / "again.jsonl.gz", header, jobs) == size
    assert (tmp_path / "again.jsonl.gz").read_bytes() == path.read_bytes(), "the bytes depend on nothing else"


def test_a_pack_whose_jobs_changed_is_refused(built, tmp_path):
    header, jobs = built[0]
    path = tmp_path / "pack.jsonl.gz"
    pack.write_pack(path, header, jobs[:-1])
    with pytest.raises(ValueError, match="digest"):
        pack.read_pack(path)
    (tmp_path / "plain.jsonl.gz").write_text('{"format": "dynatree-prompt-pack"}\n')
    with pytest.raises(ValueError, match="not a dynatree-prompt-pack file"):
        pack.read_pack(tmp_path / "plain.jsonl.gz")


def test_the_first_jobs_taken_read_back_as_a_pack_of_their_own(built, tmp_path):
    header, jobs = built[0]
    small, first = pack.take(header, jobs, 25)
    assert first == jobs[:25] and small["prompts"] == 25 and small["taken_from"] == header["sha256_of_jobs"]
    pack.write_pack(tmp_path / "smoke.jsonl.gz", small, first)
    assert pack.read_pack(tmp_path / "smoke.jsonl.gz") == (small, first)


def test_the_header_counts_are_the_jobs(built):
    header, jobs = built[0]
    assert header["prompts"] == len(jobs) >= 1900, "about target_prompts prompts"
    for source, stats in header["sources"].items():
        mine = [j for j in jobs if j.source == source]
        assert stats["prompts"] == len(mine) == sum(stats.get("kinds", {}).values()), source
        assert stats["chars"] == sum(len(j.text) for j in mine), source
    assert sum(header["instructions"].values()) == len(jobs)
    follow = {int(k): n for k, n in header["follow_ups"].items()}
    assert follow == {k: sum(j.follow_ups == k for j in jobs) for k in follow}
    rows = pack.source_table(header)
    assert [r["source"] for r in rows] == list(header["sources"]) and sum(r["prompts"] for r in rows) == len(jobs)


def test_every_instruction_kind_greedy_and_sampled_and_plain_text(built):
    header, jobs = built[0]
    assert set(header["instructions"]) == set(pack.INSTRUCTIONS), header["instructions"]
    assert {j.temperature for j in jobs} >= {0.0, 0.7, 1.0}
    assert any(not j.chat for j in jobs) and len({j.max_new for j in jobs}) >= 3
    assert all(j.source in sources.SOURCES for j in jobs)
    assert all(len(j.text) <= sources.MAX_CHARS + 300 for j in jobs), "a passage is cut at MAX_CHARS"
    assert len({(j.text, j.chat) for j in jobs}) == len(jobs), "no prompt twice (man pages of a family repeat)"


def test_a_missing_source_is_skipped_and_named_in_the_header(built):
    header, _ = built[0]
    for source, stats in header["sources"].items():
        assert stats["prompts"] > 0 or stats["skipped"], f"{source}: empty without saying why"
    assert header["sources"]["templates"]["prompts"] > 0, "the templates need nothing installed"


def test_about_one_chat_job_in_ten_asks_for_follow_ups(built):
    _, jobs = built[0]
    marked = [j for j in jobs if j.follow_ups]
    assert all(j.chat and j.follow_ups in (1, 2) for j in marked), "a follow-up is a chat turn"
    assert 0.05 < len(marked) / len(jobs) < 0.2 and {j.follow_ups for j in marked} == {1, 2}


def _ood_texts() -> list[str]:
    return [t for p in load_prompts("ood") for t in (p.text, *(s for turn in p.history for s in turn))]


def _shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_no_job_holds_text_of_the_ood_set(built):
    header, jobs = built[0]
    assert header["ood_checked"] and header["ood_texts"] == len(_ood_texts())
    texts = _ood_texts()
    ood = set().union(*map(_shingles, texts))
    for job in jobs:
        shared = _shingles(job.text) & ood
        assert not shared, f"{job.source} job shares OOD text: {' '.join(next(iter(shared)))!r}"
        assert not any(t in job.text for t in texts), f"{job.source} job holds an OOD prompt"


def test_the_ood_check_catches_a_passage_copied_from_the_ood_set():
    check = pack.OodCheck()
    text = load_prompts("ood:summarization")[0].text
    middle = " ".join(text.split()[20:30])
    assert check.shares(f"Explain this.\n\n{middle}") and not check.shares("Explain this.\n\nA cat sat on a mat.")
    short = min(_ood_texts(), key=len)
    assert check.shares(f"As they said: {short}")


def test_every_instruction_template_is_clear_of_the_ood_set():
    check = pack.OodCheck()
    for (kind, passage_kind), asks in pack.ASK.items():
        for ask in asks:
            filled = ask.format(text="x", desc="x", name="x", language="French")
            assert not check.shares(filled), f"{kind}/{passage_kind}: {ask!r}"


def test_fix_puts_one_small_bug_in_the_code():
    code = "def total(prices, tax):\n    if tax == 0:\n        return sum(prices)\n    return sum(prices) * tax\n"
    broken = {pack.break_code(code, random.Random(seed)) for seed in range(40)}
    assert code not in broken and None not in broken and len(broken) >= 3, "several kinds of bug"
    for b in broken:
        assert b.split("\n")[0] == code.split("\n")[0], "the signature is left alone"
        assert sum(x != y for x, y in zip(b.split("\n"), code.split("\n"), strict=True)) == 1, "one line changes"
    assert pack.break_code("def f():\n    pass", random.Random(0)) is None


def test_a_job_list_saved_before_follow_ups_existed_reads_and_hashes_the_same(tmp_path):
    old = {"source": "debian", "text": "What is foo?", "chat": True, "temperature": 0.0, "max_new": 256, "history": []}
    job = sources.Job.from_json(old)
    assert job.follow_ups == 0 and job.to_json() == old, "an unmarked job writes what it always wrote"
    marked = sources.Job.from_json(old | {"follow_ups": 2})
    assert marked.follow_ups == 2 and sources.Job.from_json(marked.to_json()) == marked
    path = tmp_path / "old.jobs.gz"
    path.write_bytes(gzip.compress(json.dumps(old).encode()))
    assert sources.load_jobs(path) == [job]


def test_share_out_gives_a_small_source_all_it_has_and_the_rest_evenly():
    assert pack.share_out({"a": 10, "b": 1000, "c": 1000, "d": 0}, 610) == {"a": 10, "b": 300, "c": 300}
    assert sum(pack.share_out({"a": 7, "b": 9}, 100).values()) == 16, "capacity caps the total"
    assert sum(pack.share_out({"a": 500, "b": 500, "c": 500}, 100).values()) == 100


def test_passage_helpers_cut_runs_and_read_accents():
    runs = paragraph_runs("\n\n".join(["word " * 40] * 5) + "\n\n=====\n\n")
    assert runs and all(300 <= len(r) <= sources.MAX_CHARS for r in runs)
    assert roff_glyphs(r"f\(:ur Gro\(sse \[u00E9]t\('e") == "für Große été"
    assert Passage("x").kind == "prose"


def test_the_cli_writes_the_pack_into_the_cache_and_prints_the_table(tmp_path, monkeypatch, capsys):
    from dynatree_core.training.__main__ import main

    code = "def area(width, height):\n    if width < 0:\n        return 0\n    return width * height\n"
    fake = {
        "templates": [Passage("Tell me about tides.", "prompt")],
        "pydoc": [],
        "stdlib": [Passage(code, "code")] * 3,
        "info": [Passage("Tides rise and fall twice a day because of the moon. " * 8)] * 4,
    }
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path))
    monkeypatch.setattr(pack, "read_passages", lambda max_files=None, log=print: fake)
    main(["prompt-pack", "--prompts", "30", "--seed", "3"])
    header, jobs = pack.read_pack(tmp_path / "draft-data" / "prompt-pack.jsonl.gz")
    assert header["seed"] == 3 and header["sources"]["pydoc"]["skipped"] and len(jobs) == header["prompts"] >= 20
    out = capsys.readouterr().out
    assert "pydoc: skipped" in out and "| info |" in out and "prompt-pack: " in out
