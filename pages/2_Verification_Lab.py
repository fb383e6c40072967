"""Verification Lab: run one verifier many times on a fixed context and compare the empirical
next-token histogram with the target's distribution (dynatree_core.measure.lab). Opens on a
recorded experiment; runs on the live page's run or on a prompt and pair of its own."""

from __future__ import annotations

import streamlit as st

from dynatree_core.core.sampling_config import SamplingConfig
from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.methods import candidates, verifier_for
from dynatree_core.decoding.pairs import encode_prompt
from dynatree_core.drafting import make_policy
from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.lab import lab_from_report
from dynatree_core.ui.lab_view import show_lab
from dynatree_core.ui.recorded import LAB, about, recorded_lab
from dynatree_core.ui.resources import models_info, pair_job, show_error
from dynatree_core.ui.widgets import model_picker, param_widgets, prompt_inputs, setting_widget
from dynatree_core.verify.registry import VERIFIERS
from dynatree_core.viz import visible

st.set_page_config(page_title="Verification Lab", page_icon="🧪", layout="wide")
st.title("Verification Lab")
st.caption(
    "Speculative sampling promises that its output is distributed exactly as the target's. Here one "
    "draft → verify step is repeated many times on a fixed context, each with a freshly drawn tree: the "
    "first committed token's histogram should match the target's next-token distribution."
)
LIVE, OWN = "the live page's run", "a prompt of your own"
STEPPED = [n for n in candidates() if not n.startswith("hf_")]


def recorded_view() -> None:
    """Before the visitor's own experiment: the shipped one, drawn from its report."""
    report = recorded_lab()
    if report is None:
        return
    try:
        result = lab_from_report(report)
    except DynaTreeError:  # a damaged shipped file: the page opens on its form instead
        return
    st.info(
        f"**A recorded experiment**: {report['verifier']} verifying {report['policy']} trees, "
        f"{report['trials']} steps at temperature {report['temperature']} after “{report['prompt']}”. "
        "The controls below run **your own**.",
        icon=":material/history:",
    )
    texts = report["texts"]
    show_lab(report["verifier"], result, lambda t: visible(texts.get(str(t), str(t))), "rec")
    st.caption("Recorded: " + about(LAB, report.get("environment"), report.get("date", ""), report.get("command", "")))


recorded_slot = st.empty()  # the recorded experiment until the visitor runs one (emptied when Run is pressed)
if "lab" not in st.session_state and not st.session_state.get("lab_run"):
    with recorded_slot.container():
        recorded_view()
        st.header("Run the lab")

run = st.session_state.get("run")
has_live = run is not None and bool(run.records) and run.spec is not None and bool(run.spec.target)
source = st.radio("Context", [LIVE, OWN], horizontal=True, key="lab_source") if has_live else OWN
with st.sidebar:
    st.header("Models (your own prompt)")
    own_models = model_picker("lab")
if source == LIVE:
    spec = run.spec
    models = (spec.target, spec.draft, spec.device, spec.dtype)
    policy_name, params = run.policy_name, dict(run.params)
    n = len(run.records)
    upto = st.slider("Context: the prompt plus the text committed before iteration", 1, n, n) if n > 1 else 1
    context = list(run.prompt_ids) + [t for rec in run.records[: upto - 1] for t in rec.committed]
    st.caption(
        f"Policy **{policy_name}** {params}, context of {len(context)} tokens ending in "
        f"`{visible(''.join(run.text(t) for t in context[-12:]))}`."
    )
    base_temperature, base_top_p, base_verifier, top_k = spec.temperature, spec.top_p, spec.verifier, spec.top_k
else:
    models, context = own_models, None
    prompt, chat = prompt_inputs("lab_", height=70)
    policy_name = st.selectbox("Policy", STEPPED, index=STEPPED.index("fixed_tree"), key="lab_policy")
    with st.expander("Parameters"):
        params = param_widgets(policy_name, key_prefix="lab")
    base_temperature, base_top_p, base_verifier, top_k = 0.8, 1.0, "specinfer", 0
sampled = [v for v in VERIFIERS if v != "greedy"]
c1, c2, c3, c4 = st.columns(4)
default = base_verifier if base_verifier in sampled else "specinfer"
verifier = c1.selectbox("Verifier", sampled, index=sampled.index(default), help=VERIFIERS[default].summary)
# Sampling only: the lab's temperature starts above 0 and its verifiers are the sampled ones (a
# subset of the registry's ranges, so these two widgets are the page's own).
temperature = c2.slider("Temperature", 0.1, 2.0, base_temperature or 0.8, 0.1)
top_p = setting_widget("top_p", value=base_top_p, where=c3)
trials = c4.slider("Repetitions", 20, 2000, 200, 20, help="Each costs one draft tree and one target forward.")

if st.button("Run the lab", type="primary", icon=":material/science:", key="lab_run"):
    try:
        if not models[0]:
            raise ValueError("enter a target model")
        info = models_info(models)  # the pair's engine process holds the models for every page
        if context is None:
            if not prompt.strip():
                raise ValueError("enter a prompt")
            context = encode_prompt(info.tokenizer, prompt, chat=chat)
        policy = make_policy(policy_name, params)
        config = DecodeConfig(
            max_new_tokens=8,
            eos_token_ids=info.eos_token_ids,
            context_length=info.context_length,
            sampling=SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k),
            verifier=verifier,
        )
        verifier_for(policy, config)  # refuse an invalid pairing before any work
        status = st.empty()
        bar = st.progress(0.0, text="Repeating the step...")
        payload = {"policy": policy_name, "params": params, "context": context, "config": config, "trials": trials}
        result = pair_job(
            models,
            "lab",
            payload,
            on_event=lambda kind, data: bar.progress(data[0] / trials, text=f"Step {data[0]}/{trials}"),
            status=status,
        )
        bar.empty()
        decode = run.text if source == LIVE else (lambda t: info.tokenizer.decode([t]))
        texts = {t["id"]: visible(decode(t["id"])) for t in result.table(str) if t["id"] >= 0}
        st.session_state["lab"] = (verifier, result, texts)
        st.rerun()
    except Exception as exc:  # noqa: BLE001 - e.g. a model that cannot load: one line, the traceback logged
        show_error(exc, "The lab could not run")

if "lab" in st.session_state:
    name, result, texts = st.session_state["lab"]
    st.header("Your experiment")
    show_lab(name, result, lambda t: texts.get(t, str(t)), "lab")
