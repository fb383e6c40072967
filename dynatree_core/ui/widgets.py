"""Widgets shared by the app and its pages: the policy parameters and run settings built from
their registries (one definition for a CLI flag and its widget), the model picker, and the live
page's run controls."""

from __future__ import annotations

import contextlib
import math

import streamlit as st
import torch

from dynatree_core.core.presets import PRESETS
from dynatree_core.core.specs import presets_only
from dynatree_core.decoding.methods import method_class
from dynatree_core.decoding.settings import SETTINGS
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.engine_run import EngineRun
from dynatree_core.live.run import LiveRun
from dynatree_core.measure.prompt_sets import load_prompts
from dynatree_core.ui.resources import engine_threads, forward_lock, show_error


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


OWN_PROMPT = "(your own)"


def prompt_inputs(prefix: str, *, default: str | None = None, height: int = 90) -> tuple[str, bool]:
    """The example selector, the prompt box and the chat toggle: (prompt, chat). An example fills
    the box; editing the box sets the selector back to "(your own)", so it never names an example
    the box no longer holds. `default`: the box's first text (None: the first example's)."""
    examples = {f"[{p.domain}] {p.text[:80]}": p.text for p in load_prompts("all")}
    state, pick, box = st.session_state, f"{prefix}example", f"{prefix}prompt"
    if box not in state:
        first = next(iter(examples))
        state[pick] = OWN_PROMPT if default is not None else first
        state[box] = default if default is not None else examples[first]

    def picked() -> None:
        if state[pick] != OWN_PROMPT:
            state[box] = examples[state[pick]]

    def edited() -> None:
        if examples.get(state[pick]) != state[box]:
            state[pick] = OWN_PROMPT

    st.selectbox("Example prompts", [OWN_PROMPT, *examples], key=pick, on_change=picked, help="Fills the prompt box.")
    prompt = st.text_area(
        "Prompt", key=box, height=height, on_change=edited, help="What the target continues (or answers)."
    )
    chat = st.toggle("Chat template", value=True, key=f"{prefix}chat", help="Wrap the prompt as a user turn.")
    return prompt, chat


# ----- the live page's run controls (app.py) ----------------------------------------------------
def compact_top() -> None:
    """Less empty space above the page's first line (Streamlit keeps 6rem under its header), so a
    laptop screen holds the tree: the first viewport is the lesson."""
    st.html("<style>[data-testid=stMainBlockContainer]{padding-top:3.2rem;padding-bottom:2rem}</style>")


def live_buttons():
    """The run's buttons and the import box (in a popover): (run, step, pause, reset, imported file)."""
    cols = st.columns([1, 1, 1.2, 1, 1.3])
    run_clicked = cols[0].button(
        "Run", icon=":material/play_arrow:", type="primary", help="Decode until the end, drawing as it goes."
    )
    step_clicked = cols[1].button(
        "Step", icon=":material/skip_next:", help="Run exactly one iteration (one target forward)."
    )
    pause_clicked = cols[2].button("Pause run", icon=":material/pause:", help="Pause after the current iteration.")
    reset_clicked = cols[3].button("Reset", icon=":material/restart_alt:", help="Discard this run.")
    with cols[4].popover("Import run", icon=":material/upload_file:", help="Replay an exported run JSON."):
        imported = st.file_uploader(
            "Import run JSON", type="json", help="Replay an exported run without loading any model."
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
    An EngineRun needs no lock: its engine runs one forward at a time."""
    lock = None if isinstance(run, EngineRun) else forward_lock()
    if run_clicked:
        run.start_worker(lock)
    elif step_clicked and run.worker_running:
        st.toast("The run is decoding: press **Pause run**, then **Step**.")
    elif step_clicked:
        try:
            run.step(lock)
        except DynaTreeError as exc:  # the engine is busy with a job, or the run ended (kept in run.error)
            if run.error is None:
                st.toast(f"Not stepped: {exc}")
        except Exception:  # noqa: BLE001 - logged where it was raised and kept in run.error (show_run_error)
            if run.error is None:
                raise


def show_run_error(run: LiveRun) -> LiveRun | None:
    """The engine's message (e.g. the prompt does not fit the context), never a traceback. Returns
    the run to keep: None when it produced nothing, else the run, to inspect what it did."""
    show_error(run.error, "The run stopped")
    return run if run.records else None
