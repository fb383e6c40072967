"""The child side of an engine process (engine_process.py has the protocol and the parent side):
what crosses the boundary (PairSpec, EngineInfo, StartRun), and `serve`, the spawned process's
main loop: load the pair, warm up, then take commands from a reader thread, decode live runs
round-robin and run queued jobs (jobs.py) one at a time in arrival order."""

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
    """The child's main loop (runs in the spawned process)."""
    import torch

    from dynatree_core.core.threads import configure_threads
    from dynatree_core.decoding.engine import decode, generate
    from dynatree_core.decoding.methods import make_method
    from dynatree_core.decoding.pairs import load_pair
    from dynatree_core.live.jobs import JOB_TITLES, run_job

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
    target = pair.target
    runs: dict[int, Any] = {}  # rid -> decode generator
    running: collections.deque[int] = collections.deque()  # runs decoding, in round-robin order
    jobs: collections.deque[tuple[int, str, dict]] = collections.deque()  # queued jobs, in arrival order
    busy = [""]  # the running job's title, read by the reader thread
    inbox: queue.Queue = queue.Queue()
    threading.Thread(
        target=_read_commands, args=(commands, inbox, out, busy), name="dynatree-engine-reader", daemon=True
    ).start()

    def fail(rid: int, what: str, exc: BaseException) -> None:
        log_exception(f"engine {os.getpid()} ({spec.target}): {what}", exc)
        out.put(("error", rid, _portable(exc)))

    def advance(rid: int) -> bool:
        """One iteration of run `rid`; True while it can go on."""
        try:
            record = next(runs[rid], None)
        except Exception as exc:  # noqa: BLE001 - e.g. the prompt does not fit: the run ends
            runs.pop(rid, None)
            fail(rid, f"run {rid}", exc)
            return False
        if record is not None:
            out.put(("record", rid, record))
        if record is None or record.stop is not None:
            runs.pop(rid, None)  # releases its KV caches
            out.put(("done", rid, None))
            return False
        return True

    def run_job_now(rid: int, name: str, payload: dict) -> None:
        busy[0] = JOB_TITLES.get(name, name)
        out.put(("started", rid, None))
        t0 = time.perf_counter()
        try:
            result = run_job(pair, name, payload, lambda kind, data: out.put(("event", rid, (kind, data))))
            pickle.dumps(result)  # a result that cannot cross is an error here, not a lost message
        except Exception as exc:  # noqa: BLE001
            fail(rid, f"job {name} {rid}", exc)
        else:
            out.put(("result", rid, result))
            log_info("engine %d: job %s %d took %.1f s", os.getpid(), name, rid, time.perf_counter() - t0)
        finally:
            busy[0] = ""

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
                fail(rid, f"start of run {rid}", exc)
        elif kind == "go":
            if rid not in runs:
                out.put(("done", rid, None))
            elif rid not in running:
                running.append(rid)
        elif kind == "step":
            if rid not in runs:
                out.put(("done", rid, None))
            elif rid in running:
                out.put(("busy", rid, "the run is decoding: pause it before stepping"))
            else:
                advance(rid)
        elif kind == "pause":
            if rid in running:
                running.remove(rid)
            out.put(("paused", rid, payload))  # echoes the "go" it ends
        elif kind == "drop":
            runs.pop(rid, None)
            if rid in running:
                running.remove(rid)
            for job in [j for j in jobs if j[0] == rid]:  # a job nobody waits for any more
                jobs.remove(job)
            out.put(("dropped", rid, None))
        elif kind == "runs":  # what the child holds (tests: a discarded run must be freed)
            out.put(("result", rid, sorted(runs)))
        elif kind == "job":
            name, job_payload = payload
            jobs.append((rid, name, job_payload))
        else:
            out.put(("error", rid, DynaTreeError(f"the engine has no command {kind!r}")))
        return True

    with torch.inference_mode():
        while True:
            while True:  # every command that came; wait for one only when there is nothing to do
                try:
                    command = inbox.get_nowait() if running or jobs else inbox.get(timeout=POLL_S)
                except queue.Empty:
                    if running or jobs:
                        break
                    continue
                if not handle(*command):
                    log_info("engine %d quits: %s", os.getpid(), spec.title())
                    return
            if jobs:
                run_job_now(*jobs.popleft())
                continue
            rid = running.popleft()
            if advance(rid):
                running.append(rid)
