"""`gpu-check` (measure/gpu_check.py): one line and exit 0 without CUDA; on a CPU with `--device cpu` the
same checks run on the padded forward (eager), so the command's logic is exercised here."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dynatree_core.cli import main
from dynatree_core.measure import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(capsys, tmp_path):
    assert main(["gpu-check", "--out", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA device" in out[0]
    assert not (tmp_path / "r.json").exists()


def test_the_checks_pass_on_the_padded_path_and_a_broken_one_fails(tmp_path, monkeypatch):
    lines = []
    report = gpu_check.gpu_check("cpu", embedded=False, out=tmp_path / "r.json", log=lines.append)
    # a CPU whose kernels fail width_verdict (the machine kind varies) must name the op, not pass
    named = {(r["pair"], r["check"].split()[1]) for r in report["checks"] if r["check"].startswith("invariant")}
    named = {key for key in named if ": a row's bits change" in _detail(report, *key)}
    failing = [r for r in report["checks"] if not r["ok"] and (r["pair"], r["check"].split()[-1]) not in named]
    assert not failing and (named or report["verdict"] == "pass"), failing
    checks = {(r["pair"], r["check"]) for r in report["checks"]}
    assert len(checks) == 27 and ("tiny qwen2", "fallback") in checks
    assert {("tiny mistral", "invariant bfloat16"), ("tiny llama", "policies float32")} <= checks
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == report["verdict"]
    assert "| tiny mistral | interleaved | yes |" in lines[-2]

    # a padded forward that lets tree nodes see their siblings: the checks must catch it
    real = gpu_check.graphs.PaddedForward.__call__

    def broken(self, rows, length, **k):
        return real(self, dataclasses.replace(rows, seen=torch.ones_like(rows.seen)), length, **k)

    monkeypatch.setattr(gpu_check.graphs.PaddedForward, "__call__", broken)
    target, draft = gpu_check.tiny_pair("llama", torch.device("cpu"))
    rows = gpu_check.pair_checks("broken", target, draft)
    assert not next(r for r in rows if r["check"] == "policies")["ok"]


@pytest.mark.parametrize(
    "shift, ok",
    [
        (lambda x: x.float().sum() * 1e-3, False),  # a row reads the other rows: nothing helps
        (lambda x: len(x) * 1e-2, True),  # other bits at every row count: calls of one shape help
    ],
    ids=["reads-other-rows", "every-row-count"],
)
def test_the_invariance_check_fails_when_a_kernel_changes_with_its_call(monkeypatch, shift, ok):
    """A head whose rows change with the other rows of the call: both the verdict and the path's
    bits must say no, in each dtype; one that changes with the row count only is run in calls of
    one shape (invariant.LINEAR_CALL_ROWS), the head alone, and the check says so."""
    from dynatree_core.forward import fastpath

    real = fastpath.LeanForward.__init__

    def shaky(self, *args, **kwargs):
        real(self, *args, **kwargs)
        head = self.head
        self.head = lambda x: head(x) + shift(x)

    monkeypatch.setattr(fastpath.LeanForward, "__init__", shaky)
    target, draft = gpu_check.tiny_pair("llama", torch.device("cpu"))
    rows = {r["check"]: r for r in gpu_check.invariance_checks("shaky", target, draft)}
    for dtype in ("float32", "bfloat16"):
        row = rows[f"invariant {dtype}"]
        assert row["ok"] == ok, row
        if ok:  # the head in calls of one shape (the others as this CPU's kernels need: float32 pads them)
            assert row["detail"].startswith("bitwise (") and "head in calls of 16 rows" in row["detail"], row
        else:
            assert row["detail"].startswith("head"), row


def test_a_device_that_does_not_exist_is_a_message(capsys):
    assert main(["gpu-check", "--device", "nonsense"]) == 2
    assert "is not a device" in capsys.readouterr().err


def _detail(report: dict, pair: str, dtype: str) -> str:
    return next(r["detail"] for r in report["checks"] if r["pair"] == pair and r["check"] == f"invariant {dtype}")


def test_the_measured_widths_are_reported_after_earlier_runs_chose(monkeypatch):
    """gpu-check measures each narrow bucket's width again even when earlier runs of the model
    already chose one (the choice is kept per model), so its report holds the replay timings."""
    import weakref

    from conftest import tiny_model
    from test_graphs import _force_capture

    from dynatree_core.forward import graphs

    _force_capture(monkeypatch)
    monkeypatch.setattr(graphs, "MEASURE_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(graphs, "_CHOSEN", weakref.WeakKeyDictionary())
    cost = {1: 1.0, 2: 3.0, 4: 3.0, 8: 5.0, 16: 4.0, 32: 2.0}
    monkeypatch.setattr(graphs.PaddedForward, "_replay_ms", lambda self, width: cost[width])
    model = tiny_model("llama")
    first = gpu_check.measured_widths(model, context=40)
    again = gpu_check.measured_widths(model, context=40)  # the model's widths are chosen by now
    assert first == again and first[8] == {"runs_at": 32, "replay_ms": {8: 5.0, 16: 4.0, 32: 2.0}}


def test_the_run_measures_count_round_trips_with_levels_on_the_device_and_on_the_host():
    """The default (levels and verify batch on the device) drains once per iteration; the verify
    batch built on the host adds the tree's read; levels on the host add one read per level."""
    target, draft = gpu_check.tiny_pair("llama", torch.device("cpu"))
    run = gpu_check.run_measures(target, draft, torch.device("cpu"))
    assert run["per_iteration"]["to_host"] <= 1 and run["per_iteration"].get("sync", 0) == 0, run
    batch, host = run["host_batch"]["per_iteration"], run["host_levels"]["per_iteration"]
    assert host["to_host"] > batch["to_host"] > run["per_iteration"]["to_host"], run
    # launches: the captured steps (stand-ins here) launch fewer ops than the same run's steps eagerly
    stepped, eager = run["launches"], run["eager_steps"]["launches"]
    assert stepped["replays"] > eager["replays"] > 0 and eager["ops"] > 2 * stepped["ops"], run
    assert run["eager_steps"]["per_iteration"] == run["per_iteration"], "the same reads either way"
    report = {"checks": [], "verdict": "pass", "device": "cpu", "name": "cpu", "measures": {"run": run}}
    table = gpu_check.verdict_table(report)
    assert "decided on the host" in table and "verify batch built on the host" in table
    assert "not captured instead" in table and "replays launched" in table


def test_a_check_that_raises_is_a_failed_row_and_the_report_is_written_after_each_stage(tmp_path, monkeypatch):
    """A stage that raises (as the embedded `bits` trace did on an H100) costs its own rows, not the
    report: the run goes on, the error is named in a failed row, and the JSON on disk holds every
    stage done so far (a run stopped at its time limit keeps them)."""
    out, seen = tmp_path / "r.json", []

    def checks(name, target, draft):
        seen.append(json.loads(out.read_text())["checks"] if out.exists() else [])
        return [{"pair": name, "check": "policies", "ok": True, "detail": ""}]

    def raising(name, target, draft):
        if name == "tiny qwen2":
            raise IndexError("index 2 is out of bounds for dimension 0 with size 1")
        return [{"pair": name, "check": "invariant float32", "ok": True, "detail": ""}]

    monkeypatch.setattr(gpu_check, "pair_checks", checks)
    monkeypatch.setattr(gpu_check, "invariance_checks", raising)
    report = gpu_check.gpu_check("cpu", embedded=False, out=out, log=lambda line: None)
    failed = [r for r in report["checks"] if not r["ok"]]
    assert [(r["pair"], r["check"]) for r in failed] == [("tiny qwen2", "invariance")]
    assert failed[0]["detail"] == "raised IndexError: index 2 is out of bounds for dimension 0 with size 1"
    assert len(report["checks"]) == 6 and report["verdict"] == "FAIL"
    assert [len(s) for s in seen] == [0, 2, 4], "each stage's rows on disk before the next stage"
    assert json.loads(out.read_text()) == report
