"""Bundled prompt sets and user prompt files."""

import pytest

from dynatree_core.errors import DynaTreeError
from dynatree_core.prompts import bundled_sets, load_prompts


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
