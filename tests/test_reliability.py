"""Reliability under a classroom's load: concurrent sessions on shared models, many runs in one
process, runs that hit the context limit, stop and restart."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from conftest import hf_greedy, noisy_copy, tiny_model
from streamlit.testing.v1 import AppTest

from dynatree_core.drafting import make_policy
from dynatree_core.engine import DecodeConfig, generate
from dynatree_core.live import LiveRun

PROMPTS = ([1, 5, 7, 9, 11], [3], [42, 17, 8, 8, 60, 2], [9, 9, 9], [70, 1, 2, 3, 4, 5, 6])
POLICIES = ("fixed_tree", "dynatree", "linear", "salf", "dyspec")


@pytest.mark.parametrize("sessions", [2, 5])
def test_concurrent_sessions_share_models_and_keep_their_own_output(sessions):
    """Each session steps its own LiveRun on the same model objects, interleaved under the
    process-wide forward lock, as the app does; every one ends with the target's greedy output."""
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    lock = threading.Lock()
    config = DecodeConfig(max_new_tokens=24)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(sessions)

    def session(i: int) -> None:
        try:
            prompt, policy = PROMPTS[i % len(PROMPTS)], make_policy(POLICIES[i % len(POLICIES)])
            run = LiveRun.start(target, prompt, policy, draft=draft, config=config, settings={"i": i})
            start.wait()
            while run.step(lock) is not None:
                pass
            results[i] = run.token_ids
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i in range(sessions):
        assert results[i] == hf_greedy(target, PROMPTS[i % len(PROMPTS)], 24), f"session {i} got another's tokens"


def test_concurrent_app_sessions_against_one_process(tiny_pair_dirs):
    """Several app sessions (AppTest instances) step at once against the process's one cached
    model pair: no exception, and each session's output equals AR decoding of its prompt."""
    app = str(Path(__file__).resolve().parent.parent / "app.py")
    prompts = ["The cat sat on", "Once upon a time", "Numbers: 1 2 3"]
    outcome: dict[int, object] = {}

    def session(i: int) -> None:
        try:
            at = AppTest.from_file(app, default_timeout=180)
            at.run()
            next(s for s in at.selectbox if s.label == "Model pair").set_value("custom (hub id or local path)").run()
            next(t for t in at.text_input if t.label == "Target").set_value(tiny_pair_dirs[0])
            next(t for t in at.text_input if t.label == "Draft").set_value(tiny_pair_dirs[1])
            at.run()
            area = next(a for a in at.text_area if "rompt" in a.label)
            area.set_value(prompts[i]).run()
            for _ in range(3):
                next(b for b in at.button if b.label.endswith("Step")).click().run()
            outcome[i] = (at, list(at.exception), [e.value for e in at.error])
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome[i] = exc

    threads = [threading.Thread(target=session, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    from dynatree_core.ui import cached_pair

    pair = cached_pair(tiny_pair_dirs[0], tiny_pair_dirs[1], "auto", "auto")
    for i in range(len(prompts)):
        assert not isinstance(outcome[i], BaseException), outcome[i]
        at, exceptions, errors = outcome[i]
        assert not exceptions and not errors, (exceptions, errors)
        run = at.session_state["run"]
        assert len(run.records) == 3
        config = DecodeConfig(max_new_tokens=len(run.token_ids), eos_token_ids=())
        ar = generate(pair.target.model, run.prompt_ids, make_policy("ar"), config=config)
        assert run.token_ids == ar.token_ids[: len(run.token_ids)], f"session {i}"


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_fifty_runs_in_one_process_do_not_grow_memory():
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    config = DecodeConfig(max_new_tokens=24)

    def runs(n: int) -> None:
        for i in range(n):
            generate(target, PROMPTS[i % len(PROMPTS)], make_policy(POLICIES[i % len(POLICIES)]), draft=draft,
                     config=config)  # fmt: skip

    runs(10)  # warm-up: allocator pools, caches, lazy imports
    before = _rss_mb()
    runs(50)
    grown = _rss_mb() - before
    assert grown < 40, f"RSS grew {grown:.1f} MB over 50 runs"


def test_a_run_reaching_the_context_limit_ends_cleanly():
    from conftest import _config

    cls, cfg = _config("llama")
    cfg.max_position_embeddings = 24
    target = cls(cfg).eval()
    run = LiveRun.start(target, list(range(1, 11)), make_policy("fixed_tree"), draft=target,
                        config=DecodeConfig(max_new_tokens=100), settings={})  # fmt: skip
    while run.step() is not None:
        pass
    assert run.done and run.records[-1].stop == "context_limit"
    assert len(run.prompt_ids) + len(run.token_ids) == 24


def test_stop_and_restart_gives_the_same_tokens():
    """Pausing is simply not stepping: a run stepped in bursts (paused between them) and a
    restarted run with the same settings both equal one uninterrupted run."""
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    config = DecodeConfig(max_new_tokens=20)
    whole = generate(target, PROMPTS[0], make_policy("dynatree"), draft=draft, config=config).token_ids
    run = LiveRun.start(target, PROMPTS[0], make_policy("dynatree"), draft=draft, config=config, settings={})
    for _ in range(2):
        run.step()
    paused_at = len(run.token_ids)
    restarted = LiveRun.start(target, PROMPTS[0], make_policy("dynatree"), draft=draft, config=config, settings={})
    while restarted.step() is not None:
        pass
    while run.step() is not None:  # resume
        pass
    assert 0 < paused_at < len(whole)
    assert run.token_ids == restarted.token_ids == whole


def test_finished_runs_say_why_they_stopped():
    from dynatree_core.viz import stop_text

    assert "context window" in stop_text("context_limit")
    assert "end-of-sequence" in stop_text("eos") and "max new tokens" in stop_text("max_new_tokens")
    assert stop_text(None).startswith("Finished: stopped")
