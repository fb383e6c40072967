"""A pair's engine: a Ray actor that holds one model pair for every page and session of a server,
so drawing a page never takes time from decoding, and a pair may run on any node of a cluster.

An engine in a thread of a process whose Python draws shares the GIL with the drawing and slows
down; in another process it does not (benchmarks/drawing_contention.py measures both; BENCHMARKS.md,
"The live page against the CLI"). `Engine` is the app's side of that process, a Ray actor
(actor.py; a local runtime started on first use, or the cluster DYNATREE_RAY_ADDRESS names:
measure/cluster.connect), placed on a node with room (actor.place). The actor loads
one model pair, keeps any number of live runs (one `engine.decode` generator each, so every run
keeps its own KV caches) and decodes the runs it was asked to run round-robin, one iteration at a
time. Between iterations it takes queued jobs (jobs.py: a comparison, a benchmark, the Lab, a
reference or baseline, the latency profile), one at a time in arrival order, each to its end with
no live iteration in between (so a job's timings are its own; live runs wait meanwhile). A reader
thread takes commands off the inbox as they come, so a sender never blocks on a busy child, and
answers a "step" at once with "busy" while a job holds the engine. The app's dispatcher thread
polls the actor for records (a poll gathers what came within GATHER_S), so the decoding loop never
waits for a page. An actor that dies (its node lost, killed) fails the poll: every run and job
then gets a message. The actor belongs to the app's process (not detached): it ends with it.

Protocol (all tuples; `rid` names a run or a job):

  parent -> child  ("start", rid, StartRun) ("go", rid, seq) ("step", rid) ("pause", rid, seq)
                   ("drop", rid) ("job", rid, (name, payload)) ("runs", rid) ("quit", 0)
  child -> parent  ("ready", 0, EngineInfo) ("failed", 0, exc) ("record", rid, IterationRecord)
                   ("done", rid, None) ("paused", rid, seq) ("error", rid, exc) ("busy", rid, text)
                   ("dropped", rid, None) ("started", rid, None) ("event", rid, (kind, data))
                   ("result", rid, a job's result, or the list of runs the child holds)

Every command is answered: "start" by nothing unless it fails ("error"), "go" by exactly one of
"done", "paused" (echoing the seq it was sent with, so a pause that a later "go" overtook is
recognised) or "error"; "step" by one "record" (possibly followed by "done"), "done", "error" or
"busy" (a job holds the engine, or the run is decoding); "pause" by "paused"; "drop" by "dropped";
"job" by "started", any "event"s, then "result" or "error"; "runs" by "result". Every exception the
child meets is written with its traceback to the server log (core/log.py) before its message is
sent. The child knows nothing of Streamlit; it exits when the parent says "quit" (or Ray ends it
with the parent's process).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
import time
import weakref
from typing import Any

from dynatree_core.core.log import log_info
from dynatree_core.core.settings import env
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.actor import ActorTransport
from dynatree_core.live.engine_child import POLL_S, EngineInfo, PairSpec, StartRun, pair_info

__all__ = ["CALL_TIMEOUT_S", "Engine", "EngineInfo", "JobHandle", "PairSpec", "StartRun", "call", "pair_info"]

LOAD_TIMEOUT_ENV = "DYNATREE_LOAD_TIMEOUT"
CALL_TIMEOUT_S = 600.0  # a one-off job waited for in one call (a reference, the latency profile)


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from environment variable `name` (unset: `default`)."""
    raw = env(name)
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise DynaTreeError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise DynaTreeError(f"{name} must be positive, not {raw}")
    return value


def load_timeout_s() -> float:
    """How long a page waits for a pair's engine to load and warm up (DYNATREE_LOAD_TIMEOUT, s)."""
    return env_seconds(LOAD_TIMEOUT_ENV, 900.0)


class Engine(ActorTransport):
    """A Ray actor that owns one model pair and serves this process's runs and jobs (module docstring).

    Objects that `register()` receive the child's messages about their rid through `on_message`
    (called from the dispatcher thread) and a `on_tick()` about every POLL_S seconds (to pause runs
    nobody watches). If the child dies, every registered object gets an ("error", ...) message.
    The jobs sent and not yet answered are kept in order (`queue_position`, `busy_with`), and
    `in_use` says whether anything still needs this engine (a loading engine, a live run that has
    not finished, a queued or running job), so a pool never closes one under its users.
    """

    def __init__(self, spec: PairSpec):
        self.spec = spec
        self._launch()
        # reentrant: a send first drops the forgotten runs (sends of their own), all under this lock, so
        # no command overtakes the drop of a run forgotten before it
        self._send_lock = threading.RLock()
        # weak: a run the page forgot is garbage-collected, and its finalizer drops it in the child
        self._listeners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._forgotten: queue.SimpleQueue = queue.SimpleQueue()  # runs to drop (forget)
        self._ids = itertools.count(1)
        self._ready = threading.Event()
        self._jobs: collections.OrderedDict[int, str] = collections.OrderedDict()  # rid -> job name, sent order
        self._jobs_lock = threading.Lock()
        self.started_at = time.monotonic()
        self.info: EngineInfo | None = None
        self.failure: Exception | None = None
        self._dispatcher = threading.Thread(target=self._dispatch, name="dynatree-engine-dispatch", daemon=True)
        self._dispatcher.start()

    # -- lifecycle --
    def wait_ready(self, timeout_s: float | None = None) -> EngineInfo:
        """The child's EngineInfo once its models are loaded (waits at most `timeout_s`, default
        DYNATREE_LOAD_TIMEOUT); DynaTreeError if it could not load or took longer."""
        timeout_s = load_timeout_s() if timeout_s is None else timeout_s
        if not self._ready.wait(timeout_s):
            raise DynaTreeError(
                f"the engine did not load {self.spec.target!r} within {timeout_s:.0f} s "
                f"({LOAD_TIMEOUT_ENV} to wait longer)"
            )
        if self.info is None:
            exc = self.failure
            raise exc if isinstance(exc, DynaTreeError) else DynaTreeError(f"the engine could not load: {exc}")
        return self.info

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def in_use(self) -> bool:
        """Loading, or holding a live run that has not finished, or a job not yet answered."""
        if not self._ready.is_set() and self.alive:
            return True
        with self._jobs_lock:
            if self._jobs:
                return True
        return any(getattr(listener, "done", True) is False for listener in list(self._listeners.values()))

    @property
    def load(self) -> int:
        """Unfinished live runs and unanswered jobs: how busy this engine is (the pool's replicas)."""
        with self._jobs_lock:
            jobs = len(self._jobs)
        return jobs + sum(getattr(listener, "done", True) is False for listener in list(self._listeners.values()))

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the child to exit (after its current iteration or job), then make sure it did."""
        with contextlib.suppress(DynaTreeError):
            self.send("quit", 0)
        self._end(timeout_s)

    # -- messages --
    def register(self, listener: Any) -> int:
        rid = next(self._ids)
        self._listeners[rid] = listener
        return rid

    def unregister(self, rid: int) -> None:
        self._listeners.pop(rid, None)

    def send(self, kind: str, rid: int, payload: Any = None) -> None:
        """One command to the child (its reader thread takes it at once, so this never waits on a
        busy child); DynaTreeError when the child is gone."""
        with self._send_lock:
            self._drop_forgotten()
            try:
                self._put((kind, rid, payload))
            except (OSError, ValueError) as exc:  # broken pipe, or closed
                raise DynaTreeError(f"the engine is gone ({self._exit_text()})") from exc

    def drop(self, rid: int) -> None:
        """Forget run or job `rid` here and in the child (its KV caches are freed, a queued job
        leaves the queue); never raises."""
        self.unregister(rid)
        with self._jobs_lock:
            self._jobs.pop(rid, None)
        if self.alive:
            with contextlib.suppress(DynaTreeError):
                self.send("drop", rid)

    # -- jobs --
    def submit(self, name: str, payload: dict, listener: Any) -> int:
        """Queue job `name` (jobs.py) for `listener` (a JobHandle); its rid."""
        rid = self.register(listener)
        with self._jobs_lock:
            self._jobs[rid] = name
        try:
            self.send("job", rid, (name, payload))
        except DynaTreeError:
            self.drop(rid)
            raise
        return rid

    def queue_position(self, rid: int) -> int | None:
        """0 when job `rid` runs (or is next), k when k jobs are ahead of it; None once answered."""
        with self._jobs_lock:
            order = list(self._jobs)
        return order.index(rid) if rid in order else None

    def busy_with(self) -> tuple[str, int] | None:
        """(the name of the job holding the engine, jobs queued behind it), or None when no job is."""
        with self._jobs_lock:
            names = list(self._jobs.values())
        return (names[0], len(names) - 1) if names else None

    def forget(self, rid: int) -> None:
        """Drop run `rid` soon, from the dispatcher thread: what a finalizer calls (it may run inside
        any call of any thread, a Ray call included, and Ray's calls are not reentrant)."""
        self._forgotten.put(rid)

    def _drop_forgotten(self) -> None:
        """Drop the runs forgotten so far (before any other command: the child frees them first)."""
        with self._send_lock:  # the send lock (reentrant): a command sent meanwhile waits for these drops
            while True:
                try:
                    rid = self._forgotten.get_nowait()
                except queue.Empty:
                    return
                self.drop(rid)

    def _dispatch(self) -> None:
        while True:
            self._drop_forgotten()
            try:
                kind, rid, payload = self._get(POLL_S)
            except queue.Empty:
                if not self.alive:
                    if self._last_messages():  # what it said before it ended ("failed": why) comes first
                        continue
                    self._child_died()
                    return
                for listener in list(self._listeners.values()):
                    listener.on_tick()
                continue
            except (EOFError, OSError):
                self._child_died()
                return
            if kind in ("ready", "failed"):
                self.info, self.failure = (payload, None) if kind == "ready" else (None, payload)
                self._ready.set()
                if kind == "failed":
                    return
                continue
            if kind in ("result", "error"):
                with self._jobs_lock:
                    self._jobs.pop(rid, None)
            listener = self._listeners.get(rid)
            if listener is not None:
                listener.on_message(kind, payload)

    def _child_died(self) -> None:
        if not self._ready.is_set():
            self.failure = DynaTreeError(f"the engine ended while loading ({self._exit_text()})")
            self._ready.set()
        log_info("engine %s ended (%s)", self.spec.title(), self._exit_text())
        with self._jobs_lock:
            self._jobs.clear()
        exc = DynaTreeError(f"the engine ended unexpectedly ({self._exit_text()}); press Run to restart it")
        for listener in list(self._listeners.values()):
            listener.on_message("error", exc)


class JobHandle:
    """A job sent to an engine (Engine.submit): its events as they come (`events`), then its
    result or error. `done` is False until answered, so the engine counts as in use meanwhile."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.started = False
        self.events: queue.Queue = queue.Queue()
        self.result: Any = None
        self.error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    def on_message(self, kind: str, payload: Any) -> None:
        if kind == "started":
            self.started = True
        elif kind == "event":
            self.events.put(payload)
        elif kind == "busy":
            self.error = DynaTreeError(payload)
            self.finished.set()
        elif kind in ("result", "error"):
            self.result, self.error = (payload, None) if kind == "result" else (None, payload)
            self.finished.set()

    def on_tick(self) -> None:
        pass


def call(engine: Engine, kind: str, payload: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """Send one command ("runs") or job ("job", (name, payload)) and wait for its answer at most
    `timeout_s` (raises the child's exception, or DynaTreeError on the timeout)."""
    handle = JobHandle()
    if kind == "job":
        name, job_payload = payload
        rid = engine.submit(name, job_payload, handle)
    else:
        rid = engine.register(handle)
        engine.send(kind, rid, payload)
    try:
        if not handle.finished.wait(timeout_s):
            raise DynaTreeError(f"the engine did not answer {kind!r} within {timeout_s:.0f} s")
    finally:
        if handle.done:
            engine.unregister(rid)
        else:
            engine.drop(rid)  # nobody waits for it any more: a queued job leaves the queue
    if handle.error is not None:
        raise handle.error
    return handle.result
