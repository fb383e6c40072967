"""Files the project ships (model cards, benchmark reports, docs) carry no paths of the machine
that made them: a reader's machine has no /root or /work, and a card should say how, not where."""

from __future__ import annotations

import re
from pathlib import Path

from dynatree_core.environment import portable

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
