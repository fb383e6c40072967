"""Files the project ships (model cards, benchmark reports, docs) carry no paths of the machine
that made them: a reader's machine has no /root or /work, and a card should say how, not where."""

from __future__ import annotations

import re
from pathlib import Path

from dynatree_core.runs.environment import portable

REPO = Path(__file__).resolve().parent.parent
MACHINE_PATH = re.compile(r"(?<![\w.~])/(root|home/\w+|work)/")


def test_no_shipped_file_names_a_path_of_the_machine_that_made_it():
    shipped = [
        *REPO.glob("*.md"),
        *REPO.glob("assets/**/*.md"),
        *REPO.glob("assets/**/*.json"),
        *REPO.glob("docs/**/*.md"),
    ]
    offenders = [str(p.relative_to(REPO)) for p in shipped if MACHINE_PATH.search(p.read_text(errors="replace"))]
    assert not offenders, f"absolute machine paths in {offenders}"


def test_reports_record_paths_relative_to_the_repository_and_home():
    assert portable(f"--draft {REPO}/assets/models/x --out {Path.home()}/runs/a.json") == (
        "--draft assets/models/x --out ~/runs/a.json"
    )


CACHE_PATH = re.compile(r"~/|\.cache/")  # this machine's home or cache layout, not a name a reader can use


def test_no_shipped_model_card_names_a_home_or_cache_path():
    """A card and its curve name a run by its place under the cache root (`draft-runs/NAME/draft`),
    never by where this machine keeps that root (~/.cache/dynatree, or $DYNATREE_CACHE)."""
    cards = [*REPO.glob("assets/models/**/README.md"), *REPO.glob("assets/models/**/*.json")]
    assert len(cards) >= 6, "the glob found the shipped drafts' cards and curves"
    offenders = [
        f"{p.relative_to(REPO)}: {m.group(0)!r}"
        for p in cards
        for m in [CACHE_PATH.search(p.read_text(errors="replace"))]
        if m
    ]
    assert not offenders, offenders


def test_cards_record_runs_relative_to_the_cache_root(monkeypatch, tmp_path):
    for root in (Path.home() / ".cache" / "dynatree", tmp_path / "cache"):
        monkeypatch.setenv("DYNATREE_CACHE", str(root))
        for written in (f"{root}/draft-runs/long-feature/draft", portable(f"{root}/draft-runs/long-feature/draft")):
            assert portable(written, cache=True) == "draft-runs/long-feature/draft"
    assert portable(f"{Path.home()}/runs/a", cache=True) == "~/runs/a"  # outside the cache: as before


ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)  # \s: also across a line break


def _tracked_text_files() -> list[Path]:
    import subprocess

    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    out = []
    for name in names:
        path = REPO / name
        if path.suffix in {".py", ".md", ".toml", ".json", ".csv", ".txt", ".cfg", ".yml", ".jinja"} or path.name in {
            "Makefile",
            "run",
        }:
            out.append(path)
    return out


def test_names_and_docs_say_what_not_when():
    """No issue numbers in code, docstrings, test names, docs or reports: a reader has only the
    repository, where "issue 18" means nothing. Name the subject (or the BENCHMARKS section)."""
    files = _tracked_text_files()
    assert len(files) > 100, "the listing found the repository's files"
    offenders = [
        f"{p.relative_to(REPO)}: {m.group(0)!r}"
        for p in files
        if p.is_file() and p.name != "test_shipped_files.py"
        for m in [ISSUE_NUMBER.search(p.read_text(errors="replace"))]
        if m
    ]
    assert not offenders, offenders


def test_the_issue_number_check_sees_the_usual_spellings():
    for text in ("(issue 18)", "Issue 8: benchmarks", "issues 3 and 5", "issue #12", "issue19", "issue\n    19"):
        assert ISSUE_NUMBER.search(text), text
    assert not ISSUE_NUMBER.search("an issue with 3 tokens; tissue 4")


def test_the_readme_is_short_and_every_doc_it_links_exists_and_is_linked():
    """README: what it is, the two commands, a tour, the run-time picture, links (the glossary is
    docs/glossary.md); the rest is in docs/ by topic, each page reachable from the README, no link
    dangling."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    assert "make run" in readme and "make test" in readme and "](docs/glossary.md)" in readme
    links = set(re.findall(r"\]\(([^)#]+)\)", readme))
    assert all((REPO / link).exists() for link in links), [link for link in links if not (REPO / link).exists()]
    docs = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert docs and docs <= links, f"not linked from the README: {sorted(docs - links)}"


OUTSIDE = re.compile(r"\.\./shared|GPU_NOTES|EAGLE_LAYOUTS|ENGINEERING_NOTES")  # the developers' notes beside the repo


def test_nothing_shipped_points_outside_the_repository():
    """A reader gets the repository alone: no pointer to the notes kept beside it. The history log
    is the exception."""
    kept = {"docs/benchmark-log.md"}
    files = [*REPO.glob("dynatree_core/**/*.py"), *REPO.glob("benchmarks/*"), *REPO.glob("tests/*.py")]
    files += [*REPO.glob("docs/*.md"), *REPO.glob("*.md"), *REPO.glob("pages/*.py"), REPO / "app.py"]
    offenders = [
        f"{p.relative_to(REPO)}:{i}"
        for p in files
        if p.is_file() and str(p.relative_to(REPO)) not in kept and p.name != "test_shipped_files.py"
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not offenders, offenders
