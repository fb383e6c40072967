"""The Streamlit front page renders and builds its widgets from the policy registry."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import pick_custom_pair
from streamlit.testing.v1 import AppTest

from dynatree_core.errors import DynaTreeError


def test_front_page_renders_with_policy_sliders():
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    assert at.title[0].value.endswith("DynaTree Explorer")
    labels = {s.label for s in at.slider}
    assert {"depth", "branch", "budget"} <= labels, labels
    next(s for s in at.selectbox if s.label == "Policy").set_value("linear").run()
    assert "k" in {s.label for s in at.slider}


@pytest.mark.slow
def test_one_step_with_the_embedded_pair_draws_a_tree_and_a_mask():
    import json

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=300)
    at.run()
    next(b for b in at.button if "Step" in b.label).click().run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    tree = next(c for c in charts if any(t.get("name") == "root" for t in c["data"]))
    nodes = sum(len(t["customdata"]) for t in tree["data"] if t.get("mode") == "markers+text")
    rec = at.session_state["run"].records[-1]
    # every node of the record drawn once, plus the bonus token (the default feature draft's first
    # iteration is the prefill: a root-only tree, so exactly root + bonus here)
    assert nodes == len(rec.tree.tokens) + 1 == 2, (nodes, len(rec.tree.tokens))
    assert any(t["type"] == "heatmap" for c in charts for t in c["data"])
    assert at.metric[0].label == "Tokens / iteration"


def _click(at: AppTest, label: str) -> AppTest:
    return next(b for b in at.button if label in b.label).click().run()


def test_step_with_a_tiny_local_pair_draws_every_node(tiny_pair_dirs):
    import json

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    _click(at, "Step")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    run = at.session_state["run"]
    assert len(run.records) == 1
    rec = run.records[0]
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    tree = next(c for c in charts if any(t.get("name") == "root" for t in c["data"]))
    nodes = sum(len(t["customdata"]) for t in tree["data"] if t.get("mode") == "markers+text")
    assert nodes == len(rec.tree) + (rec.bonus_token is not None)
    heat = next(t for c in charts for t in c["data"] if t["type"] == "heatmap")
    assert len(heat["z"]) == len(rec.order)
    _click(at, "Step")
    assert len(at.session_state["run"].records) == 2


@pytest.mark.parametrize(
    "target,needle",
    [("", "Enter a target model"), ("./no/such/model/dir", "not found")],
)
def test_bad_model_inputs_show_an_error_not_a_traceback(target, needle):
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, target, "")
    _click(at, "Step")
    assert not at.exception, at.exception
    assert any(needle in e.value for e in at.error), [e.value for e in at.error]


def test_explanation_and_glossary_follow_the_iteration(tiny_pair_dirs):
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    _click(at, "Step")
    rec = at.session_state["run"].records[0]
    md = " ".join(m.value for m in at.markdown)
    assert f"{len(rec.accepted)} tokens" in md and "one forward" in md
    assert "bonus token" in md and "| accepted path |" in md  # the glossary table (docs/glossary.md)


def test_ar_reference_turns_throughput_into_speedup(tiny_pair_dirs):
    import json

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    _click(at, "Step")
    _click(at, "Measure AR reference")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    trace = next((t for c in charts for t in c["data"] if t.get("name") == "speedup vs AR"), None)
    assert trace is not None, "the throughput chart turned into a speedup chart"
    (ar_tps,) = at.session_state["ar_tps"].values()
    (refs,) = at.session_state["ar_refs"].values()
    assert set(refs) == {"ar", "hf_static"} and ar_tps == max(tps for tps, _ in refs.values()), "the faster reference"
    assert refs["hf_static"][1].startswith("hf+static"), "the static-cache reference says how it ran"
    rec = at.session_state["run"].records[0]
    assert ar_tps > 0 and trace["x"] == [1]
    assert trace["y"] == pytest.approx([1000 * len(rec.committed) / rec.wall_ms / ar_tps]), "run tokens/s over AR's"


@pytest.mark.parametrize("button", ["Step", "Run"])  # Run: the error is raised in the worker thread
def test_a_prompt_longer_than_the_context_is_an_error_and_keeps_the_inputs(tiny_pair_dirs, button):
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    at.text_area[0].set_value("word " * 2000).run()  # the tiny target has 512 positions
    next(b for b in at.button if b.label == button).click().run()
    assert not at.exception, at.exception
    assert any("context" in e.value for e in at.error), [e.value for e in at.error]
    assert at.session_state["run"] is None
    assert at.text_area[0].value == "word " * 2000
    assert next(t for t in at.text_input if t.label == "Target").value == tiny_pair_dirs[0]


def test_every_policy_renders_its_parameters():
    from dynatree_core.decoding.methods import catalogue

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=60)
    at.run()
    for name, cls in catalogue().items():
        next(s for s in at.selectbox if s.label == "Policy").set_value(name).run()
        assert not at.exception, (name, at.exception)
        labels = {w.label for w in [*at.slider, *at.number_input, *at.toggle]}
        assert {p.name for p in cls.params} <= labels, name


def test_a_black_box_baseline_runs_once_and_shows_its_result(tiny_pair_dirs):
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    next(s for s in at.selectbox if s.label == "Policy").set_value("hf_assisted").run()
    next(s for s in at.slider if s.label == "Max new tokens").set_value(8).run()
    _click(at, "Run baseline")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    assert at.metric[4].label == "New tokens" and int(at.metric[4].value) == 8


def test_every_tree_policy_steps_in_the_app_with_a_tiny_pair(tiny_pair_dirs):
    from dynatree_core.drafting import POLICIES

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    for name in POLICIES:  # the drafting policies (the baselines run as one call, above)
        next(s for s in at.selectbox if s.label == "Policy").set_value(name).run()
        _click(at, "Reset")
        _click(at, "Step")
        assert not at.exception and not at.error, (name, at.exception, [e.value for e in at.error])
        run = at.session_state["run"]
        assert run.policy_name == name and len(run.records) == 1


def test_sampling_settings_reach_the_engine_and_bad_pairings_show_an_error(tiny_pair_dirs):
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    next(s for s in at.slider if s.label == "Temperature").set_value(0.8).run()
    next(s for s in at.selectbox if s.label == "Verifier").set_value("specinfer").run()
    _click(at, "Step")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    assert at.session_state["run"].settings["temperature"] == 0.8
    assert any("`specinfer` verifier walked down" in m.value for m in at.markdown)
    _click(at, "Reset")
    next(s for s in at.selectbox if s.label == "Policy").set_value("eagle2").run()
    _click(at, "Step")
    assert not at.exception
    assert any("only 'nss' is lossless" in e.value for e in at.error)


def test_traversal_trace_expected_acceptance_and_the_verification_lab(tiny_pair_dirs):
    """A sampled run shows its verification trace and expected vs realised acceptance; the lab page
    repeats the step on the run's context and compares the histogram with the target."""
    import json

    root = Path(__file__).resolve().parent.parent
    at = AppTest.from_file(str(root / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    next(s for s in at.selectbox if s.label == "Policy").set_value("delayed").run()
    next(s for s in at.slider if s.label == "Temperature").set_value(0.8).run()
    next(s for s in at.selectbox if s.label == "Verifier").set_value("traversal").run()
    _click(at, "Step")
    _click(at, "Step")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    run = at.session_state["run"]
    rec = run.records[-1]
    assert rec.verifier == "traversal" and rec.analysis["0"]["reach"] == 1.0
    from dynatree_core.viz import node_details

    assert "reach probability" in node_details(rec, rec.order[-1], run.text)
    assert any("walked up from the leaves" in m.value for m in at.markdown)
    table = at.dataframe[0].value
    assert len(table) == len(rec.verification) and "uniform draw" in table.columns
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    assert any(s["layout"].get("yaxis", {}).get("title", {}).get("text") == "P(accepted length >= d)" for s in specs)

    lab = AppTest.from_file(str(root / "pages" / "2_Verification_Lab.py"), default_timeout=300)
    lab.run()
    assert any("recorded experiment" in i.value for i in lab.info)  # no run of its own yet: the recorded one
    lab.session_state["run"] = run
    lab.run()
    next(s for s in lab.slider if s.label == "Repetitions").set_value(40).run()
    next(b for b in lab.button if "Run the lab" in b.label).click().run()
    assert not lab.exception and not lab.error, (lab.exception, [e.value for e in lab.error])
    verifier, result, _ = lab.session_state["lab"]
    assert verifier == "traversal" and len(result.first_tokens) == 40
    assert lab.metric[0].value == "40" and len(lab.get("plotly_chart")) == 2
    next(s for s in lab.selectbox if s.label == "Verifier").set_value("block").run()
    next(b for b in lab.button if "Run the lab" in b.label).click().run()
    assert any("one drafted path" in e.value for e in lab.error)  # refused before any work


def test_why_is_it_not_faster_measures_the_profile_and_explains(tiny_pair_dirs):
    import json

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    _click(at, "Step")
    _click(at, "Step")
    md = " ".join(m.value for m in at.markdown)
    assert "Measure the latency profile" in md  # no plain-decoding cost known yet
    _click(at, "latency profile")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    md = " ".join(m.value for m in at.markdown)
    assert "breaks even at" in md and "expected to be" in md
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    names = {t.get("name") for c in charts for t in c["data"]}
    assert {"target forward (profile)", "draft forward (profile)", "this run's verifications"} <= names


def test_presets_only_hides_custom_models(monkeypatch):
    monkeypatch.setenv("DYNATREE_PRESETS_ONLY", "1")
    for page in ("app.py", "pages/1_Compare_Policies.py", "pages/3_Benchmark.py"):
        at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / page), default_timeout=120)
        at.run()
        assert not at.exception, page
        pickers = [s for s in at.selectbox if s.label == "Model pair"]
        assert pickers and all("custom (hub id or local path)" not in s.options for s in pickers), page


def test_run_decodes_in_a_worker_and_the_scrubber_reaches_every_iteration(tiny_pair_dirs):
    """Run starts the worker; the page reruns until it has drawn the finished run, whose tokens are
    engine.generate's with the same settings; the scrubber then shows every iteration's tree."""
    from dynatree_core.decoding.engine import DecodeConfig, generate
    from dynatree_core.decoding.methods import make_method
    from dynatree_core.ui.resources import cached_pair

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    next(s for s in at.slider if s.label == "Max new tokens").set_value(24).run()
    _click(at, "Run")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    run = at.session_state["run"]
    assert run.done and not run.worker_running, "the page stopped rerunning before the worker ended"
    assert any("Finished:" in i.value for i in at.info), "the last drawing must show the finished run"
    assert int(at.metric[3].value) == len(run.records), "the metrics must count every iteration"
    assert any("torch thread" in c.value for c in at.caption), "the caption names the engine's thread count"
    pair = cached_pair(tiny_pair_dirs[0], tiny_pair_dirs[1], "auto", "auto")
    config = DecodeConfig(max_new_tokens=24, eos_token_ids=pair.target.eos_token_ids)
    policy = make_method("fixed_tree", run.params)
    full = generate(pair.target.model, run.prompt_ids, policy, draft=pair.draft.model, config=config)
    assert run.token_ids == full.token_ids, "the worker's tokens differ from engine.generate's"
    n = len(run.records)
    assert n > 1, "a one-iteration run does not exercise the scrubber"
    for i in (*range(1, n + 1), n):
        next(s for s in at.slider if s.label == "Iteration").set_value(i).run()
        assert any(h.value == f"##### Draft tree — iteration {i}" for h in at.markdown), f"iteration {i} not drawn"


def test_reset_stops_a_running_worker(tiny_pair_dirs, monkeypatch):
    from dynatree_core.ui.resources import forward_lock

    monkeypatch.setenv("DYNATREE_LIVE_ENGINE", "thread")  # the in-process worker, held by the lock
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    _click(at, "Step")
    run = at.session_state["run"]
    lock = forward_lock()  # the app process's lock: holding it keeps the worker inside its iteration
    with lock:
        assert run.start_worker(lock) and run.worker_running
        _click(at, "Reset")
        assert at.session_state["run"] is None and not at.exception
    assert run.wait(60), "Reset must stop the worker after its current iteration"
    assert len(run.records) <= 2 and not run.done, "the worker went on decoding after Reset"


def test_runs_decode_in_the_pairs_engine_and_reset_frees_them(tiny_pair_dirs):
    """By default the page's runs live in the pair's engine (a Ray actor): the caption says so, and
    a run discarded with Reset (even while decoding) is freed there."""
    from dynatree_core.live.engine import call
    from dynatree_core.live.engine_run import EngineRun
    from dynatree_core.ui.resources import pair_engine

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    _click(at, "Step")
    run = at.session_state["run"]
    assert isinstance(run, EngineRun) and len(run.records) == 1
    assert any("in its own process" in c.value for c in at.caption), [c.value for c in at.caption]
    engine = pair_engine(tiny_pair_dirs[0], tiny_pair_dirs[1], "auto", "auto")
    assert run._rid in call(engine, "runs", None, 30)
    run.start_worker()  # decoding when Reset comes
    _click(at, "Reset")
    assert at.session_state["run"] is None and not at.exception
    assert run.wait(60) and run._rid not in call(engine, "runs", None, 30)


def test_where_ray_cannot_start_runs_decode_in_the_apps_process_and_the_page_says_why(tiny_pair_dirs, monkeypatch):
    from dynatree_core.live.engine_run import EngineRun
    from dynatree_core.measure import cluster
    from dynatree_core.ui.resources import ray_unavailable

    def refused():
        raise DynaTreeError("Ray did not start: no room for its object store")

    monkeypatch.setattr(cluster, "connect", refused)
    ray_unavailable.clear()
    try:
        at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
        at.run()
        pick_custom_pair(at, *tiny_pair_dirs)
        _click(at, "Step")
        run = at.session_state["run"]
        assert not at.exception and run is not None and not isinstance(run, EngineRun) and len(run.records) == 1
        assert any("no room for its object store" in w.value and "app's process" in w.value for w in at.warning)
    finally:
        ray_unavailable.clear()


def test_a_bad_live_engine_setting_is_a_message(tiny_pair_dirs, monkeypatch):
    monkeypatch.setenv("DYNATREE_LIVE_ENGINE", "gpu-cluster")
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    _click(at, "Step")
    assert not at.exception and any("DYNATREE_LIVE_ENGINE" in e.value for e in at.error)


@pytest.mark.slow
def test_the_default_pair_drafts_with_the_feature_draft_and_names_its_draft_kind():
    """The default preset (the feature draft): the first Step is the prefill (a root-only tree),
    the second drafts; the caption says which draft ran. The token draft stays selectable."""
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=300)
    at.run()
    picker = next(s for s in at.selectbox if s.label == "Model pair")
    assert picker.value == "embedded" and "embedded-token" in picker.options
    _click(at, "Step")
    _click(at, "Step")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    run = at.session_state["run"]
    assert run.draft_kind == "feature" and len(run.records[0].tree) == 1 and len(run.records[1].tree) > 1
    assert any("with the feature draft" in c.value for c in at.caption), [c.value for c in at.caption]


def test_an_iteration_plays_stage_by_stage(tiny_pair_dirs, monkeypatch):
    """The stage control redraws the tree as it stood: depth 1 only after the first draft level,
    the target's matches at verify, the cache strip at commit; Play walks through every stage."""
    import json

    from dynatree_core.ui import live_view as ui_live
    from dynatree_core.viz.stages import iteration_stages

    monkeypatch.setattr(ui_live, "STAGE_PLAY_S", 0.0)
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    next(w for w in at.number_input if w.label == "tau").set_value(
        0.0
    ).run()  # a random tiny draft is unsure: keep nodes
    _click(at, "Step")
    rec = at.session_state["run"].records[-1]
    assert len(rec.order) > 1, "the iteration verified drafted nodes"
    stage = next(s for s in at.select_slider if s.label == "Stage")
    assert stage.value == "commit" and stage.options == [s.label for s in iteration_stages(rec)]

    def tree_nodes() -> int:
        charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
        tree = next(c for c in charts if any(t.get("name") == "root" for t in c["data"]))
        return sum(len(t["customdata"]) for t in tree["data"] if t.get("mode") == "markers+text")

    stage.set_value("draft depth 1").run()
    assert not at.exception, at.exception
    assert tree_nodes() == sum(1 for d in rec.tree.depths if d <= 1)
    assert any("Draft depth 1.** Forward pass 1 proposed" in m.value for m in at.markdown)
    next(s for s in at.select_slider if s.label == "Stage").set_value("verify").run()
    names = {t.get("name") for c in at.get("plotly_chart") for t in json.loads(c.proto.spec)["data"]}
    assert names & {"match", "mismatch"} and "accepted" not in names, names
    next(s for s in at.select_slider if s.label == "Stage").set_value("commit").run()
    slots = ("committed chain (kept)", "accepted node (kept)", "dropped")
    bars = [t for c in at.get("plotly_chart") for t in json.loads(c.proto.spec)["data"] if t.get("name") in slots]
    assert sum(len(t["x"]) for t in bars) == rec.chain_len + len(rec.order) - 1, "one bar per cache slot written"
    _click(at, "Play stages")
    assert not at.exception, at.exception
    assert next(s for s in at.select_slider if s.label == "Stage").value == "commit", "Play ends at commit"
    assert at.session_state["stage_play"] is None


def test_the_page_opens_on_a_replay_that_plays_before_any_model_loads(monkeypatch):
    import json

    from dynatree_core.ui import replay, resources

    monkeypatch.setenv("DYNATREE_REPLAY", "1")
    monkeypatch.setattr(replay, "REPLAY_INTERVAL_S", 0.0)
    monkeypatch.setenv("DYNATREE_LIVE_ENGINE", "thread")  # nothing to prewarm in a separate process

    def no_models(*args, **kwargs):
        raise AssertionError("the replay must not load a model")

    monkeypatch.setattr(resources, "load_pair", no_models)
    warmed = []  # the replay frame at which the live pair started loading
    monkeypatch.setattr(resources, "prewarm", lambda *args: warmed.append(resources.st.session_state["replay_at"]))
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    assert warmed == [replay.PREWARM_FRAME], "the pair starts loading once, after the replay's first frames are drawn"
    run = at.session_state["run"]
    assert run is not None and run.imported and len(run.records) > 5, "the recorded run is loaded"
    assert any("Replay finished" in i.value for i in at.info)
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    assert any(any(t.get("name") == "root" for t in c["data"]) for c in charts), "a tree is drawn"
    assert at.session_state["replay_at"] > len(run.records), "it played every iteration"
    assert at.session_state[f"scrub_{len(run.records)}"] == len(run.records)


def test_a_run_that_finished_after_its_worker_flag_was_read_is_drawn_finished():
    """The live loop reads `worker_running` before the snapshot; a worker that ends in between
    gives a done snapshot drawn with running=True. It is drawn finished: the same drawing that says
    "Finished" offers the export (a browser test once saw the one without the other)."""

    def page():
        from dynatree_core.live.run import LiveRun
        from dynatree_core.ui.live_view import render
        from dynatree_core.ui.replay import REPLAY_FILE

        run = LiveRun.from_json(REPLAY_FILE.read_bytes())
        assert run.done
        render(run, running=True)

    at = AppTest.from_function(page, default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    assert any(b.label == "Export run (JSON)" for b in at.get("download_button")), "finished: export offered"
    assert any(b.label == "Measure AR reference" and not b.disabled for b in at.button)


def test_a_running_page_draws_only_the_texts_tail_and_the_whole_text_once_stopped():
    """While the worker decodes, the page draws the last TEXT_TAIL_TOKENS tokens (its drawing cost
    stays flat as the run grows); paused or finished, the whole text."""

    def page(running: bool):
        from dynatree_core.live.run import LiveRun
        from dynatree_core.ui import live_view
        from dynatree_core.ui.replay import REPLAY_FILE

        run = LiveRun.from_json(REPLAY_FILE.read_bytes())
        run.done = not running
        tail, live_view.TEXT_TAIL_TOKENS = live_view.TEXT_TAIL_TOKENS, 10  # the recorded run is shorter
        try:
            live_view.render(run, running=running)
        finally:
            live_view.TEXT_TAIL_TOKENS = tail

    for running in (True, False):
        at = AppTest.from_function(page, args=(running,), default_timeout=60)
        at.run()
        assert not at.exception, at.exception
        texts = [h.proto.body for h in at.get("html") if "iteration 21:" in h.proto.body]
        assert len(texts) == 1
        assert ("earlier tokens" in texts[0]) == running and ("iteration 1:" in texts[0]) != running


def test_the_replay_banner_counts_frames_and_finished_comes_only_at_the_end():
    """While the opening replay plays, the banner names the iteration of how many and the page
    never says "Finished"; the metrics say they cover the iterations up to the one on show."""

    def page(frame: int, replaying: bool):
        import streamlit as st

        from dynatree_core.live.run import LiveRun
        from dynatree_core.ui.live_view import render
        from dynatree_core.ui.replay import REPLAY_FILE, replay_banner

        run = LiveRun.from_json(REPLAY_FILE.read_bytes())
        st.session_state[f"scrub_{len(run.records)}"] = frame
        st.info(replay_banner(run, frame))
        render(run, replaying=replaying)

    from dynatree_core.live.run import LiveRun
    from dynatree_core.ui.replay import REPLAY_FILE

    run = LiveRun.from_json(REPLAY_FILE.read_bytes())
    n = len(run.records)
    for frame, replaying in ((1, True), (n // 2, True), (n, False)):
        at = AppTest.from_function(page, args=(frame, replaying), default_timeout=60)
        at.run()
        assert not at.exception, at.exception
        infos = [i.value for i in at.info]
        finished = any("Finished:" in i for i in infos)
        assert finished == (frame == n), (frame, infos)
        banner = infos[0]
        assert (f"iteration {frame} of {n}" in banner) == (frame < n) and ("Replay finished" in banner) == (frame == n)
        scope = " ".join(c.value for c in at.caption)
        assert (f"Iterations 1-{frame} of {n}" in scope) == (frame < n) and ("Whole run" in scope) == (frame == n)
        shown = run.result(upto=frame)
        assert at.metric[3].value == str(frame) and at.metric[4].value == str(shown.new_tokens), "the frame's metrics"


def test_the_example_selector_says_your_own_once_the_prompt_is_edited():
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=60)
    at.run()
    pick = next(s for s in at.selectbox if s.label == "Example prompts")
    assert pick.value == "(your own)"
    example = pick.options[2]
    pick.set_value(example).run()
    box = next(t for t in at.text_area if t.label == "Prompt")
    assert box.value and box.value[:40] in example, "an example fills the prompt box"
    box.set_value(box.value + " Please be brief.").run()
    assert next(s for s in at.selectbox if s.label == "Example prompts").value == "(your own)"
    assert next(t for t in at.text_area if t.label == "Prompt").value.endswith("Please be brief."), "the edit is kept"
    assert not at.exception


def test_the_first_drawings_hold_no_chart_at_any_stage():
    """The replay's first frames (poster) draw no plotly chart, not even the commit stage's cache
    strip: the browser would load plotly's ~4.7 MB before showing anything of the drawing."""

    def page():
        from dynatree_core.live.run import LiveRun
        from dynatree_core.ui.live_view import render
        from dynatree_core.ui.replay import REPLAY_FILE

        render(LiveRun.from_json(REPLAY_FILE.read_bytes()), poster=True)

    at = AppTest.from_function(page, default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    assert next(s for s in at.select_slider if s.label == "Stage").value == "commit"
    assert not at.get("plotly_chart") and len(at.get("image")) == 1, "the tree as an image, no chart"


def test_a_published_eagle3_head_drafts_in_the_app_and_one_for_another_target_is_a_message(tiny_pair_dirs, tmp_path):
    """The custom draft field takes a directory in a published layout (here EAGLE-3, written by
    export_eagle3): Step draws its tree. A head made for another target is one message, no traceback."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dynatree_core.core.models import load_model
    from dynatree_core.core.vocab import TokenMap
    from dynatree_core.drafts.fused import FusedDraft
    from dynatree_core.drafts.published import export_eagle3

    tiny = load_model(tiny_pair_dirs[0], device="cpu", dtype="float32").model
    vocab = tiny.config.vocab_size
    token_map = TokenMap([-1, *range(0, vocab, 5)], vocab)
    export_eagle3(FusedDraft.from_target(tiny, token_map, taps=(1, 1, 1), fc_norm="none"), tmp_path / "head")
    other = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    export_eagle3(FusedDraft.from_target(other, token_map, taps=(1, 1, 1), fc_norm="none"), tmp_path / "other-head")

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=180)
    at.run()
    pick_custom_pair(at, tiny_pair_dirs[0], str(tmp_path / "head"))
    _click(at, "Step")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    run = at.session_state["run"]
    assert run.draft_kind == "fused" and len(run.records) == 1
    assert any("fused draft" in c.value for c in at.caption)
    _click(at, "Reset")
    pick_custom_pair(at, tiny_pair_dirs[0], str(tmp_path / "other-head"))
    _click(at, "Step")
    assert not at.exception, at.exception
    assert len(at.error) == 1 and "hidden" in at.error[0].value.lower(), [e.value for e in at.error]


def test_no_page_loads_a_model_pair_in_the_app_process(tiny_pair_dirs, monkeypatch):
    """Every page's work runs as a job in the pair's engine process (live/jobs.py): with this
    process's loader made to fail, a live run, the AR reference, the latency profile, an HF baseline,
    a comparison and a benchmark all still run. One copy of each pair on a server."""
    from dynatree_core.ui import resources

    def refuse(*args, **kwargs):
        raise AssertionError("a page loaded a model pair in the app process")

    resources.cached_pair.clear()
    monkeypatch.setattr(resources, "load_pair", refuse)
    root = Path(__file__).resolve().parent.parent
    at = AppTest.from_file(str(root / "app.py"), default_timeout=300)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    next(s for s in at.slider if s.label == "Max new tokens").set_value(8).run()
    _click(at, "Step")
    _click(at, "Measure AR reference")
    _click(at, "latency profile")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    assert at.session_state["ar_tps"] and at.session_state["latency_profiles"]
    next(s for s in at.selectbox if s.label == "Policy").set_value("hf_assisted").run()
    _click(at, "Run baseline")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    assert int(at.metric[4].value) == 8

    from tests.test_compare import _custom_pair

    cmp = AppTest.from_file(str(root / "pages" / "1_Compare_Policies.py"), default_timeout=300)
    cmp.run()
    _custom_pair(cmp, tiny_pair_dirs)
    next(n for n in cmp.number_input if n.label == "Policies to compare").set_value(2)
    next(s for s in cmp.slider if s.label == "Max new tokens").set_value(6)
    next(s for s in cmp.slider if s.label == "Repetitions").set_value(1)
    next(t for t in cmp.toggle if t.label == "HF generate references").set_value(False)
    cmp.run()
    next(b for b in cmp.button if b.label == "Compare").click().run()
    assert not cmp.exception and not cmp.error, (cmp.exception, [e.value for e in cmp.error])
    assert cmp.session_state["comparison"].correctness["ok"] is True

    bench = AppTest.from_file(str(root / "pages" / "3_Benchmark.py"), default_timeout=300)
    bench.run()
    _custom_pair(bench, tiny_pair_dirs)
    next(s for s in bench.multiselect if s.label == "Policies").set_value(["fixed_tree"])
    next(s for s in bench.slider if s.label == "Prompts (N)").set_value(1)
    next(s for s in bench.slider if s.label == "Max new tokens").set_value(6)
    next(t for t in bench.toggle if t.label == "HF generate references").set_value(False)
    bench.run()
    next(b for b in bench.button if "Run benchmark" in b.label).click().run()
    assert not bench.exception and not bench.error, (bench.exception, [e.value for e in bench.error])
    assert [e.label for e in bench.session_state["bench_report"][0].results][-1] == "fixed_tree"


def test_a_page_error_is_one_line_and_its_traceback_goes_to_the_server_log(tiny_pair_dirs, monkeypatch, tmp_path):
    """A run that fails in the engine process: the page shows one line and where the log is; the
    log holds the traceback from the engine process."""
    log = tmp_path / "server.log"
    monkeypatch.setenv("DYNATREE_LOG", str(log))  # this process's logger follows it (core/log.py)
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=300)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    at.text_area[0].set_value("word " * 5000).run()  # longer than the tiny target's context
    _click(at, "Step")
    assert not at.exception
    (error,) = [e.value for e in at.error]
    assert "The run stopped" in error and "context" in error and "\n" not in error.strip()
    assert any("server log" in c.value and str(log) in c.value for c in at.caption)
    logged = log.read_text()  # the child's own stack, carried with the exception
    assert "Traceback (most recent call last)" in logged and "in engine process" in logged


def test_the_tree_is_drawn_as_a_picture_under_its_chart_until_a_run_decodes():
    """The tree's picture (SVG) stays in the page under the interactive chart, which hides it once
    the browser has drawn the chart (live_view.TREE_VIEW_CSS; tests/test_e2e.py watches it): the
    page never shows an empty chart box instead of the tree. While a run decodes, only the chart
    (the browser has plotly by then, and each picture would cost the engine time)."""

    def page(running: bool, replaying: bool):
        from dynatree_core.live.run import LiveRun
        from dynatree_core.ui.live_view import render
        from dynatree_core.ui.replay import REPLAY_FILE

        run = LiveRun.from_json(REPLAY_FILE.read_bytes())
        run.done = not running
        render(run, running=running, replaying=replaying)

    for running, replaying in ((False, True), (False, False), (True, False)):
        at = AppTest.from_function(page, args=(running, replaying), default_timeout=60)
        at.run()
        assert not at.exception, at.exception
        pictures = [i for i in at.get("image") if "Draft tree" in str(i.proto)]
        trees = [c for c in at.get("plotly_chart") if '"name":"root"' in c.proto.spec.replace(" ", "")]
        assert len(trees) == 1 and len(pictures) == (not running), (running, replaying, len(pictures))
        assert any(".st-key-tree_view:has(" in h.proto.body for h in at.get("html")), "the CSS that swaps them"
