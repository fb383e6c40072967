"""Policy comparison: the fairness protocol, the statistics, the correctness badge, the CLI and
the page."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import noisy_copy, tiny_model

from dynatree_core.core.sampling_config import SamplingConfig
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.decoding.pairs import ModelPair
from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.compare import Comparison, check_outputs, compare
from dynatree_core.measure.entries import Entry, labelled, run_schedule, schedule
from dynatree_core.runs.records import IterationRecord

PROMPT = [1, 5, 7, 9]


def tiny_pair():
    model = SimpleNamespace(model=tiny_model("llama"), tokenizer=None)
    draft = SimpleNamespace(model=noisy_copy("llama", 0.01), token_map=None)
    return ModelPair(target=model, draft=draft)  # stand-ins for LoadedModel: the fields compare reads


def test_schedule_warms_up_then_interleaves_rotated_rounds():
    plan = schedule(3, 4)
    assert plan[:3] == [(-1, 0, 0), (-1, 0, 1), (-1, 0, 2)]  # one warm-up per entry, first
    rounds = [[j for r, _, j in plan if r == k] for k in range(4)]
    assert all(sorted(r) == [0, 1, 2] for r in rounds)  # every entry once per round
    assert [r[0] for r in rounds] == [0, 1, 2, 0]  # no entry always runs first
    assert len(plan) == 3 + 3 * 4
    multi = schedule(2, 2, n_prompts=3, warmup=2)
    assert multi[:4] == [(-2, 0, 0), (-2, 0, 1), (-1, 0, 0), (-1, 0, 1)]
    assert [(r, i) for r, i, _ in multi[4:]] == [(r, i) for r in range(2) for i in range(3) for _ in range(2)]


def test_warm_up_results_are_discarded_and_rounds_share_seeds():
    calls = []

    def run_one(j, prompt, seed):
        calls.append((j, prompt, seed))
        return SimpleNamespace(j=j, prompt=prompt, seed=seed, warm=len(calls) <= 2)

    progress = []
    entries = [Entry("a", label="a"), Entry("b", label="b")]
    results = run_schedule(entries, 3, run_one, 10, lambda *a: progress.append(a), n_prompts=2)
    assert calls[:2] == [(0, 0, 10), (1, 0, 10)]
    assert [[[r.seed for r in rnd] for rnd in runs] for runs in results] == [[[10, 10], [11, 11], [12, 12]]] * 2
    assert [[r.prompt for r in rnd] for rnd in results[0]] == [[0, 1]] * 3
    assert not any(r.warm for runs in results for rnd in runs for r in rnd)  # the warm-up runs were dropped
    assert progress[0] == (1, 14, "a (warm-up)") and progress[-1][:2] == (14, 14)
    assert progress[2][2] == "a, prompt 1/2"


def test_labels_are_unique_and_name_what_differs():
    entries = labelled([Entry("fixed_tree"), Entry("fixed_tree", {"depth": 5}), Entry("fixed_tree"), Entry("salf")])
    assert [e.label for e in entries] == ["fixed_tree", "fixed_tree (depth=5)", "fixed_tree #2", "salf"]
    by_verifier = labelled([Entry("delayed", verifier="nss"), Entry("delayed", verifier="naive")])
    assert [e.label for e in by_verifier] == ["delayed@nss", "delayed@naive"]


def test_comparison_numbers_agree_with_running_each_policy_alone():
    pair = tiny_pair()
    config = DecodeConfig(max_new_tokens=12)
    entries = [Entry("linear", {"k": 3}), Entry("fixed_tree", {"depth": 3})]
    seen = []
    result = compare(pair, entries, PROMPT, config=config, repetitions=2, on_record=lambda *a: seen.append(a[0]))
    labels = [e.label for e in result.entries]
    assert labels == ["ar (our loop)", "hf_generate", "hf_static", "linear", "fixed_tree"]
    assert result.correctness["ok"] is True and result.correctness["checked"]
    assert all(s.exact == s.runs == 2 for s in result.entries) and result.entries[0].memory_overhead == 0.0
    assert (
        {"linear", "fixed_tree", "ar (our loop)"} <= set(seen) and "hf_generate" not in seen and "hf_static" not in seen
    )
    for stats, entry in zip(result.entries[3:], entries, strict=True):
        alone = generate(
            pair.target.model, PROMPT, make_method(entry.policy, entry.params), draft=pair.draft.model, config=config
        )
        assert stats.runs == 2 and stats.token_ids == [alone.token_ids] * 2
        assert stats.tokens_per_iteration == pytest.approx(alone.tokens_per_iteration)
        assert stats.iterations == alone.iterations and stats.acceptance_rate == pytest.approx(alone.acceptance_rate)
        assert len(stats.accepted_lengths) == 2 * alone.iterations
        assert stats.committed_per_iteration == [len(r.committed) for r in alone.records]
        assert stats.tree_size_max >= stats.tree_size_mean > 0
        # rows per verify forward: the chain (the prompt on the first) and the nodes, on the host batch
        rows = [r.chain_len + r.drafted for r in alone.records]
        assert stats.verify_rows_mean == pytest.approx(sum(rows) / len(rows))
        assert all(0 <= a <= 1 for a in stats.acceptance_by_depth)
        assert 0 < stats.outside_forwards_share < 1
        assert all(0 <= r.draft_forward_ms <= r.draft_ms for r in alone.records)
        assert any(r.draft_forward_ms > 0 for r in alone.records)
        # the drawn iteration: the first measured run's first later iteration of median accepted length
        sample = IterationRecord.from_dict(stats.sample["record"])
        later = sorted(len(r.accepted) for r in alone.records[1:])
        assert len(sample.accepted) == later[(len(later) - 1) // 2] and sample.index > 1
        assert set(sample.tree.tokens) <= {int(t) for t in stats.sample["texts"]}
    assert result.entries[1].sample is None, "a black box has no iteration to draw"
    best = max(e.throughput_tps for e in result.entries[:3])  # the fastest of the three references
    assert result.entries[3].speedup == pytest.approx(result.entries[3].throughput_tps / best)
    assert result.entries[2].policy == "hf_static" and result.entries[2].verifier == "hf"
    hf = result.entries[1]
    assert hf.tree_size_mean is None and hf.verifier == "hf" and hf.ttft_ms is None
    again = Comparison.from_json(result.to_json())
    assert again.to_dict() == result.to_dict()
    broken = json.loads(result.to_json())
    broken["entries"][3]["sample"]["record"]["accepted"] = [99]
    with pytest.raises(DynaTreeError, match="sample"):
        Comparison.from_dict(broken)
    rows = result.table()
    assert rows[1]["TTFT ms"] is None and rows[2]["TTFT ms"] is None and rows[3]["TTFT ms"] > 0
    assert result.csv().splitlines()[0].startswith("policy,family,verifier,tokens/s") and len(rows) == 5
    assert "| linear |" in result.markdown()


def test_badge_names_the_first_difference():
    ar = SimpleNamespace(policy="ar", label="ar (our loop)", token_ids=[[1, 2, 3, 4]])
    good = SimpleNamespace(policy="linear", label="linear", token_ids=[[1, 2, 3, 4]])
    bad = SimpleNamespace(policy="salf", label="salf", token_ids=[[1, 2, 3, 4], [1, 2, 9, 4]])
    assert check_outputs([ar, good], greedy=True)["ok"] is True
    verdict = check_outputs([ar, good, bad], greedy=True)
    assert verdict["ok"] is False and verdict["policy"] == "salf" and verdict["position"] == 2
    short = SimpleNamespace(policy="dyspec", label="dyspec", token_ids=[[1, 2]])
    assert check_outputs([ar, short], greedy=True)["position"] == 2
    assert check_outputs([ar, bad], greedy=False)["checked"] is False


def test_bad_requests_are_refused_before_running():
    pair = tiny_pair()
    with pytest.raises(DynaTreeError, match="1 to 6"):
        compare(pair, [Entry("linear")] * 7, PROMPT, config=DecodeConfig(max_new_tokens=4))
    with pytest.raises(DynaTreeError, match="no parameter"):
        compare(pair, [Entry("linear", {"depth": 2})], PROMPT, config=DecodeConfig(max_new_tokens=4))
    hot = DecodeConfig(max_new_tokens=4, sampling=SamplingConfig(temperature=0.8), verifier="specinfer")
    with pytest.raises(DynaTreeError, match="only 'nss' is lossless"):
        compare(pair, [Entry("eagle2")], PROMPT, config=hot)
    with pytest.raises(DynaTreeError, match="not a DynaTree comparison"):
        Comparison.from_json(json.dumps({"records": []}))


def test_sampled_comparison_is_not_checked_token_for_token():
    pair = tiny_pair()
    hot = DecodeConfig(max_new_tokens=6, sampling=SamplingConfig(temperature=0.8))
    result = compare(pair, [Entry("fixed_tree")], PROMPT, config=hot, repetitions=1, include_hf=False)
    assert result.correctness["checked"] is False and result.entries[1].verifier == "specinfer"


def test_cli_compare_json_schema_and_csv(tmp_path, capsys, tiny_pair_dirs):
    from dynatree_core.cli import main

    target, draft = tiny_pair_dirs
    out_csv = tmp_path / "table.csv"
    argv = ["compare", "--target", target, "--draft", draft, "--prompt", "hello", "--max-new-tokens", "6"]
    argv += ["--policy", "linear", "--policy", "fixed_tree:depth=3", "--repetitions", "2", "--json"]
    code = main([*argv, "--csv", str(out_csv)])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["version"] == 1 and data["correctness"]["ok"] is True
    assert [e["label"] for e in data["entries"]] == [
        "ar (our loop)",
        "hf_generate",
        "hf_static",
        "linear",
        "fixed_tree",
    ]
    fields = {f.name for f in dataclasses.fields(Comparison.from_dict(data).entries[0])}
    assert all(set(e) == fields for e in data["entries"])
    assert out_csv.read_text().startswith("policy,family,verifier,tokens/s")
    code = main(["compare", "--target", target, "--prompt", "hi", "--policy", "linear@naive"])
    assert code == 2 and "--verifier" in capsys.readouterr().err


def _custom_pair(at, dirs) -> None:
    """Pick the page's custom model pair: the tiny local target and draft."""
    next(s for s in at.selectbox if s.label == "Model pair").set_value("custom (hub id or local path)").run()
    next(t for t in at.text_input if t.label == "Target").set_value(dirs[0])
    next(t for t in at.text_input if t.label == "Draft").set_value(dirs[1])


def test_compare_page_runs_two_policies_and_shows_results(tiny_pair_dirs):
    from streamlit.testing.v1 import AppTest

    page = Path(__file__).resolve().parent.parent / "pages" / "1_Compare_Policies.py"
    at = AppTest.from_file(str(page), default_timeout=300)
    at.run()
    assert not at.exception, at.exception
    assert next(t for t in at.text_area if t.label == "Prompt").value.strip(), "the page opens with a prompt"
    _custom_pair(at, tiny_pair_dirs)
    next(n for n in at.number_input if n.label == "Policies to compare").set_value(2)
    next(s for s in at.slider if s.label == "Max new tokens").set_value(6)
    next(s for s in at.slider if s.label == "Repetitions").set_value(1)
    next(t for t in at.text_area if t.label == "Prompt").set_value("Tell me about trees")
    at.run()
    next(b for b in at.button if b.label == "Compare").click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    result = at.session_state["comparison"]
    assert [e.label for e in result.entries] == ["ar (our loop)", "hf_generate", "hf_static", "linear", "fixed_tree"]
    assert len(at.dataframe[0].value) == 5
    assert any("Exact" in s.value for s in at.success)
    assert len(at.get("plotly_chart")) >= 4


def test_benchmark_page_runs_a_sweep_and_shows_its_figure(tiny_pair_dirs):
    from streamlit.testing.v1 import AppTest

    page = Path(__file__).resolve().parent.parent / "pages" / "3_Benchmark.py"
    at = AppTest.from_file(str(page), default_timeout=300)
    at.run()
    assert not at.exception, at.exception
    _custom_pair(at, tiny_pair_dirs)
    at.radio[0].set_value("Sweep one policy's parameters").run()
    next(t for t in at.text_input if t.label == "Sweep").set_value("depth=2..3")
    next(s for s in at.slider if s.label == "Prompts (N)").set_value(1)
    next(s for s in at.slider if s.label == "Max new tokens").set_value(8)
    at.run()
    next(b for b in at.button if "Run benchmark" in b.label).click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    report, sweeps = at.session_state["bench_report"]
    assert [e.label for e in report.results][-2:] == ["fixed_tree depth=2", "fixed_tree depth=3"]
    charts = {c.key: json.loads(c.proto.spec) for c in at.get("plotly_chart")}
    assert sweeps == [("depth", ["2", "3"])] and "bench_sweep_depth" in charts
    assert any("fixed_tree depth=3" in m.value for m in at.markdown)
    speedup = {t["name"]: t["x"] for t in charts["bench_speedup"]["data"]}
    assert "fixed_tree depth=3" in speedup["this session's run"], "the visitor's run beside the shipped reports"
