"""Process-wide resources of the app and its pages (Streamlit caches, shared by every session):
torch's thread count, the pool of engines (a Ray actor per model pair, live/pool.py), the jobs
the pages run on a pair (live/jobs.py) and, with DYNATREE_LIVE_ENGINE=thread, the pair loaded in
this process with the lock that keeps two sessions' forwards apart."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import streamlit as st
import torch

from dynatree_core.core.log import log_exception
from dynatree_core.core.settings import env
from dynatree_core.core.threads import ENV, available_cores, configure_threads
from dynatree_core.decoding.pairs import load_pair
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.engine import Engine, EngineInfo, JobHandle, PairSpec, env_seconds, pair_info
from dynatree_core.live.jobs import JOB_TITLES, run_job
from dynatree_core.live.pool import EnginePool

Models = tuple[str, str | None, str, str]  # (target, draft, device, dtype): what the model pickers return
JOB_TIMEOUT_ENV = "DYNATREE_JOB_TIMEOUT"
LOCK_TIMEOUT_S = 600.0  # thread mode: the longest a forward waits for another session's


@st.cache_resource(show_spinner=False)
def engine_threads() -> int:
    """torch's thread count for this app process, applied once before any model loads
    (core/threads.py: DYNATREE_THREADS, else one core fewer than the machine has, left to the
    browser and the server). Raises DynaTreeError on a bad DYNATREE_THREADS."""
    return configure_threads(role="app")


def threads_caption(threads: int | None = None) -> str:
    """The engine's thread count in words, for the pages' captions (default: this process's)."""
    n = torch.get_num_threads() if threads is None else threads
    return f"{n} torch thread{'s' if n != 1 else ''} of {available_cores()} cores ({ENV} to change)"


LIVE_ENGINE_ENV = "DYNATREE_LIVE_ENGINE"
LIVE_ENGINES = ("ray", "thread")


def live_engine_mode() -> str:
    """Where runs and jobs decode: "ray" (default; the pair's engine, a Ray actor, live/engine.py,
    on a local runtime or the cluster DYNATREE_RAY_ADDRESS names, so drawing never takes the
    engine's time and every page shares one copy of the pair) or "thread" (this process: the
    reference, measured slower while the page draws; also where Ray cannot start here:
    ray_unavailable). DYNATREE_LIVE_ENGINE."""
    mode = env(LIVE_ENGINE_ENV).lower()
    if mode not in LIVE_ENGINES:
        raise DynaTreeError(f"{LIVE_ENGINE_ENV}={mode!r}; choose one of: {', '.join(LIVE_ENGINES)}")
    return "thread" if mode == "ray" and ray_unavailable() else mode


@st.cache_resource(show_spinner="Starting the engines' runtime (Ray)...")
def ray_unavailable() -> str:
    """Why Ray cannot start in this server ("" when it runs): the first call starts it (a local
    runtime, or joins the cluster); where it cannot, the pages decode in this process instead, and
    say why (fallback_note)."""
    from dynatree_core.measure.cluster import connect

    try:
        connect()
    except DynaTreeError as exc:
        log_exception("Ray did not start: decoding in the app's process", exc)
        return str(exc)
    return ""


def fallback_note() -> str:
    """What a page says where Ray was asked for and could not start ("" otherwise)."""
    if env(LIVE_ENGINE_ENV).lower() != "ray" or not ray_unavailable():
        return ""
    return (
        f"The engines' runtime (Ray) did not start here ({ray_unavailable()}): runs decode in the app's "
        f"process, one session's forwards at a time. Set {LIVE_ENGINE_ENV}=thread to say so and skip the attempt."
    )


def job_timeout_s() -> float:
    """The longest a page waits for one job, queueing included (DYNATREE_JOB_TIMEOUT, s; 3600)."""
    return env_seconds(JOB_TIMEOUT_ENV, 3600.0)


@st.cache_resource(show_spinner=False)
def engine_pool() -> EnginePool:
    """The server's engines, Ray actors, one per pair (DYNATREE_MAX_PAIRS a node at most, live/pool.py)."""
    return EnginePool()


def pair_engine(target: str, draft: str | None, device: str, dtype: str) -> Engine:
    """The engine (a Ray actor) that holds this pair for every page and session, once it is ready
    (the least loaded of its replicas). A dead one is started again. Raises DynaTreeError when its
    models cannot load, and PoolFull when the server holds as many pairs as it may and all are in use."""
    spec = PairSpec(target, draft, device, dtype)
    pool = engine_pool()
    engine = pool.get(spec)
    try:
        engine.wait_ready()
    except BaseException:
        pool.discard(spec, engine)  # dead or stuck: the next request starts a new one
        raise
    return engine


def prewarm(target: str, draft: str | None, device: str, dtype: str) -> None:
    """Start the pair's engine loading and warming up, without waiting for it (the
    opening replay plays meanwhile, so the first live iterations run at full speed). A failure
    is logged; the user sees its message when starting a run."""
    try:
        if target and live_engine_mode() != "thread":
            engine_pool().get(PairSpec(target, draft, device, dtype))
    except Exception:  # noqa: BLE001 - shown when the user presses Run
        log_exception("prewarm")


@st.cache_resource(max_entries=2, show_spinner=False)
def cached_pair(target: str, draft: str | None, device: str, dtype: str):
    """The pair loaded in this process: DYNATREE_LIVE_ENGINE=thread only (the default keeps
    every model in its engine)."""
    engine_threads()
    return load_pair(target, draft, device=device, dtype=dtype)


class BoundedLock:
    """A lock whose `with` waits at most `timeout_s`, then raises DynaTreeError saying for what."""

    def __init__(self, timeout_s: float, what: str):
        self._lock, self.timeout_s, self.what = threading.Lock(), timeout_s, what

    def __enter__(self) -> BoundedLock:
        if not self._lock.acquire(timeout=self.timeout_s):
            raise DynaTreeError(f"waited {self.timeout_s:.0f} s for {self.what}; try again")
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


@st.cache_resource
def forward_lock() -> BoundedLock:
    """Thread mode: one session's forwards at a time on the pairs of this process."""
    return BoundedLock(LOCK_TIMEOUT_S, "another session's forwards on this server")


def models_info(models: Models) -> EngineInfo:
    """What a page needs of the pair without its weights (tokenizer, EOS ids, context length),
    from the engine that holds it (thread mode: the pair in this process)."""
    if live_engine_mode() == "thread":
        return pair_info(cached_pair(*models), torch.get_num_threads())
    return pair_engine(*models).info


def _waiting_text(engine: Engine, rid: int, name: str) -> str:
    ahead = engine.queue_position(rid) or 0
    busy = engine.busy_with()
    running = f"it is running {JOB_TITLES.get(busy[0], busy[0])}" if busy else "it is busy"
    return (
        f"Waiting for the engine of this model pair: {running}; {ahead} job(s) ahead of this one "
        f"({JOB_TITLES.get(name, name)}). Jobs run one at a time so that their timings are their own."
    )


def pair_job(
    models: Models,
    name: str,
    payload: dict,
    *,
    on_event: Callable[[str, Any], None] | None = None,
    status: Any = None,
    timeout_s: float | None = None,
) -> Any:
    """Run job `name` (live/jobs.py) on the pair where it lives: queued in its engine,
    where `status` (an st.empty) shows the place in the queue until it starts; `on_event(kind,
    data)` sees its progress in this script thread. Waits at most `timeout_s` (default
    DYNATREE_JOB_TIMEOUT), then raises DynaTreeError; raises the job's own error."""
    timeout_s = job_timeout_s() if timeout_s is None else timeout_s
    emit = on_event or (lambda kind, data: None)
    if live_engine_mode() == "thread":
        pair = cached_pair(*models)
        with forward_lock():
            return run_job(pair, name, payload, emit)
    engine = pair_engine(*models)
    handle = JobHandle()
    rid = engine.submit(name, payload, handle)
    deadline, shown = time.monotonic() + timeout_s, ""
    try:
        while not (handle.done and handle.events.empty()):
            while not handle.events.empty():
                emit(*handle.events.get_nowait())
            text = "" if handle.started or handle.done else _waiting_text(engine, rid, name)
            if status is not None and text != shown:
                if text:
                    status.info(text, icon=":material/hourglass_top:")
                else:
                    status.empty()
                shown = text
            if time.monotonic() > deadline:
                raise DynaTreeError(
                    f"{JOB_TITLES.get(name, name)} did not finish within {timeout_s:.0f} s ({JOB_TIMEOUT_ENV})"
                )
            handle.finished.wait(0.2)
    finally:
        if handle.done:
            engine.unregister(rid)
        else:
            engine.drop(rid)  # timed out, or the page moved on: a queued job leaves the queue
        if status is not None and shown:
            status.empty()
    if handle.error is not None:
        raise handle.error
    return handle.result


def show_error(exc: BaseException, what: str) -> None:
    """One line for the page, the traceback to the server log (and where it is)."""
    where = log_exception(what, exc)
    text = str(exc) if isinstance(exc, DynaTreeError) else f"{type(exc).__name__}: {exc}"
    st.error(f"{what}: {text}", icon=":material/error:")
    st.caption(where[0].upper() + where[1:] + ".")


@st.cache_data(show_spinner=False, max_entries=4)
def latency_points(target: str, draft: str | None, device: str, dtype: str) -> list:
    """The pair's forward latency profile on this device (context 128, 1-64 tokens), measured once
    per pair where the pair lives and kept for every session (a few seconds on CPU)."""
    return pair_job((target, draft, device, dtype), "latency", {})
