"""What the pages open on before anything runs: reports the project ships (assets/benchmarks/),
read with no model loaded: a recorded comparison (Compare), a recorded lab experiment
(Verification Lab) and benchmark reports (Benchmark), each named by machine, date and command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import streamlit as st

from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.compare import Comparison
from dynatree_core.runs.validate_reports import check_bench_rows

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "benchmarks"
COMPARISONS = ("cpu-compare-papers.json", "gpu-compare-papers.json")  # the GPU one where a lent GPU recorded it
LAB = "cpu-lab-specinfer.json"
BENCH_REPORTS = (  # (file, short name): the CPU headline run and the lent GPUs' latest runs
    ("cpu-cost-free.json", "CPU float32"),
    ("gpu-h200-2026-11-27-3151fd5-ood-bfloat16.json", "H200 bfloat16"),
    ("gpu-h200-2026-11-27-3151fd5-ood-float32.json", "H200 float32"),
    ("gpu-h100-2026-11-27-fec8f4e-ood-bfloat16.json", "H100 bfloat16"),
)
SPLIT_REPORT = "gpu-h200-2026-11-27-3151fd5-ood-bfloat16.json"  # the iteration split the page draws


@st.cache_data(show_spinner=False)
def _shipped(name: str) -> dict | None:
    """A shipped report's JSON, or None when the file is missing or unreadable."""
    try:
        return json.loads((ASSETS / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def machine(env: dict | None) -> str:
    """Where a report ran, in words: the GPU on CUDA, else the CPU and its cores; then the dtype."""
    env = env or {}
    if env.get("gpu") and str(env.get("device", "")).startswith("cuda"):
        where = f"{env['gpu']} (lent)"
    else:
        where = f"{env.get('cpu', 'CPU')} ({env.get('cpu_count', '?')} cores)"
    return f"{where}, {env['dtype']}" if env.get("dtype") else where


def report_date(name: str, *fields: str) -> str:
    """A report's date: its own field, else the date in its file name, else "undated"."""
    found = next((f for f in fields if f), None) or re.search(r"\d{4}-\d{2}-\d{2}", name)
    return found if isinstance(found, str) else found.group(0) if found else "undated"


def about(name: str, env: dict | None, date: str, command: str) -> str:
    """One markdown line naming a report: file, machine, date, command."""
    line = f"`assets/benchmarks/{name}` · {machine(env)} · {date}"
    return line + (f" · `{command}`" if command else "")


def recorded_comparisons() -> list[tuple[str, Comparison]]:
    """The shipped comparisons that exist (CPU first), each with the words for its machine."""
    out = []
    for name in COMPARISONS:
        data = _shipped(name)
        try:
            result = Comparison.from_dict(data) if data else None
        except DynaTreeError:
            result = None
        if result is not None:
            out.append((name, result))
    return out


def recorded_lab() -> dict | None:
    """The shipped lab experiment (measure/lab.py lab_report), or None."""
    return _shipped(LAB)


def shipped_bench() -> list[dict]:
    """The shipped benchmark reports that exist: name, file, rows, environment, date, command."""
    out = []
    for name, short in BENCH_REPORTS:
        data = _shipped(name)
        try:
            rows = check_bench_rows(data) if data else None
        except ValueError:
            rows = None
        if rows:
            settings = data.get("settings", {})
            env, date = data.get("environment"), report_date(name, settings.get("date", ""))
            out.append({"name": short, "file": name, "rows": rows, "environment": env, "date": date,
                        "command": settings.get("command", "")})  # fmt: skip
    return out
