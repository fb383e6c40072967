"""ProcessRun: a LiveRun (run.py) decoded by an `EngineProcess` (engine_process.py), the live
page's default. The models, the KV caches and the decoding loop live in a child process, so
drawing the page never takes time (or the GIL) from decoding."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from typing import Any

from dynatree_core.core.log import log_exception
from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.settings import RunSpec
from dynatree_core.drafting.policy import Policy
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.engine_process import EngineProcess, StartRun
from dynatree_core.live.jobs import JOB_TITLES
from dynatree_core.live.run import IDLE_TIMEOUT_S, LiveRun
from dynatree_core.runs.records import IterationRecord

STEP_TIMEOUT_S = 120.0  # one step's longest wait: an iteration of a big pair on a CPU, queued behind others


@dataclasses.dataclass
class ProcessRun(LiveRun):
    """A LiveRun decoded by an `EngineProcess` (engine_process.py): the same API, but the models,
    the KV caches and the decoding loop live in a child process, so drawing the page (Python, the
    GIL) never takes time from decoding. The child sends each record as soon as it exists; the
    parent's dispatcher thread appends it here (`on_message`), before `done`, like the thread
    worker. `beat()` is checked by the dispatcher (`on_tick`): a run whose page stopped watching
    is paused in the child. Snapshots are plain copies with no engine attached."""

    _engine: EngineProcess | None = dataclasses.field(default=None, init=False, repr=False)
    _rid: int = dataclasses.field(default=0, init=False, repr=False)
    _running: bool = dataclasses.field(default=False, init=False, repr=False)
    _stepping: bool = dataclasses.field(default=False, init=False, repr=False)
    _seq: int = dataclasses.field(default=0, init=False, repr=False)  # numbers "go"s; a stale "paused" is ignored
    _idle_timeout_s: float = dataclasses.field(default=IDLE_TIMEOUT_S, init=False, repr=False)
    _cond: threading.Condition = dataclasses.field(default_factory=threading.Condition, init=False, repr=False)
    busy_text: str = dataclasses.field(default="", init=False, repr=False)  # the engine's last "busy" answer

    @classmethod
    def start_in(
        cls,
        engine: EngineProcess,
        prompt_ids: list[int],
        policy: Policy,
        *,
        settings: dict[str, Any],
        spec: RunSpec | None = None,
        config: DecodeConfig = DecodeConfig(),
    ) -> ProcessRun:
        """Start decoding in `engine` (waits for its models to load; DynaTreeError if they cannot)."""
        info = engine.wait_ready()
        tokenizer = info.tokenizer
        run = cls(
            settings=dict(settings),
            spec=spec,
            prompt_ids=list(prompt_ids),
            policy_name=policy.name,
            params=dict(policy.config),
            device=info.device,
            dtype=info.dtype,
            threads=info.threads,
            draft_kind=info.draft_kind if policy.needs_draft_model else "",
            vocab_size=info.vocab_size,
            _decode=lambda tok: tokenizer.decode([tok]),
        )
        run._engine = engine
        run._rid = engine.register(run)
        weakref.finalize(run, engine.drop, run._rid)  # the page forgot the run: free it in the child
        engine.send("start", run._rid, StartRun(list(prompt_ids), policy.name, dict(policy.config), config))
        return run

    # ----- messages from the engine (its dispatcher thread) ---------------------------------------
    def on_message(self, kind: str, payload: Any) -> None:
        with self._cond:
            if kind == "record":
                self.records.append(payload)  # before `done`, as in the thread worker
                if payload.stop is not None:
                    self.done = True
                    self._running = False
                self._stepping = False
                self.on_tick()  # a fast run may finish between two dispatcher ticks
            elif kind == "done":
                self.done, self._running, self._stepping = True, False, False
            elif kind == "paused":
                if payload == self._seq:  # not a pause that a later "go" overtook
                    self._running = False
            elif kind == "error":
                self.error = payload
                self.done, self._running, self._stepping = True, False, False
            elif kind == "busy":  # a step the engine could not take now; the run goes on
                self.busy_text, self._stepping = payload, False
            self._cond.notify_all()

    def on_tick(self) -> None:
        if self._running and time.monotonic() - self._last_beat >= self._idle_timeout_s:
            self.idle_paused = True  # the page went away: stop using the cores
            self.pause()

    # ----- the LiveRun API ------------------------------------------------------------------------
    def step(
        self, lock: contextlib.AbstractContextManager | None = None, *, timeout_s: float = STEP_TIMEOUT_S
    ) -> IterationRecord | None:
        """One iteration in the engine process, waited for at most `timeout_s`. The lock is not
        needed: the engine process runs one forward at a time. DynaTreeError when the engine
        answers "busy" (a job holds it) or does not answer in time; the run goes on either way."""
        if self._engine is None:
            return super().step(lock)
        if self._running:
            raise RuntimeError("the run is decoding in its engine process: pause it before stepping")
        if self.done:
            return None
        with self._cond:
            before = len(self.records)
            self._stepping, self.busy_text = True, ""
        self._send("step")
        with self._cond:
            answered = self._cond.wait_for(lambda: not self._stepping, timeout_s)
            self._stepping = False
        if self.error is not None and len(self.records) == before:
            raise self.error
        if self.busy_text:
            raise DynaTreeError(self.busy_text)
        if not answered:
            raise DynaTreeError(f"the engine did not take the step within {timeout_s:.0f} s; it comes when it can")
        return self.records[before] if len(self.records) > before else None

    def start_worker(
        self, lock: contextlib.AbstractContextManager | None = None, *, idle_timeout_s: float = IDLE_TIMEOUT_S
    ) -> bool:
        if self._engine is None:
            return super().start_worker(lock, idle_timeout_s=idle_timeout_s)
        with self._cond:
            if self.done or (self._running and not self._pause.is_set()):
                return False
            self._pause.clear()
            self._seq += 1
            self._running, self.idle_paused, self._idle_timeout_s = True, False, idle_timeout_s
        self.beat()
        self._send("go", self._seq)
        return True

    @property
    def worker_running(self) -> bool:
        return self._running if self._engine is not None else super().worker_running

    def pause(self) -> None:
        if self._engine is None or not self._running:
            return
        self._pause.set()
        self._send("pause", self._seq)

    def waiting_for(self) -> str:
        """While this run decodes and a job holds its engine: what it waits for, in words."""
        busy = self._engine.busy_with() if self._engine is not None and self._running else None
        if busy is None:
            return ""
        name, queued = busy
        more = f", {queued} more job(s) queued" if queued else ""
        return (
            f"The engine of this model pair is running {JOB_TITLES.get(name, name)} for a page (jobs run alone, "
            f"so their timings are their own); this run goes on when it ends{more}."
        )

    def wait(self, timeout_s: float, *, records: int | None = None) -> bool:
        if self._engine is None:
            return super().wait(timeout_s, records=records)
        with self._cond:
            self._cond.wait_for(
                lambda: not self._running or (records is not None and len(self.records) >= records),
                max(0.0, timeout_s),
            )
            return not self._running

    def close(self) -> None:
        """Discard the run: the child stops decoding it and frees its caches (no answer comes)."""
        if self._engine is None:
            return
        self._engine.drop(self._rid)
        with self._cond:
            self._running = self._stepping = False
            self._cond.notify_all()

    def _send(self, kind: str, payload: Any = None) -> None:
        """A command for this run; an engine that is gone ends the run with its message."""
        try:
            self._engine.send(kind, self._rid, payload)
        except Exception as exc:  # noqa: BLE001 - DynaTreeError: the child died (its dispatcher tells us too)
            log_exception(f"run {self._rid}: {kind!r} could not reach the engine", exc)
            self.on_message("error", exc)
