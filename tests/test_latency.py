"""The latency profile: points for every (model, context, tokens), the cache restored between
timed forwards, JSON + HTML from the CLI."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_model

from dynatree_core.runs.latency import forward_ms, profile
from dynatree_core.viz.bench import latency_figure


def test_profile_has_every_point_and_positive_times():
    models = {"target": tiny_model("llama"), "draft": tiny_model("qwen2")}
    seen = []
    points = profile(models, tokens=(1, 4), contexts=(8, 16), repeats=2, progress=lambda *a: seen.append(a))
    assert [(p.model, p.context, p.new_tokens) for p in points] == [
        (m, c, n) for m in ("target", "draft") for c in (8, 16) for n in (1, 4)
    ]
    assert all(p.ms > 0 for p in points) and seen[-1][:2] == (8, 8)
    assert len(latency_figure(points).data) == 4  # one line per model and context


@pytest.mark.parametrize("fast", [True, False])
def test_timed_forwards_start_from_the_same_cache(monkeypatch, fast):
    """Each repeat must see `context` cached tokens: the cache is cut back after every forward
    (else the later repeats would attend over a growing context). Checked on the lean forward
    and on the stock HF forward over the static cache."""
    from dynatree_core.core.kv import KVState

    calls = []
    original = KVState.forward

    def spy(self, *args, **kwargs):
        calls.append((self.length, self.cache.get_seq_length(), self.lean is not None))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KVState, "forward", spy)
    forward_ms(tiny_model("llama"), context=10, new_tokens=3, repeats=3, fast=fast)
    assert [c[:2] for c in calls] == [(0, 0)] + [(10, 10)] * 4  # prefill, warm-up, 3 timed
    assert all(c[2] == fast for c in calls), "the forward path asked for is the one timed"


def test_cli_latency_writes_json_and_a_plot(tmp_path, capsys, tiny_pair_dirs):
    from dynatree_core.cli import main

    target, draft = tiny_pair_dirs
    out = tmp_path / "latency.json"
    argv = ["latency", "--target", target, "--draft", draft, "--tokens", "1,4", "--contexts", "8", "--repeats", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {p["model"] for p in report["points"]} == {"target", "draft"} and len(report["points"]) == 4
    assert report["environment"]["torch_threads"] >= 1 and out.with_suffix(".html").stat().st_size > 1000
    assert "| target | 8 |" in capsys.readouterr().out
    assert main(["latency", "--tokens", "a,b"]) == 2
