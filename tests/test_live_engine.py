"""The live page's engine (live/engine.py, a Ray actor; live/engine_run.py): the same runs as the
engine in this process, the same controls (step, run, pause, reset), and every failure a message."""

from __future__ import annotations

import gc
import io
import sys
import time
import types

import pytest
import torch

from dynatree_core.core.log import log_info
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.decoding.pairs import load_pair
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.engine import Engine, PairSpec, call
from dynatree_core.live.engine_run import EngineRun

PROMPT = [1, 17, 4, 99, 250, 7]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    """The server log the module's engine writes (DYNATREE_LOG, read when the child starts)."""
    path = tmp_path_factory.mktemp("log") / "server.log"
    mp = pytest.MonkeyPatch()
    mp.setenv("DYNATREE_LOG", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def kind():
    """The engine's class: a Ray actor on a local runtime (started on first use, shut down after)."""
    ray = pytest.importorskip("ray")
    yield Engine
    ray.shutdown()


@pytest.fixture(scope="module")
def engine(kind, tiny_pair_dirs, server_log):
    # the child decodes with this process's thread count, so float32 sums run in the same order
    eng = kind(PairSpec(*tiny_pair_dirs, threads=torch.get_num_threads()))
    eng.wait_ready(300)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def pair(tiny_pair_dirs):
    return load_pair(*tiny_pair_dirs)


def _config(engine: Engine, max_new: int) -> DecodeConfig:
    info = engine.wait_ready()
    return DecodeConfig(max_new_tokens=max_new, eos_token_ids=info.eos_token_ids, context_length=info.context_length)


def _reference(pair, policy: str, max_new: int, params=None):
    config = DecodeConfig(max_new_tokens=max_new, eos_token_ids=pair.target.eos_token_ids)
    return generate(pair.target.model, PROMPT, make_method(policy, params), draft=pair.draft.model, config=config)


def _start(engine, policy="fixed_tree", max_new=24) -> EngineRun:
    return EngineRun.start_in(engine, PROMPT, make_method(policy), settings={"p": 1}, config=_config(engine, max_new))


def test_the_child_reports_what_it_loaded(engine, pair):
    """What the child sends back describes the pair it loaded: the same tokenizer (it decodes and
    encodes like the one loaded here), EOS ids and context length as this process reads them."""
    import os

    info = engine.wait_ready()
    assert info.device == "cpu" and info.dtype == "float32" and info.has_draft and not info.draft_is_stand_in
    assert info.threads == torch.get_num_threads() and info.pid not in (0, os.getpid()) and engine.alive
    here = pair.target.tokenizer
    assert [info.tokenizer.decode([t]) for t in range(64)] == [here.decode([t]) for t in range(64)]
    assert info.tokenizer("Hello there")["input_ids"] == here("Hello there")["input_ids"]
    assert info.eos_token_ids == pair.target.eos_token_ids and info.context_length == pair.target.context_length


@pytest.mark.parametrize("policy", ["fixed_tree", "dynatree", "linear"])
def test_steps_then_the_worker_reproduce_the_engine_in_this_process(engine, pair, policy):
    run = _start(engine, policy)
    first = run.step()
    assert first is not None and first.index == 1 and run.records == [first] and not run.done
    assert run.start_worker() and run.wait(120), "the run did not finish"
    ref = _reference(pair, policy, 24)
    assert run.done and run.error is None
    assert run.token_ids == ref.token_ids
    assert [r.committed for r in run.records] == [r.committed for r in ref.records]
    assert run.step() is None and not run.start_worker(), "a finished run neither steps nor restarts"


def test_pause_stops_after_the_current_iteration_and_run_resumes_to_the_same_output(engine, pair):
    # long enough that no machine finishes it between the second record and the pause (80 tokens,
    # ~30 tiny-model iterations of a few ms each, could race a pause on a fast, quiet machine)
    run = _start(engine, max_new=320)
    assert run.start_worker()
    run.wait(60, records=2)
    run.pause()
    assert run.wait(30) and not run.worker_running and not run.done
    n = len(run.records)
    time.sleep(0.3)
    assert len(run.records) == n, "the child went on decoding after the pause"
    with pytest.raises(RuntimeError, match="pause it"):
        run.start_worker()
        run.step()
    assert run.wait(120) and run.done
    assert run.token_ids == _reference(pair, "fixed_tree", 320).token_ids


def test_a_pause_overtaken_by_run_does_not_stop_the_new_run(engine):
    run = _start(engine, max_new=60)
    assert run.start_worker()
    run.pause()
    assert run.start_worker(), "Run right after Pause goes on"
    assert run.wait(120) and run.done, "the stale 'paused' answer stopped the new run"


def test_a_snapshot_has_no_engine_and_keeps_its_records(engine):
    run = _start(engine)
    run.step()
    snap = run.snapshot()
    run.step()
    assert len(snap.records) == 1 and len(run.records) == 2
    assert not snap.worker_running and snap.step() is None, "a snapshot never drives the engine"
    run.close()


def test_an_engine_error_ends_the_run_and_the_engine_goes_on(engine):
    info = engine.wait_ready()
    config = _config(engine, 8)
    run = EngineRun.start_in(engine, PROMPT * 200, make_method("fixed_tree"), settings={}, config=config)
    assert len(PROMPT) * 200 > info.context_length
    with pytest.raises(DynaTreeError, match="context"):
        run.step()
    assert run.done and isinstance(run.error, DynaTreeError) and not run.records
    assert _start(engine, max_new=4).start_worker(), "the engine must serve the next run"


def test_closed_and_forgotten_runs_are_freed_in_the_child(engine):
    kept, closed, forgotten = _start(engine), _start(engine), _start(engine)
    for run in (kept, closed, forgotten):
        run.step()
    del run
    held = call(engine, "runs", None, 30)
    assert {kept._rid, closed._rid, forgotten._rid} <= set(held)
    rid = forgotten._rid
    closed.close()
    del forgotten
    gc.collect()
    held = call(engine, "runs", None, 30)
    assert kept._rid in held and closed._rid not in held and rid not in held


def test_a_run_nobody_watches_pauses_itself(engine):
    run = _start(engine, max_new=400)
    assert run.start_worker(idle_timeout_s=0.0)
    assert run.wait(30), "the dispatcher did not pause an unwatched run"
    assert run.idle_paused and not run.done


def _job(engine, name, payload, timeout_s=120):
    return call(engine, "job", (name, payload), timeout_s)


def test_the_references_run_as_jobs_in_the_child(engine, pair):
    config = _config(engine, 16)
    ref = _job(engine, "generate", {"method": "ar", "prompt_ids": PROMPT, "config": config})
    assert ref.token_ids == _reference(pair, "ar", 16).token_ids and ref.throughput_tps > 0
    static = _job(engine, "generate", {"method": "hf_static", "prompt_ids": PROMPT, "config": config})
    assert static.token_ids == ref.token_ids and static.forward_path.startswith("hf+static")
    with pytest.raises(DynaTreeError, match="not a job"):
        _job(engine, "train", {})


def test_jobs_queue_in_arrival_order_and_a_step_meanwhile_is_answered_busy(engine, pair):
    """Three jobs sent at once run one at a time in the order sent (the parent knows each one's
    place); a live run's Step while a job holds the engine is answered "busy" at once, and the run
    steps normally once the jobs are done. A comparison in the child equals one in this process."""
    from dynatree_core.live.engine import JobHandle
    from dynatree_core.measure.compare import compare
    from dynatree_core.measure.entries import Entry
    from dynatree_core.ui.resources import _waiting_text  # imported before the jobs: it takes ~0.5 s

    # jobs of about a second each here, so the first still runs while the queue is read and Step is
    # pressed (24 tokens, one repetition: the first job ended 0.5-0.65 s after submission, and the
    # queue's text, read after this import, saw it gone in 2 of 7 runs here)
    config = _config(engine, 64)
    run = _start(engine, max_new=24)
    payload = {
        "entries": [Entry("fixed_tree"), Entry("linear")],
        "prompt_ids": PROMPT,
        "config": config,
        "repetitions": 2,
        "include_hf": False,
    }
    handles = [JobHandle() for _ in range(3)]
    rids = [engine.submit("compare", payload, h) for h in handles]
    assert [engine.queue_position(r) for r in rids] == [0, 1, 2]
    assert engine.busy_with() == ("compare", 2) and engine.in_use
    text = _waiting_text(engine, rids[2], "compare")  # what the third job's page shows while it waits
    assert "running a comparison" in text and "2 job(s) ahead of this one (a comparison)" in text
    deadline = time.monotonic() + 60
    while not handles[0].started and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(DynaTreeError, match="running a comparison"):
        run.step(timeout_s=30)
    assert time.monotonic() - t0 < 5, "the busy answer must come at once, not after the jobs"
    waiting = _start(engine, max_new=8)
    assert waiting.start_worker() and "running a comparison" in waiting.waiting_for()
    for h in handles:
        assert h.finished.wait(300) and h.error is None, h.error
    events = []
    while not handles[0].events.empty():
        events.append(handles[0].events.get_nowait())
    assert [d[0] for k, d in events if k == "progress"] == sorted(d[0] for k, d in events if k == "progress")
    assert all(engine.queue_position(r) is None for r in rids) and engine.busy_with() is None
    here = compare(pair, payload["entries"], PROMPT, config=config, repetitions=2, include_hf=False)
    for got in (h.result for h in handles):
        assert [e.token_ids for e in got.entries] == [e.token_ids for e in here.entries]
        assert got.correctness["ok"] is True
    assert run.step() is not None and len(run.records) == 1, "the run steps once the jobs are done"
    assert waiting.wait(120) and waiting.done and waiting.waiting_for() == "", "the waiting run went on"
    run.close()


def test_a_failing_job_is_a_message_and_its_traceback_is_in_the_server_log(engine, server_log):
    config = _config(engine, 8)
    with pytest.raises(DynaTreeError, match="context") as info:
        _job(engine, "generate", {"method": "fixed_tree", "prompt_ids": PROMPT * 200, "config": config})
    assert any("in engine process" in note for note in getattr(info.value, "__notes__", []))
    deadline = time.monotonic() + 10
    while "Traceback" not in server_log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    logged = server_log.read_text()
    assert "job generate" in logged and "Traceback (most recent call last)" in logged
    assert "engine_child.py" in logged and "jobs.py" in logged, "the child's own stack"
    assert _job(engine, "generate", {"method": "ar", "prompt_ids": PROMPT, "config": config}).token_ids


def test_the_log_writes_to_standard_error_as_it_is_when_a_line_is_logged(monkeypatch, tmp_path):
    """An engine's watcher thread can log its end after the stream the logger was set up with is
    closed (pytest's capture of an earlier test): the line goes to standard error as it is then."""
    monkeypatch.setenv("DYNATREE_LOG", str(tmp_path / "server.log"))
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    log_info("first line")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    log_info("second line")
    assert "second line" in second.getvalue() and "Logging error" not in second.getvalue()
    assert "second line" in (tmp_path / "server.log").read_text()


def test_every_command_is_answered(engine):
    """drop, pause, go and step on unknown runs, and an unknown command: each gets its answer."""
    from dynatree_core.live.engine import JobHandle

    for kind, payload, answer in [
        ("drop", None, "dropped"),
        ("pause", 7, "paused"),
        ("go", 1, "done"),
        ("step", None, "done"),
        ("teleport", None, "error"),
    ]:
        seen = []
        handle = JobHandle()
        handle.on_message = lambda k, p, seen=seen, h=handle: (seen.append(k), h.finished.set())
        rid = engine.register(handle)
        engine.send(kind, rid, payload)
        assert handle.finished.wait(30), f"no answer to {kind!r}"
        engine.unregister(rid)
        assert seen[0] == answer, (kind, seen)


def test_a_pair_that_cannot_load_is_a_message(kind):
    eng = kind(PairSpec("/nonexistent/model-dir", None))
    with pytest.raises(DynaTreeError) as info:
        eng.wait_ready(300)
    assert "/nonexistent/model-dir" in str(info.value)
    eng.close()
    assert not eng.alive


def test_a_dead_engine_ends_its_runs_with_a_message_and_the_next_run_gets_a_new_one(kind, tiny_pair_dirs):
    from dynatree_core.live.pool import EnginePool

    pool, spec = EnginePool(limit=2, start=kind), PairSpec(*tiny_pair_dirs)
    eng = pool.get(spec)
    eng.wait_ready(300)
    run = EngineRun.start_in(eng, PROMPT, make_method("fixed_tree"), settings={}, config=_config(eng, 400))
    run.step()
    eng.kill()
    deadline = time.monotonic() + 30
    while not run.done and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.done and isinstance(run.error, DynaTreeError) and "engine ended" in str(run.error)
    assert not run.start_worker() and run.step() is None
    with pytest.raises(DynaTreeError, match="gone"):
        eng.send("go", 1, 1)
    fresh = pool.get(spec)  # the next Run: the pool replaces the dead engine
    assert fresh is not eng and fresh.alive and fresh.wait_ready(300)
    run = EngineRun.start_in(fresh, PROMPT, make_method("fixed_tree"), settings={}, config=_config(fresh, 8))
    assert run.step() is not None and run.error is None
    run.close()
    pool.close_all()


def test_a_failed_warm_up_is_logged_and_the_engine_still_serves(tiny_pair_dirs, tmp_path, monkeypatch):
    """The warm-up's failure costs its time and leaves its traceback in the server log."""
    from dynatree_core.live.engine_child import _warm_up

    log = tmp_path / "server.log"
    monkeypatch.setenv("DYNATREE_LOG", str(log))
    pair = load_pair(*tiny_pair_dirs)

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel this machine lacks")

    assert _warm_up(pair, broken, make_method) >= 0.0
    logged = log.read_text()
    assert "warm-up failed" in logged and "a kernel this machine lacks" in logged and "Traceback" in logged


class _Ref:
    """A Ray object ref of the stand-in below: `ready` is what ray.wait sees, get() runs the call."""

    def __init__(self, call, ready: bool):
        self.call, self.ready = call, ready


class _SlowPollRay:
    """A stand-in for Ray whose actor runs serve at once but whose polls ray.wait never sees ready
    (an actor still starting): only ray.get fetches what a poll returns."""

    def __init__(self):
        from dynatree_core.live.actor import EngineActor

        self.actor = EngineActor()
        node = {"Alive": True, "Resources": {"node:__internal_head__": 1.0}, "NodeID": "node-1"}
        self.nodes = lambda: [node]
        self.is_initialized = lambda: True
        self.get_runtime_context = lambda: types.SimpleNamespace(get_node_id=lambda: "node-1")
        strategies = types.SimpleNamespace(NodeAffinitySchedulingStrategy=lambda node, soft: node)
        self.util = types.SimpleNamespace(scheduling_strategies=strategies)
        self.kill = lambda actor: None

    def remote(self, cls):
        actor = self.actor

        def serve(spec):  # runs to its end now: a load that fails at once
            actor.serve(spec)
            return _Ref(lambda: None, True)

        handle = types.SimpleNamespace(
            serve=types.SimpleNamespace(remote=serve),
            poll=types.SimpleNamespace(remote=lambda timeout_s: _Ref(lambda: actor.poll(timeout_s), False)),
            send=types.SimpleNamespace(remote=lambda number, command: actor.send(number, command)),
        )
        launcher = types.SimpleNamespace(remote=lambda: handle)
        return types.SimpleNamespace(options=lambda **options: launcher)

    @staticmethod
    def wait(refs, timeout=None):
        return [r for r in refs if r.ready], [r for r in refs if not r.ready]

    @staticmethod
    def get(ref, timeout=None):
        return ref.call()


def test_a_failed_load_is_the_message_even_when_the_engine_ends_before_its_first_poll(monkeypatch):
    """serve writes "failed" and returns while the first poll still waits behind the actor's start:
    the parent fetches that message before it calls the engine gone, and says why it failed."""
    import dynatree_core.live.actor as actor_module

    ray = _SlowPollRay()
    monkeypatch.setattr(actor_module, "connect", lambda: ray)
    eng = Engine(PairSpec("/nonexistent/model-dir", None))
    with pytest.raises(DynaTreeError) as info:
        eng.wait_ready(30)
    assert "/nonexistent/model-dir" in str(info.value) and "engine quit" not in str(info.value)
    assert not eng.alive
    eng.close()
