"""The latency profile: points for every (model, context, tokens), the cache restored between
timed forwards, every draft kind timed through its drafter's level step, JSON + HTML from the CLI."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_model

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.core.vocab import TokenMap
from dynatree_core.measure.latency import forward_ms, level_ms, profile
from dynatree_core.viz.bench import latency_figure


def test_profile_has_every_point_and_positive_times():
    seen = []
    points = profile(
        tiny_model("llama"), tiny_model("qwen2"), tokens=(1, 4), contexts=(8, 16), repeats=2,
        progress=lambda *a: seen.append(a),
    )  # fmt: skip
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
    from dynatree_core.forward.kv import KVState

    calls = []
    original = KVState.run

    def spy(self, rows):
        calls.append((self.length, self.cache.get_seq_length(), self.lean is not None))
        return original(self, rows)

    monkeypatch.setattr(KVState, "run", spy)
    forward_ms(tiny_model("llama"), context=10, new_tokens=3, repeats=3, settings=ForwardSettings(fast_forward=fast))
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


def test_cli_latency_times_a_feature_draft_pair(tmp_path, capsys, tiny_pair_dirs):
    """The default pair's draft is a head: `latency` times it instead of ending in a traceback."""
    from dynatree_core.cli import main
    from dynatree_core.core.models import load_model
    from dynatree_core.drafts.feature import FeatureDraft

    target_dir, _ = tiny_pair_dirs
    target = load_model(target_dir).model
    vocab = target.config.vocab_size
    FeatureDraft.from_target(target, TokenMap([-1, *range(1, vocab, 97)], vocab)).save(tmp_path / "head")
    argv = ["latency", "--target", target_dir, "--draft", str(tmp_path / "head"), "--tokens", "1,2"]
    assert main([*argv, "--contexts", "5", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(p["model"], p["new_tokens"]) for p in report["points"]][-2:] == [("draft", 1), ("draft", 2)]


def _heads():
    from dynatree_core.drafts.feature import FeatureDraft
    from dynatree_core.drafts.fused import FusedDraft

    target, token_map = tiny_model("llama"), TokenMap([-1, *range(1, 96, 3)], 96)
    return target, {
        "feature": FeatureDraft.from_target(target, token_map),
        "fused": FusedDraft.from_target(target, token_map, taps=(1, 1, 1)),
    }


@pytest.mark.parametrize("kind", ["feature", "fused"])
def test_a_head_is_timed_through_its_drafter_like_a_token_draft(kind):
    """A head is no transformers model (calling it as one raised `_forward_unimplemented()`): its
    points come from its drafter's level step, with the target's features it reads stood in for."""
    target, heads = _heads()
    points = profile(target, heads[kind], tokens=(1, 3), contexts=(6,), repeats=1)
    assert [(p.model, p.new_tokens) for p in points] == [("target", 1), ("target", 3), ("draft", 1), ("draft", 3)]
    assert all(p.ms > 0 for p in points)


@pytest.mark.parametrize("kind", ["token", "feature"])
def test_each_timed_level_has_its_nodes_and_starts_from_the_same_draft_cache(monkeypatch, kind):
    """One level of n nodes per timed call, each over the context's entries alone (the level's are
    dropped after it): else later repeats would read a growing cache."""
    from dynatree_core.drafts.session import Drafter

    target, heads = _heads()
    draft = tiny_model("qwen2") if kind == "token" else heads[kind]
    calls = []
    original = Drafter.expand_level

    def spy(self, tokens, parents, depth, **kw):
        calls.append((1 if tokens is None else len(tokens), self.kv.length, self.ancestors.shape[0]))
        return original(self, tokens, parents, depth, **kw)

    monkeypatch.setattr(Drafter, "expand_level", spy)
    level_ms(draft, 96, context=7, new_tokens=4, repeats=3)
    root, *levels = calls
    assert root[:2] == (1, 0), "the root's forward reads the context first"
    assert levels == [(4, 7, 1)] * 4, levels  # warm-up and 3 timed, each after the context and the root's row alone
