"""The pages open on results: with nothing clicked and no model loaded, Compare draws a recorded
comparison (its charts and one tree per policy, from the report's own token texts), the
Verification Lab a recorded experiment, and Benchmark the shipped reports (ui/recorded.py). The
Lab also runs on a prompt and pair of its own, with no live run in the session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import pick_custom_pair
from streamlit.testing.v1 import AppTest

from dynatree_core.ui import recorded

PAGES = Path(__file__).resolve().parent.parent / "pages"


def _open(name: str) -> AppTest:
    at = AppTest.from_file(str(PAGES / name), default_timeout=120)
    at.run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    return at


def _specs(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def test_compare_opens_on_the_recorded_comparison_with_a_tree_per_policy():
    (name, result), *_ = recorded.recorded_comparisons()
    at = _open("1_Compare_Policies.py")
    assert any("recorded comparison" in i.value for i in at.info)
    stepped = [e for e in result.entries if e.sample and not e.reference]
    assert len(stepped) >= 4, "the shipped comparison carries a drawn iteration per policy"
    specs = _specs(at)
    assert len(specs) >= 2 + len(stepped)  # throughput, committed, then the trees
    assert any(str(result.date) in m.value and name in m.value for m in at.caption), "machine, date, command"
    assert "comparison" not in at.session_state, "the recorded view is not the visitor's result"


def test_the_lab_opens_on_the_recorded_experiment_and_runs_a_prompt_of_its_own(tiny_pair_dirs):
    at = _open("2_Verification_Lab.py")
    assert any("recorded experiment" in i.value for i in at.info)
    report = recorded.recorded_lab()
    assert at.metric[0].value == str(report["trials"])
    assert len(_specs(at)) == 2, "the histogram and acceptance by depth"
    pick_custom_pair(at, *tiny_pair_dirs)
    assert not any(r.label == "Context" for r in at.radio), "no live run: the page's own prompt"
    next(t for t in at.text_area if t.label == "Prompt").set_value("Tell me about trees")
    next(s for s in at.slider if s.label == "Repetitions").set_value(20).run()
    next(b for b in at.button if "Run the lab" in b.label).click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    verifier, result, texts = at.session_state["lab"]
    assert verifier == "specinfer" and len(result.first_tokens) == 20 and texts
    assert not any("recorded experiment" in i.value for i in at.info), "the visitor's result replaces it"


def test_benchmark_opens_on_the_shipped_reports_with_their_machines():
    shipped = recorded.shipped_bench()
    assert {r["name"] for r in shipped} >= {"CPU float32", "H200 bfloat16"}
    at = _open("3_Benchmark.py")
    assert any("Shipped reports" in i.value for i in at.info)
    speedup, cost, split = _specs(at)[:3]
    assert {t["name"] for t in speedup["data"]} == {r["name"] for r in shipped}
    assert all(t["type"] == "bar" for t in split["data"]) and len(split["data"]) == 3  # draft, verify, outside
    listed = " ".join(m.value for m in at.caption)
    assert all(r["file"] in listed and r["date"] in listed for r in shipped)


@pytest.mark.parametrize("name", ["machine", "date"])
def test_a_report_is_named_by_its_machine_and_date(name):
    env = {"cpu": "AMD EPYC", "cpu_count": 2, "gpu": None, "device": "cpu", "dtype": "float32"}
    gpu = {**env, "gpu": "NVIDIA H200", "device": "cuda"}
    if name == "machine":
        assert recorded.machine(env) == "AMD EPYC (2 cores), float32"
        assert recorded.machine(gpu) == "NVIDIA H200 (lent), float32"
    else:
        assert recorded.report_date("gpu-h200-2026-11-27-ood.json") == "2026-11-27"
        assert recorded.report_date("cpu.json", "2026-11-29") == "2026-11-29"
        assert recorded.report_date("cpu.json") == "undated"


def test_compare_shows_the_cpu_and_a_gpu_recording_side_by_side_when_both_exist(tmp_path, monkeypatch):
    """With a GPU comparison beside the CPU one (a copy, its environment a lent H200 here), the
    page opens on both machines' speedups in one figure, then a tab per machine."""
    import shutil

    (cpu_name, _), *_ = recorded.recorded_comparisons()
    data = json.loads((recorded.ASSETS / cpu_name).read_text())
    data["environment"] = {**data["environment"], "gpu": "NVIDIA H200", "device": "cuda", "dtype": "bfloat16"}
    shutil.copy(recorded.ASSETS / cpu_name, tmp_path / cpu_name)
    (tmp_path / "gpu-compare-papers.json").write_text(json.dumps(data))
    monkeypatch.setattr(recorded, "ASSETS", tmp_path)
    recorded._shipped.clear()
    try:
        at = _open("1_Compare_Policies.py")
    finally:
        recorded._shipped.clear()
    machines = next(json.loads(c.proto.spec) for c in at.get("plotly_chart") if c.key == "rec_machines")
    assert [t["name"] for t in machines["data"]] == ["AMD EPYC (2 cores), float32", "NVIDIA H200 (lent), bfloat16"]
    assert len(at.tabs) == 2
