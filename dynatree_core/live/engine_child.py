"""The child side of an engine (engine.py has the protocol and the parent side, actor.py the Ray
actor that runs this side): what crosses the boundary (PairSpec, EngineInfo, StartRun), and
`serve`, the actor's entry point: load the pair, warm up, start the reader thread (`_read_commands`), then hand over to
`_ChildEngine`, which holds the live runs and queued jobs, handles each command with its own
method (the COMMANDS table), decodes live runs round-robin and runs queued jobs (jobs.py) one at a
time in arrival order."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import pickle
import queue
import threading
import time
import traceback
from typing import Any

from dynatree_core.core.log import log_exception, log_info
from dynatree_core.errors import DynaTreeError

POLL_S = 0.5  # how often a waiting thread checks again (the child's reader and main loop, the parent's dispatcher)


@dataclasses.dataclass(frozen=True)
class PairSpec:
    target: str
    draft: str | None
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None  # None: core/threads.py decides (DYNATREE_THREADS, else the app's default)

    def title(self) -> str:
        return f"{self.target}" + (f" + {self.draft}" if self.draft else "") + f" ({self.device}, {self.dtype})"


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


def pair_info(pair, threads: int, warmup_s: float = 0.0) -> EngineInfo:
    """The EngineInfo of a loaded pair (the child's, or the app's own with DYNATREE_LIVE_ENGINE=thread)."""
    from dynatree_core.decoding.engine import draft_kind, vocab_size

    target = pair.target
    return EngineInfo(
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
    )


@dataclasses.dataclass(frozen=True)
class StartRun:
    prompt_ids: list[int]
    policy: str
    params: dict[str, Any]
    config: Any  # engine.DecodeConfig (pickled as is)


def _portable(exc: BaseException) -> Exception:
    """The exception, carrying the child's traceback as a note, when it survives pickling; else a
    RuntimeError with its text."""
    with contextlib.suppress(Exception):
        exc.add_note(f"in engine process {os.getpid()}:\n" + "".join(traceback.format_exception(exc)).rstrip())
    try:
        pickle.loads(pickle.dumps(exc))
        return exc  # type: ignore[return-value]
    except Exception as unpicklable:  # noqa: BLE001 - its text crosses instead
        log_exception(f"{type(exc).__name__} cannot cross to the app; its text is sent", unpicklable)
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _warm_up(pair, generate, make_method) -> float:
    """One short tree run and one AR run before the page's first: first-call costs (lazy imports,
    lean-forward construction, allocator and oneDNN caches) land here, not in a user's run. A
    warm-up that fails costs its time and a traceback in the server log; real runs report errors."""
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
    except Exception:  # noqa: BLE001 - logged; the engine still serves
        log_exception("engine warm-up failed (the engine still serves)")
    return time.perf_counter() - t0


def _read_commands(commands, inbox: queue.Queue, out, busy: list) -> None:
    """The child's reader thread: every command into `inbox` as it arrives (so the parent's pipe
    never fills), a "step" answered "busy" at once while a job holds the engine (busy[0]: its
    title). The parent closing the pipe (it died) reads as "quit"."""
    while True:
        try:
            if not commands.poll(POLL_S):  # True once a message (or the pipe's end) is there
                continue
            command = commands.recv()
        except (EOFError, OSError):
            inbox.put(("quit", 0, None))
            return
        if command[0] == "step" and busy[0]:
            out.put(("busy", command[1], f"the engine is running {busy[0]}; your step runs when it ends"))
            continue
        inbox.put(command)


def serve(commands, out, spec: PairSpec) -> None:
    """The child's main loop (runs in the engine's actor: actor.EngineActor): load the pair, warm up, say "ready",
    then serve commands from the reader thread until "quit" (or the parent's end)."""
    from dynatree_core.core.threads import configure_threads
    from dynatree_core.decoding.engine import generate
    from dynatree_core.decoding.methods import make_method
    from dynatree_core.decoding.pairs import load_pair

    log_info("engine %d loading %s", os.getpid(), spec.title())
    try:
        threads = configure_threads(spec.threads, role="app")
        pair = load_pair(spec.target, spec.draft, device=spec.device, dtype=spec.dtype)
    except BaseException as exc:  # noqa: BLE001 - whatever stops the load is the parent's message
        log_exception(f"engine could not load {spec.title()}", exc)
        out.put(("failed", 0, _portable(exc)))
        return
    warmup_s = _warm_up(pair, generate, make_method)
    out.put(("ready", 0, pair_info(pair, threads, warmup_s)))
    log_info("engine %d ready: %s (warm-up %.1f s)", os.getpid(), spec.title(), warmup_s)
    engine = _ChildEngine(pair, spec, out)
    reader_args = (commands, engine.inbox, out, engine.busy)
    threading.Thread(target=_read_commands, args=reader_args, name="dynatree-engine-reader", daemon=True).start()
    engine.loop()
    log_info("engine %d quits: %s", os.getpid(), spec.title())


class _ChildEngine:
    """The loaded pair's live runs and queued jobs, and one handler per command (COMMANDS)."""

    def __init__(self, pair, spec: PairSpec, out):
        self.pair, self.spec, self.out = pair, spec, out
        self.runs: dict[int, Any] = {}  # rid -> engine.decode generator (it owns the run's KV caches)
        self.running: collections.deque[int] = collections.deque()  # runs decoding, in round-robin order
        self.jobs: collections.deque[tuple[int, str, dict]] = collections.deque()  # queued jobs, arrival order
        self.busy = [""]  # the running job's title, read by the reader thread
        self.inbox: queue.Queue = queue.Queue()  # commands, put there by the reader thread

    def loop(self) -> None:
        """Serve until "quit": one job (to its end) or one iteration of the next running run
        (round-robin), with every command that came handled in between."""
        import torch

        with torch.inference_mode():
            while self.take_commands():
                if self.jobs:
                    self.run_job(*self.jobs.popleft())
                    continue
                rid = self.running.popleft()
                if self.advance(rid):
                    self.running.append(rid)

    def take_commands(self) -> bool:
        """Handle every command that came, waiting for one only while there is nothing to do;
        False on "quit"."""
        while True:
            idle = not (self.running or self.jobs)
            try:
                kind, rid, payload = self.inbox.get(timeout=POLL_S) if idle else self.inbox.get_nowait()
            except queue.Empty:
                if idle:
                    continue
                return True
            if kind == "quit":
                return False
            handler = COMMANDS.get(kind)
            if handler is None:
                self.out.put(("error", rid, DynaTreeError(f"the engine has no command {kind!r}")))
            else:
                handler(self, rid, payload)

    def fail(self, rid: int, what: str, exc: BaseException) -> None:
        log_exception(f"engine {os.getpid()} ({self.spec.target}): {what}", exc)
        self.out.put(("error", rid, _portable(exc)))

    def advance(self, rid: int) -> bool:
        """One iteration of run `rid`; True while it can go on."""
        try:
            record = next(self.runs[rid], None)
        except Exception as exc:  # noqa: BLE001 - e.g. the prompt does not fit: the run ends
            self.runs.pop(rid, None)
            self.fail(rid, f"run {rid}", exc)
            return False
        if record is not None:
            self.out.put(("record", rid, record))
        if record is None or record.stop is not None:
            self.runs.pop(rid, None)  # releases its KV caches
            self.out.put(("done", rid, None))
            return False
        return True

    def run_job(self, rid: int, name: str, payload: dict) -> None:
        """Job `name` to its end, no live iteration in between (its timings are its own)."""
        from dynatree_core.live.jobs import JOB_TITLES, run_job

        self.busy[0] = JOB_TITLES.get(name, name)
        self.out.put(("started", rid, None))
        t0 = time.perf_counter()
        try:
            result = run_job(self.pair, name, payload, lambda kind, data: self.out.put(("event", rid, (kind, data))))
            pickle.dumps(result)  # a result that cannot cross is an error here, not a lost message
        except Exception as exc:  # noqa: BLE001
            self.fail(rid, f"job {name} {rid}", exc)
        else:
            self.out.put(("result", rid, result))
            log_info("engine %d: job %s %d took %.1f s", os.getpid(), name, rid, time.perf_counter() - t0)
        finally:
            self.busy[0] = ""

    # ----- one handler per command (the protocol: engine.py) -------------------------------
    def start(self, rid: int, payload: StartRun) -> None:
        import torch

        from dynatree_core.decoding.engine import decode
        from dynatree_core.decoding.methods import make_method

        try:
            policy = make_method(payload.policy, payload.params)
            torch.manual_seed(payload.config.seed)
            self.runs[rid] = decode(
                self.pair.target.model, payload.prompt_ids, policy, config=payload.config, **self.pair.drafting(policy)
            )
        except Exception as exc:  # noqa: BLE001
            self.fail(rid, f"start of run {rid}", exc)

    def go(self, rid: int, seq: int) -> None:
        if rid not in self.runs:
            self.out.put(("done", rid, None))
        elif rid not in self.running:
            self.running.append(rid)

    def step(self, rid: int, payload: None) -> None:
        if rid not in self.runs:
            self.out.put(("done", rid, None))
        elif rid in self.running:
            self.out.put(("busy", rid, "the run is decoding: pause it before stepping"))
        else:
            self.advance(rid)

    def pause(self, rid: int, seq: int) -> None:
        if rid in self.running:
            self.running.remove(rid)
        self.out.put(("paused", rid, seq))  # echoes the "go" it ends

    def drop(self, rid: int, payload: None) -> None:
        self.runs.pop(rid, None)
        if rid in self.running:
            self.running.remove(rid)
        for job in [j for j in self.jobs if j[0] == rid]:  # a job nobody waits for any more
            self.jobs.remove(job)
        self.out.put(("dropped", rid, None))

    def list_runs(self, rid: int, payload: None) -> None:
        """What the child holds (tests: a discarded run must be freed)."""
        self.out.put(("result", rid, sorted(self.runs)))

    def queue_job(self, rid: int, payload: tuple[str, dict]) -> None:
        name, job_payload = payload
        self.jobs.append((rid, name, job_payload))


COMMANDS = {  # "quit" ends the loop
    "start": _ChildEngine.start,
    "go": _ChildEngine.go,
    "step": _ChildEngine.step,
    "pause": _ChildEngine.pause,
    "drop": _ChildEngine.drop,
    "runs": _ChildEngine.list_runs,
    "job": _ChildEngine.queue_job,
}
