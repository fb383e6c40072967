"""Bundled prompt sets and user prompt files."""

import pytest

from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.prompt_sets import bundled_sets, choose_prompts, load_prompts


def test_bundled_sets_cover_the_domains():
    assert {"chat", "encyclopedic", "narrative", "code", "repetitive"} <= set(bundled_sets())
    prompts = load_prompts("all")
    assert len(prompts) >= 30 and all(p.text.strip() for p in prompts)
    assert any(p.chat for p in prompts) and any(not p.chat for p in prompts)


def test_user_files_load_and_bad_files_are_named(tmp_path):
    txt = tmp_path / "mine.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert [p.text for p in load_prompts(str(txt))] == ["first prompt", "second prompt"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(DynaTreeError, match="bad.jsonl:1"):
        load_prompts(str(bad))
    with pytest.raises(DynaTreeError, match="unknown prompt set"):
        load_prompts("nope")


WIKI_RAW = (
    " \n = Valkyria Chronicles III = \n \n"
    + " Senjō no Valkyria 3 is a tactical role @-@ playing video game developed by Sega . " * 8
    + "\n \n = = Gameplay = = \n \n"
    + " As with previous games , the player controls a squad . " * 4
    + "\n = Stub = \n Too short .\n = Tower Building of the Little Rock Arsenal = \n"
    + " The Tower Building of the Little Rock Arsenal is a building in MacArthur Park . " * 8
    + "\n"
)


def test_wikitext_articles_split_at_titles_and_skip_stubs():
    from dynatree_core.measure.prompt_sets import wikitext_articles

    articles = list(wikitext_articles(WIKI_RAW.splitlines(keepends=True)))
    assert len(articles) == 2  # the stub is under MIN_DOCUMENT_CHARS
    assert articles[0].startswith("Senjō no Valkyria 3") and "= = Gameplay = =" in articles[0]
    assert "Valkyria Chronicles III" not in articles[0]  # the title line is not part of the text
    assert articles[1].startswith("The Tower Building")


def test_local_corpus_copies_use_the_same_preprocessing(tmp_path):
    raw = tmp_path / "wiki.test.raw"
    raw.write_text(WIKI_RAW, encoding="utf-8")
    prompts = load_prompts(f"wikitext2:{raw}")
    assert [p.domain for p in prompts] == ["wikitext2", "wikitext2"] and not any(p.chat for p in prompts)
    assert len(load_prompts(f"wikitext2:{raw}", limit=1)) == 1
    books = tmp_path / "pg19"
    books.mkdir()
    for i in range(3):
        (books / f"book{i}.txt").write_text(f"CHAPTER I. Book {i}. " + "It was a dark and stormy night. " * 2000)
    prompts = load_prompts(f"pg19:{books}", limit=2)
    assert [p.text[:24] for p in prompts] == ["CHAPTER I. Book 0. It wa", "CHAPTER I. Book 1. It wa"]
    assert all(len(p.text) <= 40_000 for p in prompts)  # a book is cut; L_max cuts further in bench
    with pytest.raises(DynaTreeError, match="not found"):
        load_prompts(f"wikitext2:{tmp_path / 'missing.raw'}")
    with pytest.raises(DynaTreeError, match="no .txt books"):
        load_prompts(f"pg19:{tmp_path / 'pg19' / '..' / 'pg19' / '..'}")


def test_hub_corpora_go_through_datasets_and_fail_clearly(monkeypatch):
    import sys
    import types

    calls = []

    def load_dataset(hub_id, config, split, streaming):
        calls.append((hub_id, config, split, streaming))
        if hub_id == "emozilla/pg19":
            return iter([{"text": "A book. " * 100}, {"text": "short"}, {"text": "Another book. " * 100}])
        return [{"text": line} for line in WIKI_RAW.splitlines(keepends=True)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    wiki = load_prompts("wikitext2", limit=5)
    assert len(wiki) == 2 and calls[-1] == ("Salesforce/wikitext", "wikitext-2-raw-v1", "test", False)
    books = load_prompts("pg19", limit=5)
    assert [p.text[:7] for p in books] == ["A book.", "Another"] and calls[-1][3] is True  # streamed

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(DynaTreeError, match=r"cannot load wikitext2 .*--prompts wikitext2:PATH"):
        load_prompts("wikitext2")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(DynaTreeError, match="needs the `datasets` package"):
        load_prompts("pg19")


def test_prompts_are_chosen_round_robin_over_the_domains(tmp_path):
    """One rule for the CLI's bench, the benchmark page and the dtype probe."""
    every = load_prompts("all")
    domains = list(dict.fromkeys(p.domain for p in every))
    first = choose_prompts("all", len(domains))
    assert [p.domain for p in first] == domains, "one prompt per domain before any domain's second"
    assert first[0] == every[0] and len(choose_prompts("all", 0)) == len(every)
    assert choose_prompts("all", 2 * len(domains))[len(domains)].domain == domains[0]
    second = choose_prompts("all", len(domains), skip=len(domains))  # a split with no prompt of the first
    assert second == choose_prompts("all", 2 * len(domains))[len(domains) :]
    assert not {p.text for p in second} & {p.text for p in first}
    path = tmp_path / "mine.txt"
    path.write_text("one\ntwo\nthree\n")
    assert [p.text for p in choose_prompts(str(path), 2)] == ["one", "two"]
