"""Importing comparison files (Compare Policies) and benchmark reports (Benchmark page): every value
is checked in its domain, a refused file gets one message naming the entry and the field, and
any file that is accepted draws on its page without an error (fuzzed with hypothesis)."""

from __future__ import annotations

import contextlib
import copy
import functools
import json

import pandas as pd
import pytest
from conftest import examples
from hypothesis import given
from hypothesis import strategies as st
from test_compare import PROMPT, tiny_pair
from test_trace_import import mutate_json

from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.compare import Comparison, compare
from dynatree_core.measure.entries import Entry
from dynatree_core.runs.validate_reports import check_bench_rows
from dynatree_core.viz import compare_figures
from dynatree_core.viz.reports import draft_cost_figure, speedup_figure, split_figure


@functools.cache
def saved_comparison() -> str:
    entries = [Entry("linear", {"k": 2}), Entry("fixed_tree", {"depth": 2})]
    return compare(tiny_pair(), entries, PROMPT, config=DecodeConfig(max_new_tokens=6), repetitions=1).to_json()


def bench_report() -> dict:
    rows = [
        {"label": "ar", "verifier": "greedy", "throughput_tps": 25.0, "throughput_std": 1.0, "speedup": 1.0},
        {"label": "fixed_tree", "verifier": "greedy", "throughput_tps": 33.0, "speedup": 1.32, "acceptance_rate": 0.6},
    ]
    return {"environment": {}, "settings": {}, "results": rows}


def draw_comparison(result: Comparison) -> None:
    """What the Compare Policies page draws from an imported comparison."""
    result.table()
    result.csv()
    result.markdown()
    compare_figures(result.entries)
    s = result.settings
    caption = (result.correctness["ok"], result.correctness["message"], s["max_new_tokens"], s["temperature"])
    outputs = [e.text or " ".join(map(str, e.token_ids[0][:40])) for e in result.entries]
    assert caption and outputs is not None and s["repetitions"] is not None


def draw_bench(data) -> None:
    """What the Benchmark page draws from a loaded report."""
    rows = [{"file": "r.json", **r} for r in check_bench_rows(data)]
    if rows:
        table = pd.DataFrame(rows)
        keep = ["file", "label", "verifier", "throughput_tps", "throughput_std", "speedup", "tokens_per_iteration"]
        assert len(table[[k for k in keep if k in table.columns]]) == len(rows)
        report = [("r.json", [r for r in check_bench_rows(data)])]
        speedup_figure(report), draft_cost_figure(report), split_figure(report[0])


def import_or_refuse(text: str) -> None:
    try:
        result = Comparison.from_json(text)
    except DynaTreeError:
        return
    draw_comparison(result)


def test_a_saved_comparison_imports_and_draws():
    result = Comparison.from_json(saved_comparison())
    draw_comparison(result)
    assert [e.label for e in result.entries][-2:] == ["linear", "fixed_tree"]


def test_comparison_values_outside_their_domain_are_refused_naming_entry_and_field():
    raw = json.loads(saved_comparison())
    cases = [
        ("throughput_tps must not be negative", lambda e: e.__setitem__("throughput_tps", -3.0)),
        ("acceptance_rate is 1.5", lambda e: e.__setitem__("acceptance_rate", 1.5)),
        ("acceptance_by_depth\\[depth 1\\]", lambda e: e.__setitem__("acceptance_by_depth", [2.0])),
        ("tpot_ms must be a finite number", lambda e: e.__setitem__("tpot_ms", "fast")),
        (
            "peak_memory_mb must be a finite number",
            lambda e: e.__setitem__("peak_memory_mb", None),
        ),  # found by make fuzz
        ("accepted_lengths", lambda e: e.__setitem__("accepted_lengths", [-1])),
        ("neither text nor token_ids", lambda e: (e.__setitem__("text", ""), e.__setitem__("token_ids", []))),
    ]
    for needle, mutate in cases:
        bad = copy.deepcopy(raw)
        mutate(bad["entries"][-1])
        with pytest.raises(DynaTreeError, match=f"entry {len(bad['entries']) - 1} \\('fixed_tree'\\): .*{needle}"):
            Comparison.from_json(json.dumps(bad))
    bad = copy.deepcopy(raw)
    del bad["settings"]["temperature"]
    with pytest.raises(DynaTreeError, match="settings.temperature"):
        Comparison.from_json(json.dumps(bad))


def test_benchmark_rows_outside_their_domain_are_refused():
    draw_bench(bench_report())
    for mutate, needle in [
        (lambda r: r.pop("label"), "has no label"),
        (lambda r: r.__setitem__("throughput_tps", float("nan")), "finite"),
        (lambda r: r.__setitem__("speedup", -1), "must not be negative"),
        (lambda r: r.__setitem__("acceptance_rate", 7), "a probability"),
    ]:
        data = bench_report()
        mutate(data["results"][1])
        with pytest.raises(ValueError, match=needle):
            check_bench_rows(data)


@pytest.mark.property
@examples(100)
@given(st.data())
def test_mutated_comparisons_are_refused_or_drawn(data):
    raw = json.loads(saved_comparison())
    mutate_json(data, [raw])
    import_or_refuse(json.dumps(raw))


@pytest.mark.property
@examples(150)
@given(st.data())
def test_mutated_benchmark_reports_are_refused_or_drawn(data):
    raw = bench_report()
    mutate_json(data, [raw])
    with contextlib.suppress(ValueError):  # refused: fine; accepted: it must draw
        draw_bench(json.loads(json.dumps(raw)))
