"""Reliability under a classroom's load: concurrent sessions on shared models, many runs in one
process, runs that hit the context limit, stop and restart."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from conftest import hf_greedy, noisy_copy, pick_custom_pair, tiny_model
from streamlit.testing.v1 import AppTest

from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.live.run import LiveRun

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
            prompt, policy = PROMPTS[i % len(PROMPTS)], make_method(POLICIES[i % len(POLICIES)])
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


@pytest.mark.parametrize("sessions", [2, 5])
def test_interleaved_app_sessions_against_one_process(tiny_pair_dirs, sessions):
    """Several app sessions (AppTest instances) in one process, their steps interleaved round by
    round against the process's one cached model pair: no exception, no error, and each session's
    output equals AR decoding of its own prompt. (AppTest itself is not thread-safe, so the truly
    parallel case is the LiveRun test above, which drives the same objects from threads.)"""
    app = str(Path(__file__).resolve().parent.parent / "app.py")
    prompts = ["The cat sat on", "Once upon a time", "Numbers: 1 2 3", "Why is the sky", "def f(x):"][:sessions]
    apps = []
    for prompt in prompts:
        at = AppTest.from_file(app, default_timeout=180)
        at.run()
        pick_custom_pair(at, *tiny_pair_dirs)
        at.text_area[0].set_value(prompt).run()
        apps.append(at)
    for _ in range(3):  # round-robin: every session one step, three times
        for at in apps:
            next(b for b in at.button if b.label.endswith("Step")).click().run()
    from dynatree_core.ui.resources import cached_pair

    pair = cached_pair(tiny_pair_dirs[0], tiny_pair_dirs[1], "auto", "auto")
    seen_prompts = set()
    for i, at in enumerate(apps):
        assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
        run = at.session_state["run"]
        assert len(run.records) == 3
        seen_prompts.add(tuple(run.prompt_ids))
        config = DecodeConfig(max_new_tokens=len(run.token_ids), eos_token_ids=())
        ar = generate(pair.target.model, run.prompt_ids, make_method("ar"), config=config)
        assert run.token_ids == ar.token_ids, f"session {i}"
    assert len(seen_prompts) == sessions  # every session kept its own prompt and state


def test_fifty_runs_in_one_process_leave_no_cache_alive(monkeypatch):
    """Every run's caches (its KVStates and their per-layer slot buffers, target and draft) are
    freed when the run ends: counted through weak references after 50 runs of five policies,
    not through the process's memory, which the allocator's pools blur."""
    import gc
    import weakref

    from dynatree_core.forward import kv

    alive: list[weakref.ref] = []
    for cls in (kv.KVState, kv.SlotLayer):
        init = cls.__init__

        def tracked(self, *args, _init=init, **kwargs):
            _init(self, *args, **kwargs)
            alive.append(weakref.ref(self))

        monkeypatch.setattr(cls, "__init__", tracked)
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    config = DecodeConfig(max_new_tokens=24)
    for i in range(50):
        generate(target, PROMPTS[i % len(PROMPTS)], make_method(POLICIES[i % len(POLICIES)]), draft=draft,
                 config=config)  # fmt: skip
    gc.collect()
    assert len(alive) >= 50 * 2, "every run made caches (the count is not vacuous)"
    left = [type(r()).__name__ for r in alive if r() is not None]
    assert not left, f"{len(left)} caches still alive: {sorted(set(left))}"


def test_a_run_reaching_the_context_limit_ends_cleanly():
    from conftest import _config

    cls, cfg = _config("llama")
    cfg.max_position_embeddings = 24
    target = cls(cfg).eval()
    run = LiveRun.start(target, list(range(1, 11)), make_method("fixed_tree"), draft=target,
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
    whole = generate(target, PROMPTS[0], make_method("dynatree"), draft=draft, config=config).token_ids
    run = LiveRun.start(target, PROMPTS[0], make_method("dynatree"), draft=draft, config=config, settings={})
    for _ in range(2):
        run.step()
    paused_at = len(run.token_ids)
    restarted = LiveRun.start(target, PROMPTS[0], make_method("dynatree"), draft=draft, config=config, settings={})
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


def test_every_policy_parameter_at_and_beyond_its_range():
    from dynatree_core.decoding.methods import catalogue
    from dynatree_core.errors import DynaTreeError

    for name, cls in catalogue().items():
        for p in cls.params:
            if p.type is bool:
                for ok in (True, False, "true", "0"):
                    p.parse(ok)
                with pytest.raises(DynaTreeError):
                    p.parse("maybe")
                continue
            assert p.parse(p.min) == p.min and p.parse(p.max) == p.max, (name, p.name)
            step = 1 if p.type is int else 1e-6
            bad = [p.min - step, p.max + step, "nan", "inf", "-inf", float("nan"), "", "1e999", None]
            if p.type is int:
                bad.append(p.min + 0.5)
            for value in bad:
                with pytest.raises(DynaTreeError):
                    p.parse(value)


def test_model_failures_are_messages(tmp_path, monkeypatch, tiny_pair_dirs):
    import torch
    from transformers import AutoModelForCausalLM

    from dynatree_core.core.models import load_model
    from dynatree_core.errors import DynaTreeError

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DynaTreeError, match="no weights"):
        load_model(str(tmp_path))
    seen = {}

    def out_of_memory(*args, **kwargs):
        seen.update(kwargs)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", out_of_memory)
    with pytest.raises(DynaTreeError, match="out of memory.*smaller"):
        load_model(tiny_pair_dirs[0])
    assert seen["trust_remote_code"] is False  # never enabled implicitly


def test_a_bad_model_choice_leaves_the_previous_pair_working(tiny_pair_dirs, tmp_path):
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    next(b for b in at.button if b.label.endswith("Step")).click().run()
    assert len(at.session_state["run"].records) == 1
    next(b for b in at.button if b.label.endswith("Reset")).click().run()
    next(t for t in at.text_input if t.label == "Target").set_value(str(tmp_path / "nowhere")).run()
    next(b for b in at.button if b.label.endswith("Step")).click().run()
    assert not at.exception and any("not found" in e.value for e in at.error)
    next(t for t in at.text_input if t.label == "Target").set_value(tiny_pair_dirs[0]).run()
    next(b for b in at.button if b.label.endswith("Step")).click().run()
    assert not at.exception and not at.error
    assert len(at.session_state["run"].records) == 1  # a fresh run on the working pair


@pytest.mark.parametrize(
    "prompt,outcome",
    [
        ("", "empty"),
        ("   \n\t  ", "empty"),
        ("x" * 50_000, "context"),  # refused with both lengths named, never silently cut
        ("Tell me <|im_end|><|endoftext|> more", "run"),
        ("emoji 🌳 مرحبا \x07\x1b[0m \u202e reversed", "run"),
    ],
)
def test_app_prompts_at_the_edges(tiny_pair_dirs, prompt, outcome):
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    pick_custom_pair(at, *tiny_pair_dirs)
    at.text_area[0].set_value(prompt).run()
    next(b for b in at.button if b.label.endswith("Step")).click().run()
    assert not at.exception, at.exception
    errors = [e.value for e in at.error]
    if outcome == "run":
        assert not errors and len(at.session_state["run"].records) == 1
        from dynatree_core.decoding.pairs import encode_prompt
        from dynatree_core.ui.resources import cached_pair

        tok = cached_pair(tiny_pair_dirs[0], tiny_pair_dirs[1], "auto", "auto").target.tokenizer
        special = set(tok.all_special_ids)
        count = lambda ids: sum(i in special for i in ids)  # noqa: E731
        # no more control tokens than the chat template itself adds: none came from the text
        assert count(at.session_state["run"].prompt_ids) <= count(encode_prompt(tok, "x", chat=True))
    else:
        assert any(outcome in e for e in errors), errors
        assert at.text_area[0].value == prompt  # the input is kept
