"""DynaTree Explorer: watch tree speculative decoding happen, one iteration at a time.

Thin by design: widgets -> settings -> LiveRun (dynatree_core.live) -> figures (dynatree_core.viz).
Runs decode in an engine process per model pair (dynatree_core.engine_process), shared by every
browser session and running one forward at a time; DYNATREE_LIVE_ENGINE=thread decodes in this
process instead (models loaded once, forwards take a lock). Per-run state (the LiveRun) lives in
st.session_state, so two tabs run independently.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from dynatree_core.engine import DecodeConfig, generate
from dynatree_core.engine_process import call
from dynatree_core.errors import DynaTreeError
from dynatree_core.live import LiveRun, ProcessRun
from dynatree_core.methods import catalogue, is_baseline, make_method, method_class, verifier_for
from dynatree_core.metrics import exactness_note
from dynatree_core.prompts import load_prompts
from dynatree_core.session import encode_prompt
from dynatree_core.settings import RunSpec
from dynatree_core.trace import IterationRecord
from dynatree_core.ui import (
    advance,
    cached_pair,
    engine_process,
    forward_lock,
    import_run,
    latency_points,
    live_buttons,
    live_engine_mode,
    model_picker,
    param_widgets,
    setting_widget,
    show_run_error,
    threads_caption,
)
from dynatree_core.verify.registry import VERIFIERS
from dynatree_core.viz import (
    acceptance_by_depth,
    acceptance_figure,
    clicked_node,
    mask_figure,
    node_details,
    order_block_counts,
    run_charts,
    salf_mass_figure,
    speed_breakdown,
    stop_text,
    text_html,
    tree_figure,
    verification_rows,
    visible,
    why_figure,
    why_text,
)

st.set_page_config(page_title="DynaTree Explorer", page_icon="🌳", layout="wide")
# The engine decodes in its own process (or a worker thread); the page draws its latest iteration
# at most this often. Three figures per page update: one update every 0.6 s keeps the browser near
# 5 figure updates per second. A browser on the same machine draws on the same CPU cores (measured
# here: ~0.2 s of CPU per figure update in headless Chromium), which is why the app leaves it a core.
RENDER_INTERVAL_S = 0.6


# ----- inputs ------------------------------------------------------------------------------------
st.title(":material/account_tree: DynaTree Explorer")
st.caption("Tree speculative decoding, live: the draft proposes a token tree, the target verifies it in one forward.")

with st.sidebar:
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

examples = load_prompts("all")
example = st.selectbox(
    "Example prompts", ["(your own)"] + [f"[{p.domain}] {p.text[:80]}" for p in examples], help="Fills the prompt box."
)
default_prompt = "Explain what speculative decoding is in two sentences."
if example != "(your own)":
    default_prompt = examples[[f"[{p.domain}] {p.text[:80]}" for p in examples].index(example)].text
prompt = st.text_area(
    "Prompt", default_prompt, height=90, key=f"prompt_{example}", help="What the target continues (or answers)."
)
chat = st.toggle("Chat template", value=True, help="Wrap the prompt as a user turn (instruct models).")

# What the page asked for, as the run keeps it (LiveRun.settings): a change asks for a restart
settings = {**dataclasses.asdict(spec), "policy": policy_name, "params": params, "prompt": prompt, "chat": chat}


def decode_config(eos_token_ids: frozenset[int], context_length: int) -> DecodeConfig:
    """The run's DecodeConfig from the sidebar, for a target with these EOS ids and context."""
    return spec.decode_config(
        eos_token_ids=eos_token_ids,
        context_length=context_length,
        analyze=spec.temperature > 0,  # expected vs realised acceptance per node (outside the timings)
    )


def prepare():
    """Models (cached in this process), policy, prompt ids and decode config for the current inputs."""
    with st.spinner(f"Loading {target_spec} (first load of the embedded model converts it, ~30 s)..."):
        pair = cached_pair(target_spec, draft_spec, device, dtype)
    policy = make_method(policy_name, params)
    ids = encode_prompt(pair.target.tokenizer, prompt, chat=chat)
    return pair, policy, ids, decode_config(pair.target.eos_token_ids, pair.target.context_length)


def start_in_process() -> tuple[LiveRun, bool]:
    """A run decoded by the pair's engine process (ui.engine_process): the models load there, this
    process gets their tokenizer. (run, the draft is a stand-in)."""
    policy = make_method(policy_name, params)
    with st.spinner(f"Starting the engine process with {target_spec} (the first load converts it, ~30 s)..."):
        engine = engine_process(target_spec, draft_spec, device, dtype)
    info = engine.wait_ready()
    ids = encode_prompt(info.tokenizer, prompt, chat=chat)
    config = decode_config(info.eos_token_ids, info.context_length)
    run = ProcessRun.start_in(engine, ids, policy, settings=settings, spec=spec, config=config)
    return run, info.draft_is_stand_in


def start_in_thread() -> tuple[LiveRun, bool]:
    """A run decoded in this process (its worker is a thread): the reference path."""
    pair, policy, ids, config = prepare()
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
        run, stand_in = start_in_process() if live_engine_mode() == "process" else start_in_thread()
    except DynaTreeError as exc:
        st.error(str(exc))
        return None
    except Exception as exc:  # a model that cannot load: a message, never a traceback
        st.error(f"Could not start the run: {type(exc).__name__}: {exc}")
        return None
    st.session_state.tokenizer_key = (target_spec, draft_spec, device, dtype)
    if stand_in:
        st.warning("This target has no draft model: it drafts for itself (exact, but never faster).")
    return run


# ----- controls and live view ---------------------------------------------------------------------
state = st.session_state
state.setdefault("run", None)


def metrics_row(result, tps_label: str) -> None:
    m = st.columns(5)
    m[0].metric("Tokens / iteration", f"{result.tokens_per_iteration:.2f}")
    m[1].metric("Acceptance", f"{result.acceptance_rate:.0%}")
    m[2].metric(tps_label, f"{result.throughput_tps:.1f}")
    m[3].metric("Iterations", result.iterations)
    m[4].metric("New tokens", result.new_tokens)


def baseline_view() -> None:
    """HF baselines run inside HF generate as one call: a result, no trees."""
    st.info(
        f"**{policy_name}** is a baseline run inside Hugging Face `generate` as one call: it shows "
        "what a user would get instead (same prompt, models, device and dtype), without trees."
    )
    if st.button("Run baseline", icon=":material/play_arrow:", type="primary", help="One timed HF generate call."):
        try:
            pair, policy, ids, config = prepare()
            with st.spinner(f"Running {policy_name}..."), forward_lock():
                result = generate(
                    pair.target.model,
                    ids,
                    policy,
                    config=config,
                    tokenizer=pair.target.tokenizer,
                    **pair.drafting(policy),
                )
            state.baseline = (json.dumps(settings, sort_keys=True), result)
        except DynaTreeError as exc:
            st.error(str(exc))
        except Exception as exc:  # a model that cannot load: a message, never a traceback
            st.error(f"Could not run the baseline: {type(exc).__name__}: {exc}")
    key, result = state.get("baseline") or (None, None)
    if result is None or key != json.dumps(settings, sort_keys=True):
        return
    metrics_row(result, "Tokens / s")
    st.caption(f"Measured on {result.device}, {result.dtype}: wall time of the HF generate call.")
    st.text(result.text)


@st.fragment
def live_view() -> None:
    run_clicked, step_clicked, pause_clicked, reset_clicked, imported = live_buttons()
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
    if run is not None and run.idle_paused and not alive:
        st.info("Paused: this page stopped watching the run for a while. Press **Run** to go on.")
    state.drawn_at = time.monotonic()
    render(None if run is None else run.snapshot(), running=alive)
    if alive:  # the fragment alone reruns, unless this is a full run (a sidebar change)
        ctx = get_script_run_ctx()
        st.rerun(scope="fragment" if ctx is not None and ctx.fragment_ids_this_run else "app")


@st.cache_data
def glossary() -> str:
    """The README's glossary table: one source for the docs and the page."""
    text = (Path(__file__).parent / "README.md").read_text(encoding="utf-8")
    start = text.index("## Glossary")
    return text[text.index("\n", start) : text.index("\n## ", start + 1)].strip()


def run_verifier(run: LiveRun) -> str:
    """The verifier a run used (as the engine resolved it); greedy for runs from older files."""
    if run.spec is None:  # a file's settings we cannot read: its trees are greedy's
        return "greedy"
    try:
        return verifier_for(make_method(run.policy_name, run.params), run.spec.decode_config())
    except DynaTreeError:
        return "greedy"


def explain(rec: IterationRecord, decode: Callable[[int], str], verifier: str = "greedy") -> str:
    """The iteration in words, with its own tokens as the example."""
    levels = max(rec.tree.depths) if len(rec.tree) > 1 else 0
    accepted = "".join(decode(rec.tree.tokens[n]) for n in rec.accepted)
    pruned = sum(1 for n in range(len(rec.tree)) if not rec.tree.is_verified(n))
    bonus = "none (the run stopped first)" if rec.bonus_token is None else f"`{visible(decode(rec.bonus_token))}`"
    return (
        f"1. **Draft.** From the root `{visible(decode(rec.tree.tokens[0]))}` the draft model grew a tree "
        f"of {len(rec.tree) - 1} proposed tokens over {levels} levels, one draft forward per level "
        f"({rec.draft_forwards} forwards); {pruned} were pruned before verification.\n"
        f"2. **Verify.** The target read the {rec.drafted} remaining nodes (plus the root"
        + (f" and {rec.chain_len - 1} committed tokens it had not seen" if rec.chain_len > 1 else "")
        + ") in **one forward**, each node attending only to its ancestors (the mask on the right), "
        "at position root + depth.\n"
        + (
            f"3. **Commit.** The longest path that matches the target's own choices was accepted: "
            f"{len(rec.accepted)} tokens (`{visible(accepted)}`), then the target's next token was added "
            f"for free as the bonus: {bonus}. "
            if verifier == "greedy"
            else f"3. **Commit.** The `{verifier}` verifier walked down from the root: at each node it drew "
            "a token from the target's distribution, steering towards the drafted children without changing "
            f"that distribution, and moved on while the token was a verified child: {len(rec.accepted)} "
            f"accepted (`{visible(accepted)}`), then the token it drew where the walk stopped: {bonus}. "
            if VERIFIERS.get(verifier) is None or VERIFIERS[verifier].direction == "top-down"
            else f"3. **Commit.** The `{verifier}` verifier walked up from the leaves (post-order): it tested "
            "each leaf against its sequence weight (the target/draft ratio of its whole path, clipped), and "
            "after each rejection handed the leftover probability to the parent's residual, until a node was "
            f"accepted: {len(rec.accepted)} tokens (`{visible(accepted)}`), then a token drawn from that "
            f"node's (residual) target distribution: {bonus}. "
        )
        + f"{len(rec.committed)} tokens committed; the draft's and the target's caches keep the accepted "
        "path's entries and drop the rest."
    )


def ar_reference(run: LiveRun, key: str) -> None:
    """Autoregressive decoding of the run's prompt (same length budget), for the speedup chart; in
    the run's engine process when it has one (its models, its cores, one forward at a time)."""
    key_models = st.session_state.get("tokenizer_key")
    if key_models is None or run.spec is None:
        st.error("No AR reference for an imported run: start a run with its models first.")
        return
    try:
        with st.spinner("Running the AR reference..."):
            if isinstance(run, ProcessRun):
                engine = engine_process(*key_models)
                info = engine.wait_ready()
                config = DecodeConfig(
                    max_new_tokens=run.spec.max_new_tokens,
                    eos_token_ids=info.eos_token_ids,
                    context_length=info.context_length,
                )
                ref = call(engine, "ar", (run.prompt_ids, config))
            else:
                pair = cached_pair(*key_models)
                config = DecodeConfig(
                    max_new_tokens=run.spec.max_new_tokens,
                    eos_token_ids=pair.target.eos_token_ids,
                    context_length=pair.target.context_length,
                )
                with forward_lock():
                    ref = generate(pair.target.model, run.prompt_ids, make_method("ar"), config=config)
    except DynaTreeError as exc:
        st.error(f"No AR reference: {exc}")
        return
    st.session_state.setdefault("ar_tps", {})[key] = ref.throughput_tps


def node_panel(rec: IterationRecord, node: int | None, decode: Callable[[int], str]) -> None:
    if node is None:
        st.caption("Click a node for its path as text and the target's prediction there.")
        return
    try:
        details = node_details(rec, node, decode)
    except ValueError:  # a stale selection from another tree
        return
    st.markdown(
        "**Selected node**\n\n" + "\n".join(f"- **{k}**: `{v.replace('`', 'ˋ')}`" for k, v in details.items()),
    )


WHILE_DECODING = "Shown when the run pauses or finishes (drawing less keeps the CPU for the engine)."


def verification_view(run: LiveRun, rec: IterationRecord, running: bool = False) -> None:
    """The verifier's steps in this iteration and, for sampled runs, expected vs realised acceptance."""
    with st.expander(f"Verification trace ({rec.verifier}): every test, draw and residual"):
        if running:
            st.caption(WHILE_DECODING)
            return
        rows = verification_rows(rec, run.text)
        if not rows:
            st.caption("This record has no trace (a run exported before traces existed).")
        else:
            st.caption(
                "Each test accepts the tried child when the uniform draw is at most its acceptance probability "
                "(p/q for speculative sampling, the sequence weight for block / traversal). After a rejection the "
                "verifier draws from the residual; the last row is the token it committed where the walk stopped."
            )
            st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
        by_depth = acceptance_by_depth(run.records)
        if by_depth:
            st.caption(
                "Expected (from the verifier's exact branching law on each drawn tree) vs realised acceptance, "
                f"over {by_depth[0]['iterations']} iterations. The Verification Lab page repeats one step many times."
            )
            st.plotly_chart(acceptance_figure(by_depth), width="stretch", key="acceptance_depth")


def why_view(run: LiveRun, ar_tps: float | None, running: bool = False) -> None:
    """Why this run is (not) faster than plain decoding: its time split against the device's
    latency profile (measured on request, once per model pair)."""
    with st.expander("Why is it (not) faster?"):
        if running:
            st.caption(WHILE_DECODING)
            return
        key_models = st.session_state.get("tokenizer_key")
        profiles = state.setdefault("latency_profiles", {})
        points = profiles.get(str(key_models))
        if (
            key_models is not None
            and points is None
            and st.button(
                "Measure this device's latency profile",
                help="Times target and draft forwards over 1-64 tokens (a few seconds on CPU), once per model pair.",
            )
        ):
            try:
                with st.spinner("Timing forwards..."):
                    points = profiles[str(key_models)] = latency_points(*key_models)
            except DynaTreeError as exc:
                st.error(str(exc))
        step_ms = None
        if points:
            step_ms = min((p.ms for p in points if p.model == "target" and p.new_tokens == 1), default=None)
        elif ar_tps:
            step_ms = 1000.0 / ar_tps
        st.markdown(why_text(speed_breakdown(run.records, step_ms)))
        if points:
            st.plotly_chart(why_figure(points, run.records), width="stretch", key="why")


def measured_caption(run: LiveRun) -> str:
    """Where and how the run's throughput was measured."""
    if run.imported:
        threads = f", {run.threads} torch thread{'s' if run.threads != 1 else ''}" if run.threads else ""
        return f"Measured on {run.device}, {run.dtype}, from engine time{threads}: an imported run, measured elsewhere."
    kind = f" with the {run.draft_kind} draft" if run.draft_kind else ""
    where = (
        f"in its own process ({threads_caption(run.threads)})"
        if isinstance(run, ProcessRun)
        else f"in a thread of the page's process ({threads_caption()})"
    )
    note = exactness_note(run.dtype)
    return (
        f"Measured on {run.device}, {run.dtype}, from engine time (drawing excluded): the engine decodes{kind} {where} "
        f"and the page draws its latest iteration every {RENDER_INTERVAL_S} s." + (f" {note}" if note else "")
    )


def tree_and_mask(run: LiveRun, rec: IterationRecord) -> None:
    """One iteration's draft tree (clickable) beside the attention mask the target received."""
    left, right = st.columns([3, 2])
    with left:
        st.subheader(f"Draft tree — iteration {rec.index}")
        chart_key = f"tree_{rec.index}"  # one selection per iteration
        selected = clicked_node(state.get(chart_key))
        st.plotly_chart(
            tree_figure(rec, run.text, selected=selected),
            width="stretch",
            key=chart_key,
            on_select="rerun",
            selection_mode="points",
        )
        node_panel(rec, selected, run.text)
    with right:
        st.subheader("Attention mask sent to the target")
        st.plotly_chart(mask_figure(rec, run.text), width="stretch", key="mask")
        counts = order_block_counts(rec.tree)
        st.caption(
            f"{len(rec.order)} nodes (root first), positions {rec.position_ids[0]}..{max(rec.position_ids)}; "
            f"non-zero 32x32 blocks: BFS {counts['bfs']}, DFS {counts['dfs']}"
        )
    if rec.tree.notes.get("salf_mass"):
        st.caption("SALF: probability mass of each drafting step's batch; drafting stops below th.")
        st.plotly_chart(salf_mass_figure(rec.tree.notes["salf_mass"], float(run.params.get("th", 0))), key="salf")


def render(run: LiveRun | None, running: bool = False) -> None:
    """The run's latest (or scrubbed-to) iteration. `running`: its worker is decoding, so the page
    draws only what changes each iteration (metrics, tree, mask, text, charts); the verification
    trace, the speed analysis and the export (which serialises every record) wait until the run
    pauses or finishes: every drawing costs the engine CPU time and, in Python, the GIL."""
    if run is None or not run.records:
        st.info(
            "Decoding the first iteration..."
            if running
            else "Press **Run** to decode live, or **Step** for one iteration at a time."
        )
        return
    result = run.result()
    metrics_row(result, "Tokens / s (engine time)")
    st.caption(measured_caption(run))
    if run.done:
        st.info(stop_text(run.records[-1].stop), icon=":material/flag:")
    n = len(run.records)
    pick = (
        st.slider("Iteration", 1, n, n, key=f"scrub_{n}", help="Go back to any iteration's tree and mask.")
        if n > 1
        else 1
    )
    rec = run.records[pick - 1]
    tree_and_mask(run, rec)
    with st.expander("What happened in this iteration (draft → verify → commit)"):
        st.markdown(explain(rec, run.text, run_verifier(run)))
    verification_view(run, rec, running)
    with st.expander("Glossary of tree terms"):
        st.markdown(glossary())
    st.subheader("Generated text")
    st.html(text_html(run.records, run.text))
    ref_key = json.dumps({k: v for k, v in run.settings.items() if k not in ("policy", "params", "order")})
    if st.button(
        "Measure AR reference",
        disabled=running,
        help="Decode the same prompt with the target alone, for the speedup"
        + (" (after the run pauses or finishes: both would share the cores)." if running else "."),
    ):
        ar_reference(run, ref_key)
    ar_tps = state.setdefault("ar_tps", {}).get(ref_key)
    if ar_tps:
        st.caption(f"AR reference: {ar_tps:.1f} tokens/s on the same prompt, device and dtype.")
    st.plotly_chart(run_charts(run.records, ar_tps), width="stretch", key="charts")
    why_view(run, ar_tps, running)
    if running:
        return
    st.download_button(
        "Export run (JSON)",
        run.to_json,  # built on click (a sampled run's draws make it megabytes), not on every rerun
        file_name="dynatree-run.json",
        mime="application/json",
        help="Every iteration's record, settings and token texts; Import replays it here.",
    )


if is_baseline(policy_name):
    baseline_view()
else:
    live_view()
