"""ThreadBackend: a run decoded by the engine's generator in this process (DYNATREE_LIVE_ENGINE=thread).

Each `step()` runs exactly one iteration (one target forward) under the caller's lock, because the
models are shared by every session of the app process. `start()` runs the same steps in a daemon
worker thread, so the engine decodes at its own speed while the page draws the latest iteration at
its own cadence: the worker only appends to the run's records and sets `done` after the last
append (state.py). `pause()` takes effect after the current iteration; a worker whose page stops
calling `beat()` pauses itself, so a closed tab never leaves a thread decoding; an exception ends
the run and is kept in the state's `error`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from dynatree_core.core.log import log_exception
from dynatree_core.live.state import RunState
from dynatree_core.runs.records import IterationRecord


class ThreadBackend:
    """Steps `steps` (an `engine.decode` generator, which owns the run's KV caches) into `state`."""

    def __init__(self, state: RunState, steps: Iterator[IterationRecord]):
        self._state = state
        self._steps: Iterator[IterationRecord] | None = steps  # None once the run has ended (caches released)
        self._worker: threading.Thread | None = None
        self._pause = threading.Event()
        self._gate = threading.Lock()  # one iteration at a time, whichever thread asks
        self._last_beat = 0.0

    @property
    def running(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def step(self, lock: contextlib.AbstractContextManager | None, timeout_s: float) -> IterationRecord | None:
        """One iteration in the calling thread (`timeout_s` is not needed: nothing queues ahead of
        it but the lock). RuntimeError while the worker decodes."""
        if self.running and threading.current_thread() is not self._worker:
            raise RuntimeError("the run is decoding in its worker thread: pause it before stepping")
        with self._gate:
            return self._advance(lock)

    def _advance(self, lock: contextlib.AbstractContextManager | None) -> IterationRecord | None:
        state = self._state
        if state.done or self._steps is None:
            state.done = True
            return None
        # torch applies the process's thread count (core/threads.py) to a new thread lazily, at its first
        # parallel op; until then MKL matmuls in that thread use every core (measured: a fresh
        # thread's matmuls ran on 2 cores after set_num_threads(1)). Asking for it applies it.
        state.threads = torch.get_num_threads()
        try:
            with lock if lock is not None else contextlib.nullcontext():
                record = next(self._steps, None)
        except Exception as exc:  # e.g. the prompt does not fit the context: the run cannot go on
            log_exception(f"live run ({state.policy_name})", exc)
            state.error, self._steps = exc, None
            state.done = True
            raise
        if record is not None:
            state.records.append(record)  # before `done`: a reader that saw done has every record
        if record is None or record.stop is not None:
            self._steps = None  # release the KV caches
            state.done = True
        return record

    def start(self, lock: contextlib.AbstractContextManager | None, idle_timeout_s: float) -> bool:
        """Decode in a daemon thread until the run is done, `pause()` is asked, or nobody has called
        `beat()` for `idle_timeout_s` seconds. False when there is nothing to start (done, running)."""
        if self._state.done:
            return False
        if self.running and (not self._pause.is_set() or not self.wait(5.0, None)):
            return False  # already decoding, or still busy with the iteration it was paused in
        self._pause.clear()
        self._state.idle_paused = False
        self.beat()
        self._worker = threading.Thread(
            target=self._work, args=(lock, idle_timeout_s), name="dynatree-live-run", daemon=True
        )
        self._worker.start()
        return True

    def _work(self, lock: contextlib.AbstractContextManager | None, idle_timeout_s: float) -> None:
        while not self._state.done and not self._pause.is_set():
            if time.monotonic() - self._last_beat >= idle_timeout_s:
                self._state.idle_paused = True  # the page went away: stop using the cores
                return
            try:
                with self._gate:
                    self._advance(lock)
            except Exception:  # _advance() has logged it, ended the run and kept it in `error`
                return

    def beat(self) -> None:
        self._last_beat = time.monotonic()

    def pause(self) -> None:
        self._pause.set()

    def wait(self, timeout_s: float, records: int | None) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.running and (records is None or len(self._state.records) < records):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._worker.join(left if records is None else min(left, 0.02))  # records: poll every 20 ms
        return not self.running

    def close(self) -> None:
        """Stop decoding after the current iteration (a forward cannot be interrupted); the caches
        go with this backend."""
        self.pause()
        self.wait(0.0, None)

    def waiting_for(self) -> str:
        return ""  # a job in this process takes the forward lock between two iterations: nothing to say
