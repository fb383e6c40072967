"""The recorded run the live page opens on (assets/replay/), played one iteration per
REPLAY_INTERVAL_S before any model loads; the live pair starts loading after PREWARM_FRAME."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from dynatree_core.core.settings import env_on
from dynatree_core.live.run import LiveRun

REPLAY_FILE = Path(__file__).resolve().parents[2] / "assets" / "replay" / "welcome.json"
REPLAY_INTERVAL_S = 1.0  # the opening replay shows one iteration per this many seconds
PREWARM_FRAME = 3  # the replay frame after which the live pair starts loading (the first drawings go first)
POSTER_FRAMES = 3  # the replay's first frames draw the tree as an image: the browser is still loading plotly


def replay_run() -> LiveRun | None:
    """The recorded run the live page opens on (assets/replay/), this session's own copy; None
    when the file is missing or unreadable, or DYNATREE_REPLAY=0 (the page then opens on its form)."""
    if not env_on("DYNATREE_REPLAY"):
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
    st.info(replay_banner(run, at), icon=":material/replay:")
    if at > n:
        return False
    st.session_state[f"scrub_{n}"] = at
    st.session_state.replay_at = at + 1
    return at < n


def replay_banner(run: LiveRun, at: int) -> str:
    """What the banner says at replay frame `at` (past the last: the replay is over)."""
    n = len(run.records)
    what = f"a recorded {run.policy_name} run ({run.draft_kind or 'no'} draft)"
    if at < n:
        return f"**Replay: iteration {at} of {n}** of {what}. Press **Run** or **Step** to decode your own prompt."
    return f"**Replay finished** ({n} iterations) of {what}. Press **Run** or **Step** to decode your own prompt."
