"""Process-wide Streamlit resources shared by the app and its pages: loaded model pairs and the
lock that keeps two sessions from running forwards on the same model at once."""

from __future__ import annotations

import threading

import streamlit as st

from dynatree_core.session import load_pair


@st.cache_resource(max_entries=2, show_spinner=False)
def cached_pair(target: str, draft: str | None, device: str, dtype: str):
    return load_pair(target, draft, device=device, dtype=dtype)


@st.cache_resource
def forward_lock() -> threading.Lock:
    return threading.Lock()
