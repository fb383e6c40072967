"""The live page's analysis sections, drawn when a run pauses or finishes: the verification
trace with expected vs realised acceptance, why the run is (not) faster than plain decoding (the
device's latency profile, measured on request), and the AR reference, run as jobs where the pair
lives (ui/resources.py `pair_job`)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.live.run import LiveRun
from dynatree_core.runs.records import IterationRecord
from dynatree_core.ui.resources import latency_points, models_info, pair_job, show_error
from dynatree_core.viz import (
    acceptance_by_depth,
    acceptance_by_source,
    acceptance_figure,
    speed_breakdown,
    verification_rows,
    why_figure,
    why_text,
)

LIVE_REFERENCES = ("ar", "hf_static")  # our loop and HF's static-cache generate (compiled on CUDA)


def ar_reference(run: LiveRun, key: str) -> None:
    """Autoregressive decoding of the run's prompt (same length budget) by each of LIVE_REFERENCES,
    for the speedup over the faster; a job where the pair lives (its engine process: its models,
    its cores, after any job queued before it)."""
    key_models = st.session_state.get("tokenizer_key")
    if key_models is None or run.spec is None:
        st.error("No AR reference for an imported run: start a run with its models first.")
        return
    measured = {}
    try:
        info = models_info(key_models)
        config = DecodeConfig(
            max_new_tokens=run.spec.max_new_tokens,
            eos_token_ids=info.eos_token_ids,
            context_length=info.context_length,
        )
        status = st.empty()
        for name in LIVE_REFERENCES:
            with st.spinner(f"Running the AR reference {name}..."):
                payload = {"method": name, "prompt_ids": list(run.prompt_ids), "config": config}
                ref = pair_job(key_models, "generate", payload, status=status)
            measured[name] = (ref.throughput_tps, ref.forward_path)
    except Exception as exc:  # noqa: BLE001 - one line here, the traceback in the server log
        show_error(exc, "No AR reference")
        return
    st.session_state.setdefault("ar_refs", {})[key] = measured
    st.session_state.setdefault("ar_tps", {})[key] = max(tps for tps, _ in measured.values())


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
        by_source = acceptance_by_source(run.records)
        if any(row["source"] != "model" for row in by_source):
            st.caption("Acceptance by where the verified nodes came from, over the run so far:")
            st.dataframe(pd.DataFrame(by_source), hide_index=True, width="stretch")
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
        profiles = st.session_state.setdefault("latency_profiles", {})
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
            except Exception as exc:  # noqa: BLE001 - one line here, the traceback in the server log
                show_error(exc, "No latency profile")
        step_ms = None
        if points:
            step_ms = min((p.ms for p in points if p.model == "target" and p.new_tokens == 1), default=None)
        elif ar_tps:
            step_ms = 1000.0 / ar_tps
        st.markdown(why_text(speed_breakdown(run.records, step_ms)))
        if points:
            st.plotly_chart(why_figure(points, run.records), width="stretch", key="why")
