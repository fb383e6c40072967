"""Process-wide resources of the app and its pages (Streamlit caches, shared by every session):
torch's thread count, the engine process per model pair, loaded model pairs, the lock that keeps
two sessions from running forwards on the same model at once, and the pair's latency profile."""

from __future__ import annotations

import contextlib
import os
import threading

import streamlit as st
import torch

from dynatree_core.core.threads import ENV, available_cores, configure_threads
from dynatree_core.decoding.pairs import load_pair
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.engine_process import EngineProcess, PairSpec


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
LIVE_ENGINES = ("process", "thread")


def live_engine_mode() -> str:
    """Where the live page decodes: "process" (default; a child process per model pair,
    live/engine_process.py, so drawing never takes the engine's time) or "thread" (a worker thread of
    the app process: the reference, measured slower while the page draws). DYNATREE_LIVE_ENGINE."""
    mode = os.environ.get(LIVE_ENGINE_ENV, "").strip().lower() or "process"
    if mode not in LIVE_ENGINES:
        raise DynaTreeError(f"{LIVE_ENGINE_ENV}={mode!r}; choose one of: {', '.join(LIVE_ENGINES)}")
    return mode


def _close_engine(engine: EngineProcess) -> None:
    engine.close()


@st.cache_resource(max_entries=2, show_spinner=False, validate=lambda engine: engine.alive, on_release=_close_engine)
def _engine(target: str, draft: str | None, device: str, dtype: str) -> EngineProcess:
    return EngineProcess(PairSpec(target, draft, device, dtype))  # loads (and warms up) in its own process


def engine_process(target: str, draft: str | None, device: str, dtype: str) -> EngineProcess:
    """The child process that decodes the live page's runs on this pair, started once and shared
    by every session (it runs one forward at a time), once it is ready. A dead one is started
    again; an evicted one is closed. Raises DynaTreeError when its models cannot load."""
    engine = _engine(target, draft, device, dtype)
    try:
        engine.wait_ready()
    except BaseException:
        engine.close()  # dead: the cache starts a new one next time
        raise
    return engine


def prewarm(target: str, draft: str | None, device: str, dtype: str) -> None:
    """Start the pair's engine process loading and warming up, without waiting for it (the
    opening replay plays meanwhile, so the first live iterations run at full speed)."""
    with contextlib.suppress(Exception):  # a bad setting shows its message when the user starts a run
        if target and live_engine_mode() == "process":
            _engine(target, draft, device, dtype)


@st.cache_resource(max_entries=2, show_spinner=False)
def cached_pair(target: str, draft: str | None, device: str, dtype: str):
    engine_threads()  # every page loads its models here (the Verification Lab has no model picker)
    return load_pair(target, draft, device=device, dtype=dtype)


@st.cache_resource
def forward_lock() -> threading.Lock:
    return threading.Lock()


@st.cache_data(show_spinner=False, max_entries=4)
def latency_points(target: str, draft: str | None, device: str, dtype: str) -> list:
    """The pair's forward latency profile on this device (context 128, 1-64 tokens), measured once
    per pair and kept for every session (it takes a few seconds on CPU)."""
    from dynatree_core.runs.latency import profile

    pair = cached_pair(target, draft, device, dtype)
    models = {"target": pair.target.model}
    if pair.draft is not None and not pair.draft_is_stand_in:
        models["draft"] = pair.draft.model
    with forward_lock():
        return profile(models, tokens=(1, 2, 4, 8, 16, 32, 64), contexts=(128,), repeats=3)
