"""DynaTree Explorer: live tree speculative decoding (placeholder page until the app issue).

Runs the engine on the embedded model pair for one prompt and shows the result and the per-
iteration statistics. The full live view (tree, mask, controls, history) comes next.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dynatree_core.drafting import POLICIES, make_policy
from dynatree_core.engine import DecodeConfig, generate
from dynatree_core.errors import DynaTreeError
from dynatree_core.session import encode_prompt, load_pair

st.set_page_config(page_title="DynaTree Explorer", page_icon="🌳", layout="wide")
st.title("🌳 DynaTree Explorer")
st.caption("Tree-based speculative decoding, exact under greedy decoding. The live view is under construction.")


@st.cache_resource(max_entries=2, show_spinner="Loading models (first load converts the GGUF, ~30 s)...")
def cached_pair(target: str, device: str, dtype: str):
    return load_pair(target, None, device=device, dtype=dtype)


prompt = st.text_area("Prompt", "Explain what speculative decoding is in two sentences.")
policy_name = st.selectbox("Policy", list(POLICIES), index=list(POLICIES).index("fixed_tree"))
cls = POLICIES[policy_name]
values = {}
for p in cls.params:
    if p.type is int:
        values[p.name] = st.slider(p.name, int(p.min), int(p.max), int(p.default), help=p.help)
    elif p.type is float:
        values[p.name] = st.number_input(
            p.name, float(p.min), float(p.max), float(p.default), help=p.help, format="%.4f"
        )
max_new = st.slider("Max new tokens", 1, 256, 48)

if st.button("Generate", type="primary"):
    try:
        pair = cached_pair("embedded", "auto", "auto")
        ids = encode_prompt(pair.target.tokenizer, prompt, chat=True)
        config = DecodeConfig(
            max_new_tokens=max_new, eos_token_ids=pair.target.eos_token_ids, context_length=pair.target.context_length
        )
        with st.spinner("Decoding..."):
            result = generate(
                pair.target.model,
                ids,
                make_policy(policy_name, values),
                draft=pair.draft.model if pair.draft else None,
                config=config,
                tokenizer=pair.target.tokenizer,
                draft_token_map=pair.draft.token_map if pair.draft else None,
            )
    except DynaTreeError as exc:
        st.error(str(exc))
    else:
        if pair.draft_is_stand_in:
            st.warning("No trained draft model yet: the target is its own draft (exact, not faster).")
        st.write(result.text)
        cols = st.columns(4)
        cols[0].metric("Tokens / iteration", f"{result.tokens_per_iteration:.2f}")
        cols[1].metric("Acceptance", f"{result.acceptance_rate:.0%}")
        cols[2].metric("Tokens / s", f"{result.throughput_tps:.1f}")
        cols[3].metric("Iterations", result.iterations)
        st.dataframe(
            pd.DataFrame(
                [
                    {
                        "iteration": r.index,
                        "drafted": r.drafted,
                        "accepted": len(r.accepted),
                        "committed": len(r.committed),
                        "draft_ms": r.draft_ms,
                        "verify_ms": r.verify_ms,
                    }
                    for r in result.records
                ]
            )
        )
