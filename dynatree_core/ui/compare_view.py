"""A comparison's results as the Compare page shows them, for a run of the user's and for the
recorded one it opens on: the correctness badge, one typical tree per policy, the charts, the
table, the outputs and the exports."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dynatree_core.measure.compare import Comparison
from dynatree_core.runs.records import IterationRecord
from dynatree_core.viz import compare_figures, legend_html, tree_figure

COLUMN_PX = 200  # a small tree's width at four columns on a laptop screen (1366 px, sidebar open: ~210)


def show_badge(result: Comparison) -> None:
    ok = result.correctness["ok"]
    if ok is True:
        st.success(f"✓ Exact: {result.correctness['message']}", icon=":material/verified:")
    elif ok is False:
        st.error(f"✗ {result.correctness['message']}", icon=":material/error:")
    else:
        st.info(result.correctness["message"])


def sample_trees(result: Comparison, key: str) -> None:
    """One typical iteration's tree per stepped policy (EntryStats.sample), drawn from the report's
    own token texts: no model needed. Nothing when the report has no samples (older files)."""
    shown = [e for e in result.entries if e.sample and not e.reference]
    if not shown:
        return
    mixed = any(e.family not in ("model", "none") for e in shown)
    st.html(legend_html(sources=mixed))
    for start in range(0, len(shown), 4):
        row = shown[start : start + 4]
        for e, col in zip(row, st.columns(4), strict=False):
            rec = IterationRecord.from_dict(e.sample["record"])
            texts = e.sample["texts"]
            small = tree_figure(rec, lambda t, texts=texts: texts.get(str(t), str(t)), height=220, compact_px=COLUMN_PX)
            col.markdown(f"**{e.label}** · {len(rec.accepted)} accepted + bonus")
            col.plotly_chart(small, width="stretch", key=f"{key}_tree_{e.label}")


def show_comparison(result: Comparison, key: str, *, compact: bool = False) -> None:
    """Everything a comparison shows; `key` keeps two views' widgets apart. `compact` (a recorded
    comparison above the form): the table, the other charts, outputs and exports in an expander."""
    show_badge(result)
    s = result.settings
    st.caption(
        f"{result.models.get('target', '')} on {result.models.get('device', '')}, {s['max_new_tokens']} new tokens, "
        f"temperature {s['temperature']}, {s['repetitions']} repetitions each; speedup is over the faster reference."
    )
    figures = compare_figures(result.entries)
    left, right = st.columns(2)
    left.plotly_chart(figures["throughput"], width="stretch", key=f"{key}_throughput")
    right.plotly_chart(figures["committed"], width="stretch", key=f"{key}_committed")
    st.markdown("**A typical iteration's tree** (accepted length at the run's median)")
    sample_trees(result, key)
    with st.expander("Table, more charts, outputs and exports") if compact else st.container():
        _details(result, figures, key)


def _details(result: Comparison, figures: dict, key: str) -> None:
    st.dataframe(pd.DataFrame(result.table()), hide_index=True, width="stretch")
    left, right = st.columns(2)
    left.plotly_chart(figures["accepted"], width="stretch", key=f"{key}_accepted")
    right.plotly_chart(figures["depth"], width="stretch", key=f"{key}_depth")
    with st.expander("Outputs"):
        for e in result.entries:
            st.markdown(f"**{e.label}**")
            st.text(e.text or "(token ids only: " + " ".join(map(str, e.token_ids[0][:40])) + ")")
    a, b = st.columns(2)
    a.download_button("Export CSV", result.csv(), file_name="dynatree-compare.csv", mime="text/csv", key=f"{key}_csv")
    b.download_button(
        "Export JSON", result.to_json(), file_name="dynatree-compare.json", mime="application/json", key=f"{key}_json"
    )
