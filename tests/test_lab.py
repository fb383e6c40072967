"""The lab's report (measure/lab.py lab_report / lab_from_report) and its CLI (`lab --out`): a
recorded experiment reads back with the same statistic, and the command refuses what it cannot check."""

from __future__ import annotations

import json

import pytest
import torch

from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.lab import LAW_KEPT, LabResult, lab_from_report, lab_report


def test_a_report_reads_back_with_the_same_statistic_and_table():
    gen = torch.Generator().manual_seed(0)
    law = torch.softmax(torch.randn(5000, generator=gen) * 3, -1)
    draws = torch.multinomial(law, 1500, replacement=True, generator=gen).tolist()
    result = LabResult(law, draws, [], by_depth=[{"depth": 1, "expected": 0.5, "realised": 0.48, "iterations": 9}])
    report = json.loads(json.dumps(lab_report(result, lambda t: f"<{t}>", {"verifier": "specinfer"})))
    assert report["verifier"] == "specinfer" and report["vocab"] == 5000
    assert LAW_KEPT <= len(report["law"]) < 5000 and set(map(str, draws)) <= set(report["law"])
    back = lab_from_report(report)
    assert back.chi_square()[1] == result.chi_square()[1]
    assert back.chi_square()[0] == pytest.approx(result.chi_square()[0], rel=1e-5)
    assert float(back.target_law.sum()) == pytest.approx(1.0, abs=1e-5)
    assert back.table(lambda t: report["texts"][str(t)])[:5] == result.table(lambda t: f"<{t}>")[:5]
    assert back.depth_rows() == result.by_depth
    with pytest.raises(DynaTreeError, match="not a lab report"):
        lab_from_report({**report, "law": None})


def test_cli_lab_writes_a_report_the_page_reads(tmp_path, capsys, tiny_pair_dirs):
    from dynatree_core.cli import main

    target, draft = tiny_pair_dirs
    out = tmp_path / "lab" / "report.json"
    argv = ["lab", "--target", target, "--draft", draft, "--prompt", "hello", "--trials", "30"]
    assert main([*argv, "--policy", "fixed_tree:depth=2", "--verifier", "specinfer", "--out", str(out)]) == 0, (
        capsys.readouterr().err
    )
    assert "chi-square" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["verifier"] == "specinfer" and report["trials"] == 30 and len(report["first_tokens"]) == 30
    assert report["command"].startswith("python -m dynatree_core lab") and report["environment"]["device"] == "cpu"
    assert report["temperature"] == 0.8, "the lab samples by default"
    stat, dof = lab_from_report(report).chi_square()
    assert (stat, dof) == (pytest.approx(report["chi_square"], rel=1e-5), report["dof"])
    assert main([*argv, "--temperature", "0"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_with_a_feature_draft_every_step_drafts_a_tree_and_the_law_holds():
    """A feature draft has no features before the target's first forward; the lab warms it with a
    prefill of all but the context's last token, so each step verifies a real tree (not the
    prefill's root alone) and the first token still follows the target's law."""
    from conftest import tiny_model
    from test_feature_draft import feature_draft

    from dynatree_core.core.sampling_config import SamplingConfig
    from dynatree_core.decoding.engine import DecodeConfig
    from dynatree_core.decoding.methods import make_method
    from dynatree_core.measure.lab import chi_square_critical, run_lab

    target, draft = tiny_model("llama"), feature_draft("llama")
    config = DecodeConfig(max_new_tokens=6, sampling=SamplingConfig(temperature=1.0), verifier="specinfer")
    result = run_lab(target, [3, 9, 4, 1, 7], make_method("fixed_tree", {"tau": 0.0}), config, 300, draft=draft)
    assert all(rec.drafted > 0 and rec.draft_forwards > 0 for rec in result.records)
    assert all(rec.tree.tokens[0] == 7 for rec in result.records), "every tree is rooted at the context's last token"
    stat, dof = result.chi_square()
    assert stat < chi_square_critical(dof)
