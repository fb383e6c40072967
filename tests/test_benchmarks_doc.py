"""BENCHMARKS.md is what benchmarks/benchmarks_doc.py writes from the committed reports: regenerating
it changes nothing, it stays short, every table names its reports and commands, a changed report
changes it, a GPU goal reads "unmeasured" only while no GPU report exists, and what no report holds
points at a real section of the log. Pure file work: no model, no timing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import ROOT, benchmarks_doc

DOC = ROOT / "BENCHMARKS.md"
LOG = ROOT / "docs" / "benchmark-log.md"
MAX_LINES, MAX_CELL_WORDS = 250, 40
CITED_TITLES = (  # code and docs cite these sections by name
    "Headline: prompts no draft trained on (OOD)",
    "Defaults fitted on OOD prompts (CPU)",
    "Draft quality: agreement with the target by depth",
    "Decoding speed by drafting policy (CPU)",
    "Verifiers under sampling (CPU)",
    "The engine: forwards, time outside them, draft levels, dtype, threads",
    "The engine's heart: what a reader follows, and what a level launches",
    "Candidates that cost no draft forward (CPU)",
    "Width invariance: bfloat16 trees token-identical to bfloat16 `ar` (CPU)",
    "GPU (lent H200 and H100) and captured forwards",
    "The live page against the CLI",
    "Draft training data",
    "The draft at scale: one GPU sitting",
    "Draft training throughput (CPU)",
)


@pytest.fixture(scope="module")
def committed() -> str:
    return DOC.read_text(encoding="utf-8")


@pytest.fixture
def assets_copy(tmp_path: Path) -> Path:
    """The reports the document reads, copied (figures and CSVs left behind)."""
    figures = shutil.ignore_patterns("*.png", "*.csv")
    shutil.copytree(ROOT / "assets" / "benchmarks", tmp_path / "benchmarks", ignore=figures)
    for name in (benchmarks_doc.SHIPPED_CURVE, benchmarks_doc.PACK):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "assets" / name, tmp_path / name)
    return tmp_path


def tables(text: str) -> list[tuple[int, list[str]]]:
    """Each markdown table: its last line's index and its rows' cells."""
    found, rows, lines = [], [], text.splitlines()
    for i, line in enumerate([*lines, ""]):
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            found.append((i - 1, rows))
            rows = []
    return found


def test_the_committed_file_is_what_the_committed_reports_give(committed):
    assert benchmarks_doc.render() == committed, (
        "BENCHMARKS.md is stale or edited by hand: run `PYTHONPATH=. .venv/bin/python -m benchmarks.benchmarks_doc`"
    )


def test_the_file_is_short_and_keeps_every_cited_section(committed):
    assert len(committed.splitlines()) <= MAX_LINES
    titles = re.findall(r"^## (.+)$", committed, flags=re.MULTILINE)
    assert titles == [t.title for t in benchmarks_doc.TOPICS], "one section per topic, in the topics' order"
    assert set(CITED_TITLES) <= set(titles), set(CITED_TITLES) - set(titles)


def test_every_table_cell_is_a_few_words(committed):
    found = tables(committed)
    assert len(found) >= 10, "the parser found the tables"
    long = [cell for _, rows in found for row in rows for cell in row if len(cell.split()) > MAX_CELL_WORDS]
    assert not long, long


def test_every_table_is_followed_by_its_reports_and_their_commands(committed):
    """Within a few lines of each table: a report that exists (a bench report under assets/benchmarks/,
    or a shipped draft's curve / the prompt pack's header) and the command that wrote it."""
    lines = committed.splitlines()
    for end, rows in tables(committed):
        after = " ".join(lines[end + 1 : end + 4])
        paths = re.findall(r"`(assets/[^`]+\.json)`", after)
        assert paths and all((ROOT / p).is_file() for p in paths), (rows[0], paths)
        assert re.search(r"`(PYTHONPATH=\. \.venv/bin/python -m|python -m|make) ", after), rows[0]
        assert "Measured " in after, f"{rows[0]}: the date and the machine"


def test_a_changed_report_changes_the_file_and_its_verdict(assets_copy, committed):
    assert benchmarks_doc.render(assets_copy) == committed, "the copy holds every report the file reads"
    headline = assets_copy / benchmarks_doc.HEADLINE
    report = json.loads(headline.read_text())
    report["passes"][benchmarks_doc.SHIPPED_PASS]["policies"]["salf"]["speedup_vs_faster_of_ar_hf"] = 1.95
    headline.write_text(json.dumps(report))
    changed = benchmarks_doc.render(assets_copy)
    assert changed != committed
    assert "| `salf` |" in changed and "1.95x, 1.85 |" in changed, "the table reads the report"
    verdict = "over the faster of `ar` / HF `generate` >= 1.70x: 1.95x (salf), **met**"
    assert verdict in changed and verdict not in committed, "the goal's verdict is computed, not typed"


def test_a_gpu_goal_is_unmeasured_only_while_no_gpu_report_exists(assets_copy):
    before = benchmarks_doc.render(assets_copy)
    goal = "- Goal: GPU, bfloat16: fixed_tree over `ar` >= 1.50x"
    assert f"{goal}: {benchmarks_doc.NO_GPU}" in before
    projected = "- Goal: GPU: `recycle` over `ar` >= 1.60x: unmeasured (no GPU lent); projected "
    assert projected in before and "a projection, not a measurement" in before, "said to be a projection"
    rows = [
        {"label": "ar (our loop)", "policy": "ar", "throughput_tps": 400.0, "draft_ms_per_iteration": 0.0},
        {"label": "fixed_tree", "policy": "fixed_tree", "throughput_tps": 640.0, "draft_ms_per_iteration": 0.5},
    ]
    report = assets_copy / "benchmarks" / "gpu-h200-2099-01-01-ood-bfloat16.json"
    report.write_text(json.dumps({"environment": {"gpu": "NVIDIA H200"}, "results": rows}))
    after = benchmarks_doc.render(assets_copy)
    assert f"{goal}: 1.60x (bfloat16), **met**" in after
    assert "fixed_tree's draft ms an iteration <= 0.60 ms: 0.50 ms (bfloat16), **met**" in after
    assert f"{projected}" not in after, "the newest bfloat16 report has no verify ms: nothing to project from"


def test_what_no_report_holds_names_a_section_of_the_log(committed):
    headings = re.findall(r"^#+ (.+)$", LOG.read_text(encoding="utf-8"), flags=re.MULTILINE)
    lines = [line for line in committed.splitlines() if line.startswith("- Not in a report")]
    cited = [heading for line in lines for heading in re.findall(r'\("([^"]+)"\)', line)]
    assert cited, "the file cites the log for the numbers no report holds"
    missing = [c for c in cited if not any(h.startswith(c) for h in headings)]
    assert not missing, missing


def test_the_log_keeps_the_hand_written_file():
    log = LOG.read_text(encoding="utf-8")
    kept = log.partition("\n## BENCHMARKS.md as it was before it was generated (2026-11-29)\n")[2]
    assert kept, "the log's last section holds the hand-written file"
    assert "\n### Benchmarks\n" in kept and "\n#### Headline: prompts no draft trained on (OOD)\n" in kept
    assert "\n##### How it moved\n" in kept and "\n## " not in kept, "its headings demoted under the section"


def test_check_passes_on_the_committed_file_and_fails_on_an_edited_one(tmp_path, capsys):
    assert benchmarks_doc.main(["--check"]) == 0
    edited = tmp_path / "BENCHMARKS.md"
    edited.write_text(DOC.read_text(encoding="utf-8").replace("**not met**", "**met**", 1), encoding="utf-8")
    assert benchmarks_doc.main(["--check", "--out", str(edited)]) == 1
    out = capsys.readouterr().out
    assert "BENCHMARKS.md is stale: 2 lines differ" in out and "+- Goal:" in out
