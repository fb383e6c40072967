"""LiveRun: one iteration per step, the same tokens as a full run, settings frozen, replay."""

from __future__ import annotations

import threading

import pytest
from conftest import noisy_copy, tiny_model

from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.live.run import LiveRun


def test_stepping_reproduces_the_full_run_and_stops():
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    policy = make_method("fixed_tree", {"depth": 3, "branch": 2})
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
        make_method("linear", {"k": 3}),
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
        target, list(range(1, 600)), make_method("ar"), config=DecodeConfig(max_new_tokens=4), settings={}
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
        make_method("fixed_tree", {"depth": 2, "branch": 2}),
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


# ----- the background worker (the engine runs ahead, the page draws at its own cadence) -----------


def _worker_run(max_new_tokens: int = 24, prompt=(5, 9, 11, 3)):
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    policy = make_method("fixed_tree", {"depth": 3, "branch": 2})
    config = DecodeConfig(max_new_tokens=max_new_tokens)
    full = generate(target, list(prompt), policy, draft=draft, config=config)
    live = LiveRun.start(target, list(prompt), policy, draft=draft, config=config, settings={})
    return full, live


def test_the_worker_produces_the_records_of_a_synchronous_run():
    full, live = _worker_run()
    lock = threading.Lock()
    assert live.start_worker(lock) and not live.start_worker(lock), "a second worker must not start"
    assert live.wait(60) and not live.worker_running, "the worker did not end"
    assert live.done and live.error is None and not lock.locked()
    assert live.token_ids == full.token_ids, "the worker decoded other tokens than engine.generate"
    assert [r.index for r in live.records] == list(range(1, full.iterations + 1))
    assert [r.committed for r in live.records] == [r.committed for r in full.records]
    assert live.records[-1].stop == "max_new_tokens"
    assert live.threads >= 1 and live.result().threads == live.threads
    assert not live.start_worker(lock), "a finished run has nothing to start"


def test_pause_stops_after_the_current_iteration_and_run_resumes_to_the_same_output():
    full, live = _worker_run()
    gate, entered = threading.Lock(), threading.Event()

    class PausingLock:  # the page presses Pause while the worker is inside its first forward
        def __enter__(self):
            gate.acquire()
            if not entered.is_set():
                entered.set()
                live.pause()

        def __exit__(self, *exc):
            gate.release()

    live.start_worker(PausingLock())
    assert live.wait(60), "the worker did not stop after a pause"
    assert len(live.records) == 1 and not live.done, "pause must take effect after the current iteration"
    assert live.step() is not None and len(live.records) == 2, "Step works on a paused run"
    live.start_worker(gate)  # Run again
    assert live.wait(60) and live.done
    assert live.token_ids == full.token_ids, "a paused and resumed run differs from an uninterrupted one"


def test_step_is_refused_while_the_worker_decodes():
    _, live = _worker_run()
    gate = threading.Lock()
    gate.acquire()  # the worker blocks on its first forward until released
    live.start_worker(gate)
    with pytest.raises(RuntimeError, match="pause it"):
        live.step()
    assert live.stop(timeout_s=0.05) is False, "the worker is still inside its iteration"
    gate.release()
    assert live.wait(60) and len(live.records) == 1 and not live.done, "stop ends the worker after one iteration"


def test_a_snapshot_is_a_consistent_copy_the_worker_does_not_touch():
    _, live = _worker_run()
    live.step()
    snap = live.snapshot()
    live.start_worker()
    assert live.wait(60) and live.done
    assert len(snap.records) == 1 and not snap.done and not snap.worker_running
    assert snap.step() is None, "a snapshot has no engine to step"
    assert len(live.records) > 1


def test_a_worker_exception_ends_the_run_and_is_kept():
    from dynatree_core.errors import DynaTreeError

    live = LiveRun.start(tiny_model("llama"), list(range(1, 600)), make_method("ar"),
                         config=DecodeConfig(max_new_tokens=4), settings={})  # fmt: skip
    live.start_worker()
    assert live.wait(60)
    assert live.done and isinstance(live.error, DynaTreeError) and "context" in str(live.error)
    assert live.records == []

    class Broken:  # a failure that is not the engine's own (e.g. out of memory mid-run)
        def __enter__(self):
            raise RuntimeError("simulated failure")

        def __exit__(self, *exc):
            return False

    _, live = _worker_run()
    live.step()
    live.start_worker(Broken())
    assert live.wait(60)
    assert live.done and isinstance(live.error, RuntimeError) and len(live.records) == 1


def test_a_worker_whose_page_stops_polling_pauses_itself():
    full, live = _worker_run()
    live.start_worker(idle_timeout_s=0.0)  # the page has already been silent for too long
    assert live.wait(60)
    assert live.idle_paused and not live.done and live.records == [], "a worker nobody watches must stop"
    live.start_worker()  # the page is back: Run goes on
    assert live.wait(60) and live.done and not live.idle_paused
    assert live.token_ids == full.token_ids


def test_a_run_keeps_its_run_spec_and_an_imported_file_gets_it_back_when_the_registry_accepts_it():
    import dataclasses

    from dynatree_core.decoding.settings import RunSpec

    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    spec = RunSpec(target="tiny", draft="tiny-draft", max_new_tokens=4, temperature=0.5, top_k=7, seed=3)
    settings = {**dataclasses.asdict(spec), "policy": "fixed_tree", "params": {}, "prompt": "p", "chat": False}
    live = LiveRun.start(
        target, [1, 2, 3], make_method("fixed_tree"), draft=draft, config=spec.decode_config(), settings=settings,
        spec=spec,
    )  # fmt: skip
    while live.step() is not None:
        pass
    assert live.spec is spec
    assert LiveRun.from_json(live.to_json()).spec == spec
    settings["top_k"] = -1  # a file the registry refuses: no spec (the pages then treat it as greedy, no models)
    live.settings = settings
    assert LiveRun.from_json(live.to_json()).spec is None


def test_every_backend_offers_the_whole_interface_the_run_calls():
    """A LiveRun talks to its backend only through run.Backend: each execution mode implements all of it."""
    from dynatree_core.live.engine_backend import EngineBackend
    from dynatree_core.live.run import Backend, Detached
    from dynatree_core.live.thread_backend import ThreadBackend

    members = {m for m in vars(Backend) if not m.startswith("_")}
    assert members == {"running", "step", "start", "pause", "wait", "beat", "close", "waiting_for"}
    for backend in (ThreadBackend, EngineBackend, Detached):
        assert members <= set(dir(backend)), f"{backend.__name__} lacks {sorted(members - set(dir(backend)))}"


def test_the_run_file_round_trips_in_the_runs_layer():
    """runs/run_file.py alone writes and reads a run file: records, settings, token texts, vocabulary."""
    from dynatree_core.runs.run_file import drawn_tokens, dump_run_file, load_run_file

    live = LiveRun.start(tiny_model("llama"), [5, 9, 11], make_method("ar"), config=DecodeConfig(max_new_tokens=3),
                         settings={"policy": "ar"})  # fmt: skip
    while live.step() is not None:
        pass
    data = dump_run_file(live.result(), {"policy": "ar"}, lambda t: f"w{t}", vocab=live.vocab_size)
    file = load_run_file(data)
    assert file.settings == {"policy": "ar"} and file.vocab_size == live.vocab_size
    assert [r.committed for r in file.result.records] == [r.committed for r in live.records]
    assert set(file.token_texts) == drawn_tokens(live.records) | {5, 9, 11}
    assert all(file.token_texts[t] == f"w{t}" for t in file.token_texts)
