"""A lab result as the Verification Lab shows it, for a run of the visitor's and for the recorded
experiment the page opens on: the statistic against its critical value, the first token's
histogram against the target's law, acceptance by depth and the table."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import streamlit as st

from dynatree_core.measure.lab import LabResult, chi_square_critical
from dynatree_core.viz import acceptance_figure, first_token_figure


def show_lab(verifier: str, result: LabResult, decode: Callable[[int], str], key: str) -> None:
    """The histogram first (what the page is about), then the numbers and the details."""
    stat, dof = result.chi_square()
    critical = chi_square_critical(dof)
    rows = result.table(decode)
    st.markdown(f"**First committed token: observed ({verifier}) vs the target's distribution**")
    st.plotly_chart(first_token_figure(rows), width="stretch", key=f"{key}_hist")
    m = st.columns(3)
    m[0].metric("Repetitions", len(result.first_tokens))
    m[1].metric("Chi-square vs target", f"{stat:.1f}", help=f"{dof} degrees of freedom")
    m[2].metric("Critical value at 0.001", f"{critical:.1f}")
    (st.success if stat < critical else st.warning)(
        f"{verifier}: the histogram is {'consistent' if stat < critical else 'NOT consistent'} with the target's "
        "distribution at significance 0.001."
    )
    by_depth = result.depth_rows()
    if by_depth:
        st.markdown("**Expected vs realised acceptance by depth**")
        st.plotly_chart(acceptance_figure(by_depth), width="stretch", key=f"{key}_depth")
    with st.expander("The table"):
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
