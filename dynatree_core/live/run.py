"""LiveRun: a run that advances one iteration at a time, what the live app keeps per browser session.

A LiveRun is two parts: its `state` (state.py: settings, records, token texts, where it was
measured, done / error) and its `backend`, which decodes it and writes what comes into the state.
The run's API is the same in every mode: `step()` runs exactly one iteration (one target forward);
`start_worker()` decodes ahead of the page until the run is done, `pause()` is asked (it takes effect
after the current iteration) or the page stops calling `beat()` (a closed tab never leaves an engine
decoding); `wait()`, `stop()` and `close()` end that. The backends:

  ThreadBackend   (thread_backend.py)   the engine's generator in this process, a worker thread
  EngineBackend   (engine_backend.py)   the run's engine, a Ray actor (engine_run.EngineRun starts one)
  Detached        (here)                nothing to decode: an imported run, or a snapshot to draw

`LiveRun.start` starts a thread-backed run, `LiveRun.from_json` replays a run file. What the run
has is read off the run itself (`run.records`, `run.done`, `run.text(token)`): those names are its
state's. Knows nothing of Streamlit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.engine import DecodeConfig, decode, draft_kind, vocab_size
from dynatree_core.decoding.settings import RunSpec
from dynatree_core.drafting.policy import Policy
from dynatree_core.live.state import RunState
from dynatree_core.live.thread_backend import ThreadBackend
from dynatree_core.runs.records import IterationRecord, RunResult
from dynatree_core.runs.run_file import dump_run_file

# A page polls (calls `beat()`) every render interval, well under a second; decoding that has not
# heard from its page for this long belongs to a closed tab and pauses.
IDLE_TIMEOUT_S = 60.0
STEP_TIMEOUT_S = 120.0  # one step's longest wait: an iteration of a big pair on a CPU, queued behind others
Lock = contextlib.AbstractContextManager


class Backend(Protocol):
    """What a LiveRun asks of whatever decodes it. The backend writes records, `done`, `error`,
    `threads` and `idle_paused` into the run's state; the run never looks inside the backend."""

    @property
    def running(self) -> bool:
        """Decoding ahead of the page (started, not yet paused, done or failed)."""

    def step(self, lock: Lock | None, timeout_s: float) -> IterationRecord | None:
        """One iteration (None once the run is done); RuntimeError while running."""

    def start(self, lock: Lock | None, idle_timeout_s: float) -> bool:
        """Decode ahead of the page; False when there is nothing to start."""

    def pause(self) -> None:
        """Stop after the current iteration; returns at once."""

    def wait(self, timeout_s: float, records: int | None) -> bool:
        """Wait for decoding to stop or, given `records`, the run to have that many; True when stopped."""

    def beat(self) -> None:
        """The page still watches."""

    def close(self) -> None:
        """The page discards the run: stop decoding and free what it holds."""

    def waiting_for(self) -> str:
        """What a running run waits for, in words ("" when it decodes)."""


class Detached:
    """The backend of a run with nothing to decode: an imported file, or a snapshot."""

    running = False

    def __init__(self, state: RunState):
        self._state = state

    def step(self, lock: Lock | None, timeout_s: float) -> IterationRecord | None:
        self._state.done = True  # nothing more will come
        return None

    def start(self, lock: Lock | None, idle_timeout_s: float) -> bool:
        return False

    def pause(self) -> None:
        pass

    def wait(self, timeout_s: float, records: int | None) -> bool:
        return True

    def beat(self) -> None:
        pass

    def close(self) -> None:
        pass

    def waiting_for(self) -> str:
        return ""


class _OfState:
    """`run.<name>` is `run.state.<name>` (a field or method of RunState), read and written."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, run: LiveRun | None, owner: type | None = None) -> Any:
        return self if run is None else getattr(run.state, self.name)

    def __set__(self, run: LiveRun, value: Any) -> None:
        setattr(run.state, self.name, value)


class LiveRun:
    """A RunState decoded by a Backend (see the module docstring)."""

    def __init__(self, state: RunState, backend: Backend):
        self.state = state
        self.backend = backend

    # what the run has and says: its state's fields and methods (RunState has their docs)
    settings = _OfState()
    spec = _OfState()
    prompt_ids = _OfState()
    policy_name = _OfState()
    params = _OfState()
    records = _OfState()
    device = _OfState()
    dtype = _OfState()
    threads = _OfState()
    draft_kind = _OfState()
    imported = _OfState()
    vocab_size = _OfState()
    token_texts = _OfState()
    done = _OfState()
    error = _OfState()
    idle_paused = _OfState()
    token_ids = _OfState()
    text = _OfState()
    result = _OfState()
    to_json = _OfState()
    differs = _OfState()
    verifier = _OfState()

    @classmethod
    def start(
        cls,
        target: torch.nn.Module,
        prompt_ids: list[int],
        policy: Policy,
        *,
        settings: dict[str, Any],
        spec: RunSpec | None = None,
        draft: torch.nn.Module | None = None,
        config: DecodeConfig = DecodeConfig(),
        draft_token_map: TokenMap | None = None,
        detokenize: Callable[[int], str] | None = None,
    ) -> LiveRun:
        """Start decoding in this process; `detokenize` maps one token id to its text (the target's tokenizer)."""
        state = RunState.new(
            prompt_ids,
            policy,
            settings=settings,
            spec=spec,
            device=str(target.get_input_embeddings().weight.device),
            dtype=str(target.dtype).removeprefix("torch."),
            draft_kind=draft_kind(draft) if policy.needs_draft_model else "",
            vocab_size=vocab_size(target),
            detokenize=detokenize,
        )
        steps = decode(target, prompt_ids, policy, draft=draft, config=config, draft_token_map=draft_token_map)
        return cls(state, ThreadBackend(state, steps))

    @classmethod
    def from_json(cls, data: str | bytes) -> LiveRun:
        """A finished run to replay without models (raises ValueError on a malformed file)."""
        state = RunState.from_json(data)
        return cls(state, Detached(state))

    def step(self, lock: Lock | None = None, *, timeout_s: float = STEP_TIMEOUT_S) -> IterationRecord | None:
        """Run one iteration; None (and `done`) once the run has stopped. `lock` guards the models a
        thread-backed run shares with the app's other sessions (a process-backed run needs none);
        `timeout_s` bounds the wait for an engine process. Refused (RuntimeError) while the run
        decodes ahead (`worker_running`): pause it first."""
        return self.backend.step(lock, timeout_s)

    def start_worker(self, lock: Lock | None = None, *, idle_timeout_s: float = IDLE_TIMEOUT_S) -> bool:
        """Decode ahead of the page until the run is done, `pause()` is asked, or nobody has called
        `beat()` for `idle_timeout_s` seconds. False when there is nothing to start (done, running)."""
        return self.backend.start(lock, idle_timeout_s)

    @property
    def worker_running(self) -> bool:
        return self.backend.running

    def beat(self) -> None:
        """The page is still watching (call it on every poll)."""
        self.backend.beat()

    def pause(self) -> None:
        """Ask decoding to stop after its current iteration (returns at once)."""
        self.backend.pause()

    def wait(self, timeout_s: float, *, records: int | None = None) -> bool:
        """Wait up to `timeout_s` for decoding to stop or, given `records`, until the run has that
        many records. True when nothing decodes."""
        return self.backend.wait(timeout_s, records)

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Pause and wait a little for the current iteration to end (never forever: a forward
        cannot be interrupted). True when decoding has stopped."""
        self.pause()
        return self.wait(timeout_s)

    def close(self) -> None:
        """The page discards this run: stop decoding and free what it holds."""
        self.backend.close()

    def waiting_for(self) -> str:
        """While the run decodes: what it waits for, in words ("" when nothing holds it up)."""
        return self.backend.waiting_for()

    def snapshot(self) -> LiveRun:
        """A copy that no backend touches, to draw while this run decodes (a done snapshot is complete)."""
        state = self.state.snapshot()
        return type(self)(state, Detached(state))


def export_run(path, result: RunResult, spec: RunSpec, policy: Policy, prompt: str, chat: bool, target) -> None:
    """Write a CLI run as the app's run file (its settings as the live page records them);
    `target`: the loaded target (its tokenizer writes the token texts, its vocabulary the bound)."""
    settings = {**dataclasses.asdict(spec), "policy": policy.name, "params": policy.config, "prompt": prompt}
    settings["chat"] = chat
    decode_one = lambda t: target.tokenizer.decode([t])  # noqa: E731
    path.write_text(dump_run_file(result, settings, decode_one, vocab=vocab_size(target.model)))
