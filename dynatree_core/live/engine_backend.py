"""EngineBackend: a run decoded by an `Engine` (engine.py), the live page's default.

The models, the KV caches and the decoding loop live in the engine's process (a Ray actor), so drawing the page
(Python, the GIL) never takes time from decoding. The backend turns the run's calls into commands
for its rid and the child's answers into the run's state: the engine's dispatcher thread calls
`on_message` with each record as soon as it exists and appends it, before `done`, like the thread
worker. `on_tick` (also the dispatcher's) pauses a run whose page stopped calling `beat()`. A run
the page forgets is dropped in the child when this backend is garbage-collected.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from typing import Any

from dynatree_core.core.log import log_exception
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.engine import Engine, StartRun
from dynatree_core.live.jobs import JOB_TITLES
from dynatree_core.live.state import RunState
from dynatree_core.runs.records import IterationRecord


class EngineBackend:
    """Run `rid` of `engine`, started with `start` (raises DynaTreeError when the engine is gone)."""

    def __init__(self, state: RunState, engine: Engine, start: StartRun):
        self._state = state
        self._engine = engine
        self._cond = threading.Condition()  # guards the flags below; notified on every answer
        self._running = False  # a "go" is in force: the child decodes this run round-robin
        self._stepping = False  # a "step" waits for its answer
        self._pause = threading.Event()  # a "pause" was sent for the current "go"
        self._seq = 0  # numbers "go"s; a "paused" that a later "go" overtook is ignored
        self._busy_text = ""  # the engine's last "busy" answer to a step
        self._idle_timeout_s = math.inf
        self._last_beat = 0.0
        self.rid = engine.register(self)
        weakref.finalize(self, engine.forget, self.rid)  # the page forgot the run: free it in the child
        engine.send("start", self.rid, start)

    # ----- messages from the engine (its dispatcher thread) ---------------------------------------
    @property
    def done(self) -> bool:
        """Read by Engine.in_use: an engine with an unfinished run is not closed."""
        return self._state.done

    def on_message(self, kind: str, payload: Any) -> None:
        state = self._state
        with self._cond:
            if kind == "record":
                state.records.append(payload)  # before `done`, as in the thread worker
                if payload.stop is not None:
                    state.done = True
                    self._running = False
                self._stepping = False
                self.on_tick()  # a fast run may finish between two dispatcher ticks
            elif kind == "done":
                state.done, self._running, self._stepping = True, False, False
            elif kind == "paused":
                if payload == self._seq:  # not a pause that a later "go" overtook
                    self._running = False
            elif kind == "error":
                state.error = payload
                state.done, self._running, self._stepping = True, False, False
            elif kind == "busy":  # a step the engine could not take now; the run goes on
                self._busy_text, self._stepping = payload, False
            self._cond.notify_all()

    def on_tick(self) -> None:
        if self._running and time.monotonic() - self._last_beat >= self._idle_timeout_s:
            self._state.idle_paused = True  # the page went away: stop using the cores
            self.pause()

    # ----- the run's calls ------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._running

    def step(self, lock: contextlib.AbstractContextManager | None, timeout_s: float) -> IterationRecord | None:
        """One iteration in the engine process, waited for at most `timeout_s`. The lock is not
        needed: the engine process runs one forward at a time. DynaTreeError when the engine
        answers "busy" (a job holds it) or does not answer in time; the run goes on either way."""
        state = self._state
        if self._running:
            raise RuntimeError("the run is decoding in its engine process: pause it before stepping")
        if state.done:
            return None
        with self._cond:
            before = len(state.records)
            self._stepping, self._busy_text = True, ""
        self._send("step")
        with self._cond:
            answered = self._cond.wait_for(lambda: not self._stepping, timeout_s)
            self._stepping = False
        if state.error is not None and len(state.records) == before:
            raise state.error
        if self._busy_text:
            raise DynaTreeError(self._busy_text)
        if not answered:
            raise DynaTreeError(f"the engine did not take the step within {timeout_s:.0f} s; it comes when it can")
        return state.records[before] if len(state.records) > before else None

    def start(self, lock: contextlib.AbstractContextManager | None, idle_timeout_s: float) -> bool:
        """ "go": the child decodes this run between its other work until done or paused."""
        with self._cond:
            if self._state.done or (self._running and not self._pause.is_set()):
                return False
            self._pause.clear()
            self._seq += 1
            self._running, self._state.idle_paused, self._idle_timeout_s = True, False, idle_timeout_s
        self.beat()
        self._send("go", self._seq)
        return True

    def beat(self) -> None:
        self._last_beat = time.monotonic()

    def pause(self) -> None:
        if not self._running:
            return
        self._pause.set()
        self._send("pause", self._seq)

    def wait(self, timeout_s: float, records: int | None) -> bool:
        with self._cond:
            self._cond.wait_for(
                lambda: not self._running or (records is not None and len(self._state.records) >= records),
                max(0.0, timeout_s),
            )
            return not self._running

    def close(self) -> None:
        """The child stops decoding the run and frees its caches (no answer comes)."""
        self._engine.drop(self.rid)
        with self._cond:
            self._running = self._stepping = False
            self._cond.notify_all()

    def waiting_for(self) -> str:
        """While this run decodes and a job holds its engine: what it waits for, in words."""
        busy = self._engine.busy_with() if self._running else None
        if busy is None:
            return ""
        name, queued = busy
        more = f", {queued} more job(s) queued" if queued else ""
        return (
            f"The engine of this model pair is running {JOB_TITLES.get(name, name)} for a page (jobs run alone, "
            f"so their timings are their own); this run goes on when it ends{more}."
        )

    def _send(self, kind: str, payload: Any = None) -> None:
        """A command for this run; an engine that is gone ends the run with its message."""
        try:
            self._engine.send(kind, self.rid, payload)
        except Exception as exc:  # noqa: BLE001 - DynaTreeError: the child died (its dispatcher tells us too)
            log_exception(f"run {self.rid}: {kind!r} could not reach the engine", exc)
            self.on_message("error", exc)
