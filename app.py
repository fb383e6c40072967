"""DynaTree Explorer: watch tree speculative decoding happen, one iteration at a time.

Thin by design: widgets -> settings -> LiveRun (dynatree_core.live.run) -> figures (dynatree_core.viz).
Runs and jobs decode in an engine per model pair (dynatree_core.live.engine: a Ray actor, kept by the
pool in dynatree_core.live.pool), shared by every browser session and page and running one forward
at a time; DYNATREE_LIVE_ENGINE=thread (or a server where Ray cannot start) decodes in this process
instead (models loaded once, forwards take a lock). Per-run state (the LiveRun) lives in
st.session_state, so two tabs run independently.
"""

from __future__ import annotations

import dataclasses
import json
import time

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.methods import catalogue, is_baseline, make_method, method_class
from dynatree_core.decoding.pairs import encode_prompt
from dynatree_core.decoding.settings import RunSpec
from dynatree_core.live.engine_run import EngineRun
from dynatree_core.live.run import LiveRun
from dynatree_core.ui.live_view import RENDER_INTERVAL_S, metrics_row, render
from dynatree_core.ui.replay import POSTER_FRAMES, PREWARM_FRAME, REPLAY_INTERVAL_S, replay_run, replay_step
from dynatree_core.ui.resources import (
    cached_pair,
    fallback_note,
    live_engine_mode,
    models_info,
    pair_engine,
    pair_job,
    prewarm,
    show_error,
)
from dynatree_core.ui.widgets import (
    advance,
    compact_top,
    import_run,
    live_buttons,
    model_picker,
    param_widgets,
    prompt_inputs,
    setting_widget,
    show_run_error,
)

st.set_page_config(page_title="DynaTree Explorer", page_icon="🌳", layout="wide")
ABOUT = (
    "Tree speculative decoding, live: a small draft model proposes a tree of possible next tokens, the target "
    "model checks the whole tree in one forward pass, and the longest branch it agrees with is kept, plus one "
    "token of its own. The prompt and every setting are in the sidebar."
)


# ----- inputs ------------------------------------------------------------------------------------
compact_top()
st.title(":material/account_tree: DynaTree Explorer", help=ABOUT)

with st.sidebar:
    st.header("Prompt")
    prompt, chat = prompt_inputs("", default="Explain what speculative decoding is in two sentences.")
    st.header("Models")
    target_spec, draft_spec, device, dtype = model_picker()
    st.header("Drafting")
    policy_name = st.selectbox(
        "Policy", list(catalogue()), index=list(catalogue()).index("fixed_tree"), help="How the draft tree is grown."
    )
    st.caption((method_class(policy_name).__doc__ or "").strip().split("\n")[0])
    params = param_widgets(policy_name)
    st.header("Sampling")
    temperature = setting_widget("temperature")
    top_p = setting_widget("top_p", disabled=temperature == 0)
    top_k = setting_widget("top_k", disabled=temperature == 0)
    verifier = setting_widget("verifier")
    order = setting_widget("order")
    max_new = setting_widget("max_new_tokens")
    seed = setting_widget("seed")
    spec = RunSpec(
        target=target_spec,
        draft=draft_spec,
        device=device,
        dtype=dtype,
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        verifier=verifier,
        order=order,
        seed=seed,
    )

# What the page asked for, as the run keeps it (LiveRun.settings): a change asks for a restart
settings = {**dataclasses.asdict(spec), "policy": policy_name, "params": params, "prompt": prompt, "chat": chat}


def decode_config(eos_token_ids: frozenset[int], context_length: int) -> DecodeConfig:
    """The run's DecodeConfig from the sidebar, for a target with these EOS ids and context."""
    return spec.decode_config(
        eos_token_ids=eos_token_ids,
        context_length=context_length,
        analyze=spec.temperature > 0,  # expected vs realised acceptance per node (outside the timings)
    )


def start_on_engine() -> tuple[LiveRun, bool]:
    """A run decoded by the pair's engine (ui/resources.py): the models load there, this process
    gets their tokenizer. (run, the draft is a stand-in)."""
    policy = make_method(policy_name, params)
    with st.spinner(f"Starting the engine with {target_spec} (the first load converts it, ~30 s)..."):
        engine = pair_engine(target_spec, draft_spec, device, dtype)
    info = engine.wait_ready()
    ids = encode_prompt(info.tokenizer, prompt, chat=chat)
    config = decode_config(info.eos_token_ids, info.context_length)
    run = EngineRun.start_in(engine, ids, policy, settings=settings, spec=spec, config=config)
    return run, info.draft_is_stand_in


def start_in_thread() -> tuple[LiveRun, bool]:
    """A run decoded in this process (its worker is a thread): the reference path."""
    with st.spinner(f"Loading {target_spec} (first load of the embedded model converts it, ~30 s)..."):
        pair = cached_pair(target_spec, draft_spec, device, dtype)
    policy = make_method(policy_name, params)
    ids = encode_prompt(pair.target.tokenizer, prompt, chat=chat)
    config = decode_config(pair.target.eos_token_ids, pair.target.context_length)
    run = LiveRun.start(
        pair.target.model,
        ids,
        policy,
        settings=settings,
        spec=spec,
        config=config,
        **pair.drafting(policy),
        detokenize=lambda tok: pair.target.tokenizer.decode([tok]),
    )
    return run, pair.draft_is_stand_in


def start_run() -> LiveRun | None:
    """Start a LiveRun for the current inputs, where DYNATREE_LIVE_ENGINE says; errors become messages."""
    if not target_spec:
        st.error("Enter a target model (hub id or local directory).")
        return None
    try:
        run, stand_in = start_in_thread() if live_engine_mode() == "thread" else start_on_engine()
        if note := fallback_note():
            st.warning(note)
    except Exception as exc:  # noqa: BLE001 - e.g. a model that cannot load: one line, the traceback logged
        show_error(exc, "Could not start the run")
        return None
    st.session_state.tokenizer_key = (target_spec, draft_spec, device, dtype)
    if stand_in:
        st.warning("This target has no draft model: it drafts for itself (exact, but never faster).")
    return run


# ----- controls and live view ---------------------------------------------------------------------
state = st.session_state
state.setdefault("run", None)


def baseline_view() -> None:
    """HF baselines run inside HF generate as one call: a result, no trees."""
    st.info(
        f"**{policy_name}** is a baseline run inside Hugging Face `generate` as one call: it shows "
        "what a user would get instead (same prompt, models, device and dtype), without trees."
    )
    if st.button("Run baseline", icon=":material/play_arrow:", type="primary", help="One timed HF generate call."):
        try:
            make_method(policy_name, params)  # a bad setting is refused before any model loads
            with st.spinner(f"Loading {target_spec}..."):
                info = models_info((target_spec, draft_spec, device, dtype))
            payload = {
                "method": policy_name,
                "params": params,
                "prompt_ids": encode_prompt(info.tokenizer, prompt, chat=chat),
                "config": decode_config(info.eos_token_ids, info.context_length),
            }
            with st.spinner(f"Running {policy_name}..."):
                result = pair_job((target_spec, draft_spec, device, dtype), "generate", payload, status=st.empty())
            state.baseline = (json.dumps(settings, sort_keys=True), result)
        except Exception as exc:  # noqa: BLE001 - e.g. a model that cannot load: one line, the traceback logged
            show_error(exc, "Could not run the baseline")
    key, result = state.get("baseline") or (None, None)
    if result is None or key != json.dumps(settings, sort_keys=True):
        return
    metrics_row(result, "Tokens / s")
    st.caption(f"Measured on {result.device}, {result.dtype}: wall time of the HF generate call.")
    st.text(result.text)


@st.fragment
def live_view() -> None:
    run_clicked, step_clicked, pause_clicked, reset_clicked, imported = live_buttons()
    if state.run is None and not state.get("replay_seen"):  # opens alive: the recorded run plays
        state.run, state.replay_seen = replay_run(), True
        if state.run is None:
            prewarm(target_spec, draft_spec, device, dtype)
    run: LiveRun | None = state.run
    if reset_clicked and run is not None:
        run.close()  # the worker ends after its current iteration; the run is discarded either way
        run = state.run = None
    if pause_clicked and run is not None:
        run.pause()
    if imported is not None and state.get("imported_name") != imported.name:
        run = state.run = import_run(run, imported)
    if run is not None and not run.done:
        changed = run.differs(settings)
        if changed and (run_clicked or step_clicked or run.worker_running):
            run.pause()
            st.warning(f"Settings changed ({', '.join(changed)}): press Reset to start a run with them.")
            run_clicked = step_clicked = False
    if (run_clicked or step_clicked) and (run is None or run.done):
        run = state.run = start_run()
    if run is not None:
        advance(run, run_clicked, step_clicked)
        if run.worker_running:  # sleep until the next drawing (the first one: the first record) or the end
            run.beat()
            next_drawing = state.get("drawn_at", 0.0) + RENDER_INTERVAL_S - time.monotonic()
            run.wait(next_drawing, records=None if run.records else 1)
    alive = run is not None and run.worker_running  # read before the snapshot, so a last one is complete
    if run is not None and run.error is not None and not alive:
        run = state.run = show_run_error(run)
    if alive and run.waiting_for():  # a job holds the run's engine
        st.info(run.waiting_for(), icon=":material/hourglass_top:")
    if run is not None and run.idle_paused and not alive:
        st.info("Paused: this page stopped watching the run for a while. Press **Run** to go on.")
    state.drawn_at = time.monotonic()
    replaying = run is not None and run is state.get("replay_run") and replay_step(run)
    first_frames = replaying and state.get("replay_at", 0) <= POSTER_FRAMES + 1  # drawn before plotly has loaded
    render(None if run is None else run.snapshot(), running=alive, poster=first_frames, replaying=replaying)
    if replaying and state.get("replay_at") == PREWARM_FRAME:  # the live pair loads while the replay plays,
        prewarm(target_spec, draft_spec, device, dtype)  # once its first frames are drawn (both share the cores)
    if replaying:
        time.sleep(REPLAY_INTERVAL_S)
    if alive or replaying:  # the fragment alone reruns, unless this is a full run (a sidebar change)
        ctx = get_script_run_ctx()
        st.rerun(scope="fragment" if ctx is not None and ctx.fragment_ids_this_run else "app")


if is_baseline(policy_name):
    baseline_view()
else:
    live_view()
