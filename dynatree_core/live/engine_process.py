"""The engine in its own process, so that drawing a page never takes time from decoding.

Measured (assets/benchmarks/drawing_contention.py): a 1-thread engine in a thread of
a process whose Python draws a third of the time lost ~37% of its speed (the GIL); the same
engine in a child process lost nothing. `EngineProcess` is that child for the live app. It loads
one model pair, keeps any number of runs (one `engine.decode` generator each, so every run keeps
its own KV caches) and decodes the runs it was asked to run round-robin, one iteration at a time,
reading its commands between iterations. Records go back over a multiprocessing queue whose
feeder thread sends them, so the decoding loop never waits for the page. One process per pair
also serialises every forward on that pair, as the app's forward lock did within one process.

Protocol (all tuples; `rid` names a run, or a one-off job such as an AR reference):

  parent -> child  ("start", rid, StartRun) ("go", rid, seq) ("step", rid) ("pause", rid, seq)
                   ("drop", rid) ("ar", rid, (prompt_ids, DecodeConfig, reference)) ("runs", rid)
                   ("quit", 0)   (reference: "ar", "hf_generate" or "hf_static", methods.REFERENCES)
  child -> parent  ("ready", 0, EngineInfo) ("failed", 0, exc) ("record", rid, IterationRecord)
                   ("done", rid, None) ("paused", rid, seq) ("error", rid, exc)
                   ("result", rid, RunResult or the list of runs the child holds)

Every "go" ends in exactly one of "done", "paused" (echoing the seq it was sent with, so a pause
that a later "go" overtook is recognised) or "error"; every "step" in one "record" (possibly
followed by "done"), "done" or "error". The child knows nothing of Streamlit; it exits
when the parent closes the command pipe (the parent died) or says "quit".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import multiprocessing as mp
import pickle
import queue
import threading
import weakref
from typing import Any

from dynatree_core.errors import DynaTreeError

# A spawned child starts a fresh interpreter: forking a process whose OpenMP runtime is already
# running threads can deadlock the child.
_CTX = mp.get_context("spawn")
POLL_S = 0.5  # how often the parent's dispatcher checks that the child is alive and runs are watched


@dataclasses.dataclass(frozen=True)
class PairSpec:
    target: str
    draft: str | None
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None  # None: core/threads.py decides (DYNATREE_THREADS, else the app's default)


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the child loaded: everything the page needs without loading the models itself."""

    device: str
    dtype: str
    threads: int  # torch threads the child decodes with
    tokenizer: Any  # the target's tokenizer (HF tokenizers pickle)
    eos_token_ids: frozenset[int]
    context_length: int
    has_draft: bool
    draft_is_stand_in: bool
    draft_kind: str  # "token" / "feature" / "fused" / "" (engine.draft_kind)
    pid: int
    vocab_size: int | None = None  # the target's vocabulary (run files record it)
    warmup_s: float = 0.0  # the warm-up decode before "ready" (first-call costs kept out of live runs)


@dataclasses.dataclass(frozen=True)
class StartRun:
    prompt_ids: list[int]
    policy: str
    params: dict[str, Any]
    config: Any  # engine.DecodeConfig (pickled as is)


def _portable(exc: BaseException) -> Exception:
    """The exception itself when it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc  # type: ignore[return-value]
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# ----- the child ---------------------------------------------------------------------------------
def _warm_up(pair, generate, make_method) -> float:
    """One short tree run and one AR run before the page's first: first-call costs (lazy imports,
    lean-forward construction, allocator and oneDNN caches) land here, not in a user's run."""
    import time

    from dynatree_core.decoding.engine import DecodeConfig
    from dynatree_core.decoding.pairs import encode_prompt

    t0 = time.perf_counter()
    try:
        target = pair.target
        ids = encode_prompt(target.tokenizer, "Say hello.", chat=target.has_chat_template)
        config = DecodeConfig(max_new_tokens=16, eos_token_ids=frozenset(), context_length=target.context_length)
        for name in ("fixed_tree", "ar") if pair.draft is not None else ("ar",):
            policy = make_method(name)
            generate(target.model, ids, policy, config=config, **pair.drafting(policy))
    except Exception:  # noqa: BLE001 - a warm-up that fails costs nothing but its time; real runs report errors
        pass
    return time.perf_counter() - t0


def serve(commands, out, spec: PairSpec) -> None:
    """The child's main loop (runs in the spawned process)."""
    import os

    import torch

    from dynatree_core.core.threads import configure_threads
    from dynatree_core.decoding.engine import decode, draft_kind, generate, vocab_size
    from dynatree_core.decoding.methods import REFERENCES, make_method
    from dynatree_core.decoding.pairs import load_pair

    try:
        threads = configure_threads(spec.threads, role="app")
        pair = load_pair(spec.target, spec.draft, device=spec.device, dtype=spec.dtype)
    except BaseException as exc:  # noqa: BLE001 - whatever stops the load is the parent's message
        out.put(("failed", 0, _portable(exc)))
        return
    target = pair.target
    warmup_s = _warm_up(pair, generate, make_method)
    out.put(
        (
            "ready",
            0,
            EngineInfo(
                device=str(target.device),
                dtype=str(target.dtype).removeprefix("torch."),
                threads=threads,
                tokenizer=target.tokenizer,
                eos_token_ids=target.eos_token_ids,
                context_length=target.context_length,
                has_draft=pair.draft is not None,
                draft_is_stand_in=pair.draft_is_stand_in,
                draft_kind=draft_kind(pair.draft.model if pair.draft is not None else None),
                pid=os.getpid(),
                vocab_size=vocab_size(target.model),
                warmup_s=warmup_s,
            ),
        )
    )
    runs: dict[int, Any] = {}  # rid -> decode generator
    running: collections.deque[int] = collections.deque()  # runs decoding, in round-robin order

    def advance(rid: int) -> bool:
        """One iteration of run `rid`; True while it can go on."""
        try:
            record = next(runs[rid], None)
        except Exception as exc:  # noqa: BLE001 - e.g. the prompt does not fit: the run ends
            runs.pop(rid, None)
            out.put(("error", rid, _portable(exc)))
            return False
        if record is not None:
            out.put(("record", rid, record))
        if record is None or record.stop is not None:
            runs.pop(rid, None)  # releases its KV caches
            out.put(("done", rid, None))
            return False
        return True

    def handle(kind: str, rid: int, payload: Any = None) -> bool:
        if kind == "quit":
            return False
        if kind == "start":
            try:
                policy = make_method(payload.policy, payload.params)
                torch.manual_seed(payload.config.seed)
                runs[rid] = decode(
                    target.model, payload.prompt_ids, policy, config=payload.config, **pair.drafting(policy)
                )
            except Exception as exc:  # noqa: BLE001
                out.put(("error", rid, _portable(exc)))
        elif kind == "go":
            if rid not in runs:
                out.put(("done", rid, None))
            elif rid not in running:
                running.append(rid)
        elif kind == "step":
            if rid not in runs:
                out.put(("done", rid, None))
            elif rid not in running:
                advance(rid)
        elif kind == "pause":
            if rid in running:
                running.remove(rid)
            out.put(("paused", rid, payload))  # echoes the "go" it ends
        elif kind == "drop":
            runs.pop(rid, None)
            if rid in running:
                running.remove(rid)
        elif kind == "runs":  # what the child holds (tests: a discarded run must be freed)
            out.put(("result", rid, sorted(runs)))
        elif kind == "ar":
            prompt_ids, config, reference = payload
            try:
                if reference not in REFERENCES:
                    raise DynaTreeError(f"{reference!r} is not an AR reference ({', '.join(REFERENCES)})")
                out.put(("result", rid, generate(target.model, prompt_ids, make_method(reference), config=config)))
            except Exception as exc:  # noqa: BLE001
                out.put(("error", rid, _portable(exc)))
        return True

    with torch.inference_mode():
        while True:
            try:
                while not running or commands.poll():  # block only when there is nothing to decode
                    if not handle(*commands.recv()):
                        return
            except (EOFError, OSError):  # the parent is gone
                return
            rid = running.popleft()
            if advance(rid):
                running.append(rid)


# ----- the parent --------------------------------------------------------------------------------
class EngineProcess:
    """A child process that owns one model pair and decodes runs for this process.

    Objects that `register()` receive the child's messages about their rid through `on_message`
    (called from the dispatcher thread) and a `on_tick()` about every POLL_S seconds (to pause runs
    nobody watches). If the child dies, every registered object gets an ("error", ...) message.
    """

    def __init__(self, spec: PairSpec):
        self.spec = spec
        receiver, self._commands = _CTX.Pipe(duplex=False)
        self._out = _CTX.Queue()
        self._process = _CTX.Process(
            target=serve, args=(receiver, self._out, spec), name="dynatree-engine", daemon=True
        )
        self._process.start()
        receiver.close()
        self._send_lock = threading.Lock()
        # weak: a run the page forgot is garbage-collected, and its finalizer drops it in the child
        self._listeners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._ids = itertools.count(1)
        self._ready = threading.Event()
        self.info: EngineInfo | None = None
        self.failure: Exception | None = None
        self._dispatcher = threading.Thread(target=self._dispatch, name="dynatree-engine-dispatch", daemon=True)
        self._dispatcher.start()

    # -- lifecycle --
    def wait_ready(self, timeout_s: float | None = None) -> EngineInfo:
        """The child's EngineInfo once its models are loaded; DynaTreeError if it could not load."""
        if not self._ready.wait(timeout_s):
            raise DynaTreeError(f"the engine process did not load {self.spec.target!r} within {timeout_s:.0f} s")
        if self.info is None:
            exc = self.failure
            raise exc if isinstance(exc, DynaTreeError) else DynaTreeError(f"the engine process could not load: {exc}")
        return self.info

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the child to exit (after its current iteration), then make sure it did."""
        with contextlib.suppress(DynaTreeError):
            self.send("quit", 0)
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout_s)

    # -- messages --
    def register(self, listener: Any) -> int:
        rid = next(self._ids)
        self._listeners[rid] = listener
        return rid

    def unregister(self, rid: int) -> None:
        self._listeners.pop(rid, None)

    def send(self, kind: str, rid: int, payload: Any = None) -> None:
        with self._send_lock:
            try:
                self._commands.send((kind, rid, payload))
            except (OSError, ValueError) as exc:  # broken pipe, or closed
                raise DynaTreeError(f"the engine process is gone ({self._exit_text()})") from exc

    def drop(self, rid: int) -> None:
        """Forget run `rid` here and in the child (its KV caches are freed); never raises."""
        self.unregister(rid)
        if self.alive:
            with contextlib.suppress(DynaTreeError):
                self.send("drop", rid)

    def _exit_text(self) -> str:
        code = self._process.exitcode
        return "still running" if code is None else f"exit code {code}"

    def _dispatch(self) -> None:
        while True:
            try:
                kind, rid, payload = self._out.get(timeout=POLL_S)
            except queue.Empty:
                if not self._process.is_alive():
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
            listener = self._listeners.get(rid)
            if listener is not None:
                listener.on_message(kind, payload)

    def _child_died(self) -> None:
        if not self._ready.is_set():
            self.failure = DynaTreeError(f"the engine process ended while loading ({self._exit_text()})")
            self._ready.set()
        exc = DynaTreeError(f"the engine process ended unexpectedly ({self._exit_text()}); press Run to restart it")
        for listener in list(self._listeners.values()):
            listener.on_message("error", exc)


class Job:
    """A one-off request to the child (an AR reference): `EngineProcess.call` waits for it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: Exception | None = None

    def on_message(self, kind: str, payload: Any) -> None:
        if kind == "result":
            self.result = payload
        elif kind == "error":
            self.error = payload
        self.done.set()

    def on_tick(self) -> None:
        pass


def call(engine: EngineProcess, kind: str, payload: Any, timeout_s: float | None = None) -> Any:
    """Send one job to the child and wait for its result (raises the child's exception)."""
    job = Job()
    rid = engine.register(job)
    try:
        engine.send(kind, rid, payload)
        if not job.done.wait(timeout_s):
            raise DynaTreeError(f"the engine process did not answer {kind!r} within {timeout_s} s")
    finally:
        engine.unregister(rid)
    if job.error is not None:
        raise job.error
    return job.result
