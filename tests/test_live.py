"""LiveRun: one iteration per step, the same tokens as a full run, settings frozen, replay."""

from __future__ import annotations

import threading

import pytest
from conftest import noisy_copy, tiny_model

from dynatree_core.drafting import make_policy
from dynatree_core.engine import DecodeConfig, generate
from dynatree_core.live import LiveRun


def test_stepping_reproduces_the_full_run_and_stops():
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    policy = make_policy("fixed_tree", {"depth": 3, "branch": 2})
    config = DecodeConfig(max_new_tokens=20)
    prompt = [5, 9, 11, 3]
    full = generate(target, prompt, policy, draft=draft, config=config)
    live = LiveRun.start(target, prompt, policy, draft=draft, config=config, settings={"policy": "fixed_tree"})
    lock = threading.Lock()
    steps = 0
    while live.step(lock) is not None:
        steps += 1
        assert len(live.records) == steps
        assert not lock.locked()
    assert live.done and live.step() is None
    assert live.token_ids == full.token_ids
    assert len(live.records) == full.iterations
    assert live.result().tokens_per_iteration == pytest.approx(full.tokens_per_iteration)


def test_settings_changes_are_reported_and_replay_round_trips():
    target, draft = tiny_model("gpt2"), noisy_copy("gpt2", 0.05)
    settings = {"policy": "linear", "k": 3, "max_new_tokens": 8}
    live = LiveRun.start(
        target,
        [1, 2, 3],
        make_policy("linear", {"k": 3}),
        draft=draft,
        config=DecodeConfig(max_new_tokens=8),
        settings=settings,
    )
    live.step()
    settings["k"] = 4  # the caller's dict changing later does not change the run's settings
    assert live.differs({"policy": "linear", "k": 4, "max_new_tokens": 8}) == ["k"]
    assert live.differs({"policy": "linear", "k": 3, "max_new_tokens": 8}) == []
    while live.step() is not None:
        pass
    live_decode = live.text  # no tokenizer given: placeholders, never remembered
    assert live_decode(7) == "<7>" and live.token_texts == {}
    replay = LiveRun.from_json(live.to_json(text="abc"))
    assert replay.done and replay.step() is None
    assert replay.token_ids == live.token_ids
    assert [r.tree.tokens for r in replay.records] == [r.tree.tokens for r in live.records]
    assert replay.settings == {"policy": "linear", "k": 3, "max_new_tokens": 8}


@pytest.mark.parametrize("bad", [b"not json", b"{}", b'{"policy": "x"}', b"[1, 2]"])
def test_import_rejects_files_that_are_not_runs(bad):
    with pytest.raises(ValueError, match="not a DynaTree run file"):
        LiveRun.from_json(bad)


def test_an_engine_error_ends_the_run():
    from dynatree_core.errors import DynaTreeError

    target = tiny_model("llama")
    live = LiveRun.start(
        target, list(range(1, 600)), make_policy("ar"), config=DecodeConfig(max_new_tokens=4), settings={}
    )
    with pytest.raises(DynaTreeError, match="context"):
        live.step()
    assert live.done and live.step() is None


def test_export_carries_token_texts_so_an_imported_run_shows_words():
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    calls = []

    def decode(tok):
        calls.append(tok)
        return f"w{tok}"

    live = LiveRun.start(
        target,
        [5, 9, 11],
        make_policy("fixed_tree", {"depth": 2, "branch": 2}),
        draft=draft,
        config=DecodeConfig(max_new_tokens=6),
        settings={},
        detokenize=decode,
    )
    while live.step() is not None:
        pass
    rec = live.records[0]
    assert live.text(rec.tree.tokens[1]) == f"w{rec.tree.tokens[1]}"
    assert live.text(rec.tree.tokens[1]) and calls.count(rec.tree.tokens[1]) == 1  # decoded once
    replay = LiveRun.from_json(live.to_json())
    every = {t for r in live.records for t in [*r.tree.tokens, *r.committed, *r.target_tokens]}
    assert all(replay.text(t) == f"w{t}" for t in every)
    assert replay.text(10**6) == f"<{10**6}>"
