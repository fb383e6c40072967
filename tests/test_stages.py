"""The stage view of one iteration (viz/stages.py): stages in order, the tree at each stage, the
target's choices, the accepted path, the cache slots commit keeps; drawn from records alone."""

from __future__ import annotations

from conftest import noisy_copy, tiny_model

from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.viz.stages import cache_slots, iteration_stages, stage_categories, stage_sentence
from dynatree_core.viz.tree import node_categories, tree_figure


def _records():
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.01)
    params = {"depth": 4, "branch": 3, "tau": 0.05, "budget": 6}  # prunes by threshold and budget
    result = generate(target, [1, 5, 7, 9, 11], make_method("fixed_tree", params), draft=draft,
                      config=DecodeConfig(max_new_tokens=30))  # fmt: skip
    return [r for r in result.records if len(r.order) > 1]


def test_stages_follow_the_iteration_and_end_at_commit():
    for rec in _records():
        kinds = [s.kind for s in iteration_stages(rec)]
        deepest = max(rec.tree.depths)
        assert kinds[:deepest] == ["draft"] * deepest and kinds[-1] == "commit"
        assert ("prune" in kinds) == any(not rec.tree.is_verified(n) for n in range(len(rec.tree)))
        assert ("bonus" in kinds) == (rec.bonus_token is not None)
        assert kinds.index("mask") < kinds.index("verify") < kinds.index("accept")


def test_each_stage_shows_the_tree_as_it_stood_then():
    recs = _records()
    assert any(rec.accepted for rec in recs) and any("prune" in [s.kind for s in iteration_stages(r)] for r in recs)
    for rec in recs:
        stages = iteration_stages(rec)
        for stage in stages:
            cats = stage_categories(rec, stage)
            if stage.kind == "draft":
                assert set(cats) == {n for n in range(len(rec.tree)) if rec.tree.depths[n] <= stage.depth}
            figure = tree_figure(rec, categories=cats, bonus=stage.kind in ("bonus", "commit"))
            drawn = sum(len(t.x) for t in figure.data if t.mode == "markers+text")
            assert drawn == len(cats) + (stage.kind in ("bonus", "commit") and rec.bonus_token is not None)
            assert stage_sentence(rec, stage)
        verify = stage_categories(rec, next(s for s in stages if s.kind == "verify"))
        assert all(verify[n] == "match" for n in rec.accepted), "every accepted node matched the target"
        last = rec.accepted[-1] if rec.accepted else 0
        assert not any(rec.tree.parents[n] == last and verify[n] == "match" for n in rec.order[1:]), (
            "a match below the last accepted node would have been accepted"
        )
        assert stage_categories(rec, stages[-1]) == node_categories(rec)
        assert str(len(rec.accepted)) in stage_sentence(rec, next(s for s in stages if s.kind == "accept"))


def test_commit_keeps_the_chain_and_exactly_the_accepted_slots():
    for rec in _records():
        slots = cache_slots(rec)
        row = {n: i for i, n in enumerate(rec.order)}
        kept_nodes = {s["slot"] for s in slots if s["what"] == "node" and s["kept"]}
        # the engine's compaction (engine._commit): root slot + row of each accepted node in the cache
        assert kept_nodes == {rec.prefix_len + row[n] for n in rec.accepted}
        chain = [s["slot"] for s in slots if s["what"] == "chain"]
        assert len(chain) == rec.chain_len and chain[-1] == rec.prefix_len, "the root is the chain's last slot"
        assert len(slots) == rec.chain_len + len(rec.order) - 1


def test_every_stage_caption_says_its_label_once():
    """The caption above the tree is the stage's label, then what happened: no word of the label is
    said again ("Commit. Commit: 2 token(s) join the text" said it twice). Tokens are shown
    neutrally here, so a token's own text cannot count."""
    import re

    from dynatree_core.live.run import LiveRun
    from dynatree_core.ui.replay import REPLAY_FILE
    from dynatree_core.viz.stages import stage_caption

    recs = [*_records(), *LiveRun.from_json(REPLAY_FILE.read_bytes()).records]
    kinds = set()
    for rec in recs:
        for stage in iteration_stages(rec):
            caption = stage_caption(rec, stage, decode=lambda tok: "tok")
            assert caption.startswith(f"**{stage.label.capitalize()}.** "), caption
            words = re.findall(r"[a-z]+", caption.lower())
            for word in re.findall(r"[a-z]+", stage.label):
                assert words.count(word) == 1, f"'{word}' said {words.count(word)} times: {caption}"
            kinds.add(stage.kind)
    assert kinds == {"draft", "prune", "mask", "verify", "accept", "bonus", "commit"}, "every kind of stage checked"
