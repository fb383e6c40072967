"""Verification Lab: run one verifier many times on the current run's context and compare the
empirical next-token histogram with the target's distribution (dynatree_core.measure.lab)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dynatree_core.core.sampling_config import SamplingConfig
from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.methods import verifier_for
from dynatree_core.drafting import make_policy
from dynatree_core.measure.lab import chi_square_critical
from dynatree_core.ui.resources import models_info, pair_job, show_error
from dynatree_core.ui.widgets import setting_widget
from dynatree_core.verify.registry import VERIFIERS
from dynatree_core.viz import acceptance_by_depth, acceptance_figure, first_token_figure, visible

st.set_page_config(page_title="Verification Lab", page_icon="🧪", layout="wide")
st.title("Verification Lab")
st.caption(
    "Speculative sampling promises that its output is distributed exactly as the target's. Here one "
    "draft → verify step is repeated many times on a fixed context, each with a freshly drawn tree: the "
    "first committed token's histogram should match the target's next-token distribution."
)

run = st.session_state.get("run")
if run is None or not run.records or run.spec is None or not run.spec.target:
    st.info("Start a run on the main page first: the lab uses that run's models, policy and text as its context.")
    st.stop()
spec = run.spec
n = len(run.records)
upto = st.slider("Context: the prompt plus the text committed before iteration", 1, n, n) if n > 1 else 1
context = list(run.prompt_ids) + [t for rec in run.records[: upto - 1] for t in rec.committed]
sampled = [v for v in VERIFIERS if v != "greedy"]
c1, c2, c3, c4 = st.columns(4)
default = spec.verifier if spec.verifier in sampled else "specinfer"
verifier = c1.selectbox("Verifier", sampled, index=sampled.index(default), help=VERIFIERS[default].summary)
# Sampling only: the lab's temperature starts above 0 and its verifiers are the sampled ones (a
# subset of the registry's ranges, so these two widgets are the page's own).
temperature = c2.slider("Temperature", 0.1, 2.0, spec.temperature or 0.8, 0.1)
top_p = setting_widget("top_p", value=spec.top_p, where=c3)
trials = c4.slider("Repetitions", 20, 2000, 200, 20, help="Each costs one draft tree and one target forward.")
st.caption(
    f"Policy **{run.policy_name}** {run.params}, context of {len(context)} tokens ending in "
    f"`{visible(''.join(run.text(t) for t in context[-12:]))}`."
)

if st.button("Run the lab", type="primary", icon=":material/science:"):
    try:
        models = (spec.target, spec.draft, spec.device, spec.dtype)
        info = models_info(models)  # the pair's engine process holds the models for every page
        policy = make_policy(run.policy_name, run.params)
        config = DecodeConfig(
            max_new_tokens=spec.max_new_tokens,
            eos_token_ids=info.eos_token_ids,
            context_length=info.context_length,
            sampling=SamplingConfig(temperature=temperature, top_p=top_p, top_k=spec.top_k),
            verifier=verifier,
        )
        verifier_for(policy, config)  # refuse an invalid pairing before any work
        status = st.empty()
        bar = st.progress(0.0, text="Repeating the step...")
        payload = {
            "policy": run.policy_name,
            "params": dict(run.params),
            "context": context,
            "config": config,
            "trials": trials,
        }
        result = pair_job(
            models,
            "lab",
            payload,
            on_event=lambda kind, data: bar.progress(data[0] / trials, text=f"Step {data[0]}/{trials}"),
            status=status,
        )
        bar.empty()
        st.session_state["lab"] = (verifier, result)
    except Exception as exc:  # noqa: BLE001 - e.g. a model that cannot load: one line, the traceback logged
        show_error(exc, "The lab could not run")

if "lab" in st.session_state:
    name, result = st.session_state["lab"]
    stat, dof = result.chi_square()
    critical = chi_square_critical(dof)
    m = st.columns(3)
    m[0].metric("Repetitions", len(result.first_tokens))
    m[1].metric("Chi-square vs target", f"{stat:.1f}", help=f"{dof} degrees of freedom")
    m[2].metric("Critical value at 0.001", f"{critical:.1f}")
    (st.success if stat < critical else st.warning)(
        f"{name}: the histogram is {'consistent' if stat < critical else 'NOT consistent'} with the target's "
        "distribution at significance 0.001."
    )
    rows = result.table(lambda t: visible(run.text(t)))
    st.subheader("First committed token: observed vs the target's distribution")
    st.plotly_chart(first_token_figure(rows), width="stretch", key="lab_hist")
    by_depth = acceptance_by_depth(result.records)
    if by_depth:
        st.subheader("Expected vs realised acceptance by depth")
        st.plotly_chart(acceptance_figure(by_depth), width="stretch", key="lab_depth")
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
