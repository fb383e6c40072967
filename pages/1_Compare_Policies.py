"""Compare drafting policies side by side on one prompt and one model pair (dynatree_core.measure.compare):
fair timing (same models, warm-up discarded, interleaved rounds, ar and HF generate as references),
a live view while it runs, a results table and charts, a correctness badge, CSV/JSON export."""

from __future__ import annotations

import dataclasses
import time

import streamlit as st

from dynatree_core.decoding.methods import candidates, make_method, method_class
from dynatree_core.decoding.pairs import encode_prompt
from dynatree_core.decoding.settings import RunSpec
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.jobs import JOB_TITLES
from dynatree_core.measure.compare import Comparison, reference_entries
from dynatree_core.measure.entries import Entry, labelled, schedule
from dynatree_core.ui.compare_view import COLUMN_PX, show_comparison
from dynatree_core.ui.recorded import about, machine, recorded_comparisons
from dynatree_core.ui.resources import models_info, pair_job, show_error
from dynatree_core.ui.widgets import model_picker, param_widgets, prompt_inputs, setting_widget
from dynatree_core.viz import legend_html, tree_figure
from dynatree_core.viz.reports import speedup_figure

st.set_page_config(page_title="Compare policies", page_icon="⚖️", layout="wide")
st.title("Compare drafting policies")
st.caption(
    "Which policy wins on *your* prompt and models? Every policy runs on the same loaded models, after a "
    "discarded warm-up, interleaved round by round; `ar` (our loop) and HF `generate` run in the same rounds "
    "as references. Throughput is engine time."
)
CHOICES = candidates()
DEFAULTS = ["linear", "fixed_tree", "dynatree", "salf", "dyspec", "eagle2"]


def recorded_view() -> None:
    """Before the visitor's own comparison: the shipped ones (the seed papers' policies on one
    prompt; CPU, and the lent GPU's beside it where one was recorded), drawn from their reports."""
    recorded = recorded_comparisons()
    if not recorded:
        return
    st.info(
        f"**A recorded comparison**: {', '.join(e.label for e in recorded[0][1].entries if not e.reference)} on "
        f"“{recorded[0][1].prompt}”. The form below runs **your own** prompt and policies.",
        icon=":material/history:",
    )
    if len(recorded) > 1:  # the machines side by side first, then each one's details in its tab
        rows = [(machine(r.environment), [dataclasses.asdict(e) for e in r.entries]) for _, r in recorded]
        st.markdown("**Speedup by policy on each machine** (over the faster reference of its own run)")
        st.plotly_chart(speedup_figure(rows), width="stretch", key="rec_machines")
    tabs = st.tabs([machine(r.environment) for _, r in recorded]) if len(recorded) > 1 else [st.container()]
    for tab, (name, result) in zip(tabs, recorded, strict=True):
        with tab:
            show_comparison(result, f"rec_{name}", compact=True)
            st.caption("Recorded: " + about(name, result.environment, result.date, result.command))


# The recorded comparison until the visitor has one; gone (its slot emptied) from the moment Compare
# is pressed, so that the page then shows only the visitor's live trees and results.
recorded_slot = st.empty()
if st.session_state.get("comparison") is None and not st.session_state.get("cmp_run"):
    with recorded_slot.container():
        recorded_view()
        st.header("Compare your own")

with st.sidebar:
    st.header("Models")
    target_spec, draft_spec, device, dtype = model_picker("cmp")
    st.header("Decoding")
    temperature = setting_widget("temperature", key="cmp_temperature")
    top_p = setting_widget("top_p", key="cmp_top_p", disabled=temperature == 0)
    top_k = setting_widget("top_k", key="cmp_top_k", disabled=temperature == 0)
    verifier = setting_widget("verifier", key="cmp_verifier")  # one verifier for every policy (auto per policy)
    max_new = setting_widget("max_new_tokens", key="cmp_max_new")
    repetitions = st.slider("Repetitions", 1, 10, 3, key="cmp_reps", help="Measured runs per policy, after a warm-up.")
    seed = setting_widget("seed", key="cmp_seed")
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
        seed=seed,
    )
    include_hf = st.toggle(
        "HF generate references",
        True,
        key="cmp_hf",
        help="Time HF's generate as well: eager, and with a static cache (compiled on CUDA).",
    )

prompt, chat = prompt_inputs("cmp_", height=80)  # opens on the first bundled prompt, so Compare works at once

count = st.number_input("Policies to compare", 2, 6, 4, key="cmp_count")
entries = []
columns = st.columns(int(count))
for i, col in enumerate(columns):
    with col:
        name = st.selectbox(
            f"Policy {i + 1}",
            CHOICES,
            index=CHOICES.index(DEFAULTS[i]),
            key=f"cmp_policy_{i}",
            format_func=lambda n: f"{n} · {method_class(n).family}",
            help="Each name says its family: where its candidates come from (model, recycled, retrieved, joined).",
        )
        with st.expander("Parameters"):
            params = param_widgets(name, key_prefix=f"cmp{i}")
        entries.append(Entry(name, params))
entries = labelled(entries)  # unique labels when a policy appears twice


def live_view(labels: list[str], decode):
    """One column per compared policy: its latest tree and running tokens/s (black boxes: none),
    under one legend for the row; each small tree labels the tokens that fit (all in the hover)."""
    slots, stats = {}, {}
    mixed = any(make_method(e.policy, e.params).configured_family() not in ("model", "none") for e in entries)
    st.html(legend_html(sources=mixed))
    cols = st.columns(len(labels))
    for label, col in zip(labels, cols, strict=True):
        with col:
            st.markdown(f"**{label}**")
            slots[label] = (st.empty(), st.empty())
    last = {"t": 0.0}

    def on_record(label, rec, _):
        tokens, ms = stats.get(label, (0, 0.0))
        stats[label] = (tokens + len(rec.committed), ms + rec.wall_ms)
        if label not in slots or time.monotonic() - last["t"] < 0.5:  # at most 2 redraws per second
            return
        last["t"] = time.monotonic()
        figure, text = slots[label]
        small = tree_figure(rec, decode, height=220, compact_px=COLUMN_PX * 4 // len(labels))
        figure.plotly_chart(small, width="stretch", key=f"live_{label}_{time.time_ns()}")
        tokens, ms = stats[label]
        text.caption(f"iteration {rec.index}: {tokens / ms * 1000:.1f} tokens/s so far")

    return on_record


if st.button("Compare", type="primary", icon=":material/compare_arrows:", key="cmp_run"):
    if not target_spec:
        st.error("Enter a target model.")
    elif not prompt.strip():
        st.error("Enter a prompt.")
    else:
        try:
            models = (target_spec, draft_spec, device, dtype)
            with st.spinner("Loading models..."):
                info = models_info(models)  # the pair's engine process holds them for every page
            tokenizer = info.tokenizer
            payload = {
                "entries": entries,
                "prompt_ids": encode_prompt(tokenizer, prompt, chat=chat),
                "config": spec.decode_config(eos_token_ids=info.eos_token_ids, context_length=info.context_length),
                "repetitions": repetitions,
                "include_hf": include_hf,
                "prompt": prompt,
                "models": {
                    "target": spec.target,
                    "draft": spec.draft or "",
                    "device": spec.device,
                    "dtype": spec.dtype,
                },
            }
            total = len(schedule(len(entries) + len(reference_entries(include_hf)), repetitions))
            status = st.empty()
            bar = st.progress(0.0, text=f"0/{total} runs")
            on_record = live_view([e.label for e in entries], lambda t: tokenizer.decode([t]))

            def on_event(kind, data):
                if kind == "progress":
                    done, n, label = data
                    bar.progress(done / n, text=f"{done}/{n} runs: {label}")
                elif kind == "record":
                    on_record(*data, None)

            st.session_state["comparison"] = pair_job(models, "compare", payload, on_event=on_event, status=status)
            st.rerun()
        except Exception as exc:  # noqa: BLE001 - e.g. a model that cannot load: one line, the traceback logged
            show_error(exc, f"{JOB_TITLES['compare'].capitalize()} could not run")

uploaded = st.file_uploader("Import a saved comparison (JSON)", type=["json"], key="cmp_import")
if uploaded is not None:
    try:
        st.session_state["comparison"] = Comparison.from_json(uploaded.getvalue())
    except DynaTreeError as exc:
        st.error(str(exc))

result: Comparison | None = st.session_state.get("comparison")
if result is not None:
    st.header("Results")
    show_comparison(result, "cmp")
