"""Streamlit pieces shared by the app and its pages: process-wide resources (loaded model pairs,
the lock that keeps two sessions from running forwards on the same model at once, torch's
thread count) and the policy parameter widgets built from the registry. The only core module
importing Streamlit."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from pathlib import Path

import streamlit as st
import torch

from dynatree_core.engine_process import EngineProcess, PairSpec
from dynatree_core.errors import DynaTreeError
from dynatree_core.live import LiveRun
from dynatree_core.live_process import ProcessRun
from dynatree_core.methods import method_class
from dynatree_core.models import PRESETS, presets_only
from dynatree_core.session import load_pair
from dynatree_core.settings import SETTINGS
from dynatree_core.threads import ENV, available_cores, configure_threads


@st.cache_resource(show_spinner=False)
def engine_threads() -> int:
    """torch's thread count for this app process, applied once before any model loads
    (threads.py: DYNATREE_THREADS, else one core fewer than the machine has, left to the
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
    engine_process.py, so drawing never takes the engine's time) or "thread" (a worker thread of
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


REPLAY_FILE = Path(__file__).resolve().parent.parent / "assets" / "replay" / "welcome.json"
REPLAY_INTERVAL_S = 1.0  # the opening replay shows one iteration per this many seconds
PREWARM_FRAME = 3  # the replay frame after which the live pair starts loading (the first drawings go first)
POSTER_FRAMES = 3  # the replay's first frames draw the tree as an image: the browser is still loading plotly


def replay_run() -> LiveRun | None:
    """The recorded run the live page opens on (assets/replay/), this session's own copy; None
    when the file is missing or unreadable, or DYNATREE_REPLAY=0 (the page then opens on its form)."""
    if os.environ.get("DYNATREE_REPLAY", "1") == "0":
        return None
    try:
        run = LiveRun.from_json(REPLAY_FILE.read_bytes())
    except (OSError, ValueError):
        return None
    st.session_state.replay_run, st.session_state.replay_at = run, 1
    return run


def replay_step(run: LiveRun) -> bool:
    """Show the replay's next iteration (through the iteration slider's state); True while more follow."""
    n = len(run.records)
    at = st.session_state.get("replay_at", n)
    st.info(
        f"Replay of a recorded run ({run.policy_name}, {run.draft_kind or 'no'} draft, measured when it was "
        "recorded): press **Run** or **Step** to decode your prompt live.",
        icon=":material/replay:",
    )
    if at > n:
        return False
    st.session_state[f"scrub_{n}"] = at
    st.session_state.replay_at = at + 1
    return at < n


@st.cache_resource(max_entries=2, show_spinner=False)
def cached_pair(target: str, draft: str | None, device: str, dtype: str):
    engine_threads()  # every page loads its models here (the Verification Lab has no model picker)
    return load_pair(target, draft, device=device, dtype=dtype)


@st.cache_resource
def forward_lock() -> threading.Lock:
    return threading.Lock()


def param_widgets(policy_name: str, key_prefix: str = "param") -> dict:
    """One widget per registered parameter of the policy, with its help text."""
    values = {}
    for p in method_class(policy_name).params:
        key = f"{key_prefix}_{policy_name}_{p.name}"
        if p.type is bool:
            values[p.name] = st.toggle(p.name, bool(p.default), help=p.help, key=key)
        elif p.type is int:
            values[p.name] = st.slider(p.name, int(p.min), int(p.max), int(p.default), help=p.help, key=key)
        else:  # thresholds that span decades (Param.log_scale) step by a tenth of their default's decade
            step = 10.0 ** (math.floor(math.log10(p.default)) - 1) if p.log_scale and p.default > 0 else 0.01
            values[p.name] = st.number_input(
                p.name, float(p.min), float(p.max), float(p.default), step, help=p.help, format="%.4g", key=key
            )
    return values


CUSTOM = "custom (hub id or local path)"


def setting_widget(name: str, *, key: str | None = None, value=None, where=st, **kwargs):
    """The page widget of a run setting (settings.SETTINGS): its label, range or choices, default
    and help come from the registry the CLI's flags are generated from. `value`: start from this
    (one the registry refuses falls back to the default) instead of the default; `where`: a column or the sidebar.
    Extra kwargs (disabled, ...) go to the widget."""
    s = SETTINGS[name]
    start = s.default
    if value is not None:  # a value from elsewhere (an imported run's settings) the registry refuses: the default
        with contextlib.suppress(DynaTreeError, TypeError, ValueError):
            start = s.check(s.kind(value))
    common = dict(key=key, help=s.help, **kwargs)
    if s.widget == "select":
        options = list(s.choices or s.offered)
        return where.selectbox(s.label, options, index=options.index(start), **common)
    if s.widget == "radio":
        return where.radio(s.label, list(s.choices), index=s.choices.index(start), horizontal=True, **common)
    if s.widget == "number":
        return s.kind(where.number_input(s.label, s.kind(s.lo), s.kind(s.hi), start, **common))
    return where.slider(s.label, s.kind(s.lo), s.kind(s.hi), start, s.kind(s.step), **common)


def model_picker(key_prefix: str = "") -> tuple[str, str | None, str, str]:
    """Sidebar widgets for the model pair, device and dtype: (target, draft, device, dtype).
    Applies the app's torch thread count first (`engine_threads`). A preset fills in both models;
    "custom" asks for a hub id or local directory (not offered when the deployer set
    DYNATREE_PRESETS_ONLY)."""
    try:
        engine_threads()
    except DynaTreeError as exc:
        st.error(f"{exc}; torch keeps {torch.get_num_threads()} threads.")
    k = (lambda name: f"{key_prefix}_{name}") if key_prefix else (lambda name: None)
    locked = presets_only()
    preset = st.selectbox(
        "Model pair",
        [*PRESETS] if locked else [*PRESETS, CUSTOM],
        key=k("preset"),
        help="`embedded` runs offline: SmolLM2-135M-Instruct with the project's trained draft."
        + (" This instance serves its presets only." if locked else ""),
    )
    if preset == CUSTOM:
        t, d = SETTINGS["target"], SETTINGS["draft"]
        target = st.text_input(t.label, key=k("target"), help=t.help)
        draft = st.text_input(d.label, key=k("draft"), help=d.help + "; empty: the target drafts for itself") or None
    else:
        target, draft = PRESETS[preset].target, PRESETS[preset].draft
    device = setting_widget("device", key=k("device"))
    dtype = setting_widget("dtype", key=k("dtype"))
    return target, draft, device, dtype


@st.cache_data(show_spinner=False, max_entries=4)
def latency_points(target: str, draft: str | None, device: str, dtype: str) -> list:
    """The pair's forward latency profile on this device (context 128, 1-64 tokens), measured once
    per pair and kept for every session (it takes a few seconds on CPU)."""
    from dynatree_core.latency import profile

    pair = cached_pair(target, draft, device, dtype)
    models = {"target": pair.target.model}
    if pair.draft is not None and not pair.draft_is_stand_in:
        models["draft"] = pair.draft.model
    with forward_lock():
        return profile(models, tokens=(1, 2, 4, 8, 16, 32, 64), contexts=(128,), repeats=3)


# ----- the live page's run controls (app.py) ----------------------------------------------------
def live_buttons():
    """The run's buttons and the import box: (run, step, pause, reset, imported file)."""
    cols = st.columns(5)
    run_clicked = cols[0].button(
        "Run", icon=":material/play_arrow:", type="primary", help="Decode until the end, drawing as it goes."
    )
    step_clicked = cols[1].button(
        "Step", icon=":material/skip_next:", help="Run exactly one iteration (one target forward)."
    )
    pause_clicked = cols[2].button("Pause run", icon=":material/pause:", help="Pause after the current iteration.")
    reset_clicked = cols[3].button("Reset", icon=":material/restart_alt:", help="Discard this run.")
    imported = cols[4].file_uploader(
        "Import run JSON",
        type="json",
        label_visibility="collapsed",
        help="Replay an exported run without loading any model.",
    )
    return run_clicked, step_clicked, pause_clicked, reset_clicked, imported


def import_run(run: LiveRun | None, uploaded) -> LiveRun | None:
    """The exported run in `uploaded` (the current run's worker stops), or `run` with a message
    when the file is not a run."""
    try:
        loaded = LiveRun.from_json(uploaded.getvalue())
    except ValueError as exc:
        st.error(str(exc))
        return run
    if run is not None:
        run.close()
    st.session_state.imported_name = uploaded.name
    return loaded


def advance(run: LiveRun, run_clicked: bool, step_clicked: bool) -> None:
    """Run: the worker decodes ahead of the page. Step: one iteration in the script thread, never
    beside the worker. An engine error ends the run and stays in `run.error` (`show_run_error`).
    A ProcessRun needs no lock: its engine process runs one forward at a time."""
    lock = None if isinstance(run, ProcessRun) else forward_lock()
    if run_clicked:
        run.start_worker(lock)
    elif step_clicked and run.worker_running:
        st.toast("The run is decoding: press **Pause run**, then **Step**.")
    elif step_clicked:
        with contextlib.suppress(Exception):  # kept in run.error
            run.step(lock)


def show_run_error(run: LiveRun) -> LiveRun | None:
    """The engine's message (e.g. the prompt does not fit the context), never a traceback. Returns
    the run to keep: None when it produced nothing, else the run, to inspect what it did."""
    exc = run.error
    st.error(str(exc) if isinstance(exc, DynaTreeError) else f"The run stopped: {type(exc).__name__}: {exc}")
    return run if run.records else None
