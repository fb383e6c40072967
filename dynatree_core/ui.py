"""Streamlit pieces shared by the app and its pages: process-wide resources (loaded model pairs,
the lock that keeps two sessions from running forwards on the same model at once) and the
policy parameter widgets built from the registry. The only core module importing Streamlit."""

from __future__ import annotations

import threading

import streamlit as st

from dynatree_core.drafting import POLICIES
from dynatree_core.models import PRESETS, presets_only
from dynatree_core.session import load_pair


@st.cache_resource(max_entries=2, show_spinner=False)
def cached_pair(target: str, draft: str | None, device: str, dtype: str):
    return load_pair(target, draft, device=device, dtype=dtype)


@st.cache_resource
def forward_lock() -> threading.Lock:
    return threading.Lock()


def param_widgets(policy_name: str, key_prefix: str = "param") -> dict:
    """One widget per registered parameter of the policy, with its help text."""
    values = {}
    for p in POLICIES[policy_name].params:
        key = f"{key_prefix}_{policy_name}_{p.name}"
        if p.type is bool:
            values[p.name] = st.toggle(p.name, bool(p.default), help=p.help, key=key)
        elif p.type is int:
            values[p.name] = st.slider(p.name, int(p.min), int(p.max), int(p.default), help=p.help, key=key)
        else:
            values[p.name] = st.number_input(
                p.name, float(p.min), float(p.max), float(p.default), help=p.help, format="%.4f", key=key
            )
    return values


CUSTOM = "custom (hub id or local path)"


def model_picker(key_prefix: str = "") -> tuple[str, str | None, str, str]:
    """Sidebar widgets for the model pair, device and dtype: (target, draft, device, dtype).
    A preset fills in both models; "custom" asks for a hub id or local directory (not offered
    when the deployer set DYNATREE_PRESETS_ONLY)."""
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
        target = st.text_input("Target", key=k("target"), help="A hub id (needs network) or a local model directory.")
        draft = (
            st.text_input("Draft", key=k("draft"), help="Empty: the target drafts for itself (exact, never faster).")
            or None
        )
    else:
        target, draft = PRESETS[preset].target, PRESETS[preset].draft
    device = st.selectbox(
        "Device", ["auto", "cpu", "cuda"], key=k("device"), help="auto: CUDA when available, else CPU."
    )
    dtype = st.selectbox(
        "Dtype",
        ["auto", "float32", "bfloat16", "float16"],
        key=k("dtype"),
        help="auto: float32 on CPU (bit-exact greedy).",
    )
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
