"""Benchmark: opens on the reports the project ships (speedup by policy and machine, tokens per
iteration against drafting's cost, the GPU iteration split); runs a small benchmark or parameter
sweep from the browser (dynatree_core.measure.bench, the protocol of `python -m dynatree_core
bench`) and loads saved reports, both drawn beside the shipped ones."""

from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from dynatree_core.decoding.methods import candidates, method_class
from dynatree_core.decoding.settings import RunSpec
from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.bench import parse_sweep, sweep_entries
from dynatree_core.measure.entries import Entry
from dynatree_core.measure.prompt_sets import CORPORA, bundled_sets, choose_prompts
from dynatree_core.runs.validate import check_size_and_depth
from dynatree_core.runs.validate_reports import check_bench_rows
from dynatree_core.ui.recorded import SPLIT_REPORT, about, shipped_bench
from dynatree_core.ui.resources import models_info, pair_job, show_error
from dynatree_core.ui.widgets import model_picker, setting_widget
from dynatree_core.viz.bench import sweep_figures
from dynatree_core.viz.reports import draft_cost_figure, speedup_figure, split_figure

st.set_page_config(page_title="Benchmark", page_icon="⏱️", layout="wide")
st.title("Benchmark")
st.caption(
    "The DynaTree protocol on the bundled prompts: one discarded warm-up per policy, then R rounds over "
    "N prompts with the policies interleaved; `ar` and HF `generate` as references in the same run. "
    "For long runs use the CLI (`python -m dynatree_core bench ...`) and load its JSON below."
)
STEPPED = candidates()
A_FILE = "a file (.jsonl / .txt)"
figures_box = st.container()  # filled last: the shipped reports, with this session's run and uploads beside them
st.header("Run a benchmark")

with st.sidebar:
    target_spec, draft_spec, device, dtype = model_picker("bench")

mode = st.radio("What to run", ["Policies", "Sweep one policy's parameters"], horizontal=True, key="bench_mode")
sweeps, entries = [], []
if mode == "Policies":
    chosen = st.multiselect("Policies", STEPPED, ["linear", "fixed_tree", "dynatree", "salf"], key="bench_policies")
    entries = [Entry(name) for name in chosen]
else:
    c1, c2 = st.columns(2)
    tunable = [n for n in STEPPED if method_class(n).params]
    sweep_policy = c1.selectbox("Policy", tunable, index=tunable.index("fixed_tree"), key="bench_sweep_policy")
    spec = c2.text_input(
        "Sweep", "depth=3..6", key="bench_sweep", help="NAME=A..B (integers) or NAME=V1,V2; ';' separates several"
    )
a, b, c, d, e, f = st.columns(6)
prompt_set = a.selectbox("Prompts", ["all", *bundled_sets(), *CORPORA, A_FILE], key="bench_prompts")
limit = b.slider("Prompts (N)", 1, 20, 3, key="bench_limit")
with c:
    max_new = setting_widget("max_new_tokens", key="bench_tokens")  # T
max_prompt = d.number_input("Prompt cut (L_max)", 0, 8192, 0, step=64, key="bench_lmax", help="0: whole prompts")
repeats = e.slider("Rounds (R)", 1, 5, 1, key="bench_repeats")
include_hf = f.toggle(
    "HF generate references", True, key="bench_hf", help="HF generate eager and with a static cache (compiled on CUDA)."
)
prompt_spec = prompt_set
if prompt_set in CORPORA or prompt_set == A_FILE:
    where = st.text_input(
        "Path on the server" + (" (empty: download with `datasets`)" if prompt_set in CORPORA else ""),
        key="bench_prompt_path",
        help="WikiText-2: its raw test file (wiki.test.raw); PG-19: a book .txt or a folder of them",
    ).strip()
    prompt_spec = where if prompt_set == A_FILE else (f"{prompt_set}:{where}" if where else prompt_set)

if st.button("Run benchmark", type="primary", icon=":material/timer:"):
    try:
        if mode != "Policies":
            sweeps = [parse_sweep(s) for s in spec.split(";") if s.strip()]
            entries = sweep_entries(sweep_policy, sweeps)
        if not entries:
            raise DynaTreeError("pick at least one policy")
        if not target_spec:
            raise DynaTreeError("enter a target model")
        if not prompt_spec:
            raise DynaTreeError("enter the prompt file's path")
        with st.spinner("Loading prompts..."):
            prompts = choose_prompts(prompt_spec, limit)
        models = (target_spec, draft_spec, device, dtype)
        with st.spinner("Loading models..."):
            info = models_info(models)  # the pair's engine process holds them for every page
        run_spec = RunSpec(target=target_spec, draft=draft_spec, device=device, dtype=dtype, max_new_tokens=max_new)
        config = run_spec.decode_config(eos_token_ids=info.eos_token_ids, context_length=info.context_length)
        status = st.empty()
        bar = st.progress(0.0, text="Starting...")
        payload = {
            "entries": entries,
            "prompts": prompts,
            "config": config,
            "repeats": repeats,
            "include_hf": include_hf,
            "max_prompt_tokens": int(max_prompt) or None,
        }
        report = pair_job(
            models,
            "bench",
            payload,
            on_event=lambda kind, d: bar.progress(d[0] / d[1], text=f"{d[0]}/{d[1]}: {d[2]}"),
            status=status,
        )
        bar.empty()
        report.settings["models"] = {"target": target_spec, "draft": draft_spec}
        st.session_state["bench_report"] = (report, sweeps)
    except Exception as exc:  # noqa: BLE001 - e.g. a model that cannot load: one line, the traceback logged
        show_error(exc, "The benchmark could not run")

if "bench_report" in st.session_state:
    report, sweeps = st.session_state["bench_report"]
    env = report.environment
    st.subheader("This run")
    st.caption(
        f"{env['cpu']} ({env['cpu_count']} cores, {env['torch_threads']} torch threads), {env['device']}, "
        f"{env['dtype']}; torch {env['torch']}, transformers {env['transformers']}."
    )
    st.markdown(report.markdown())
    for name, fig in sweep_figures(report, sweeps).items():
        st.plotly_chart(fig, width="stretch", key=f"bench_sweep_{name}")
    x, y = st.columns(2)
    x.download_button("Download JSON", report.to_json(), file_name="bench.json", mime="application/json")
    y.download_button("Download CSV", report.csv(), file_name="bench.csv", mime="text/csv")

st.subheader("Saved results")
files = st.file_uploader(
    "Load one or more JSON reports (from this page or `bench --out`): they join the figures at the top",
    type=["json"],
    accept_multiple_files=True,
)
rows, uploaded = [], []
for f in files or []:
    try:
        check_size_and_depth(f.getvalue())
        found = check_bench_rows(json.loads(f.getvalue()))
        rows += [{"file": f.name, **r} for r in found]
        uploaded.append((f.name, found))
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        st.error(f"{f.name}: {exc}")
if rows:
    table = pd.DataFrame(rows)
    keep = ["file", "label", "verifier", "throughput_tps", "throughput_std", "speedup", "tokens_per_iteration"]
    st.dataframe(table[[k for k in keep if k in table.columns]], hide_index=True, width="stretch")

with figures_box:
    shipped = shipped_bench()
    reports = [(r["name"], r["rows"]) for r in shipped]
    if "bench_report" in st.session_state:
        reports.append(("this session's run", json.loads(st.session_state["bench_report"][0].to_json())["results"]))
    reports += uploaded
    if reports:
        st.info(
            "**Shipped reports**: the out-of-distribution prompts 1-8, 128 new tokens, greedy, every run exact. "
            "Your runs and the reports you load below are drawn beside them.",
            icon=":material/insights:",
        )
        st.markdown("**Speedup by policy and machine** (over the faster of `ar` / HF `generate` in the same run)")
        st.plotly_chart(speedup_figure(reports), width="stretch", key="bench_speedup")
        left, right = st.columns(2)
        left.markdown("**Tokens per iteration against drafting's cost**")
        left.plotly_chart(draft_cost_figure(reports), width="stretch", key="bench_cost")
        split = next((r for r in shipped if r["file"] == SPLIT_REPORT), None)
        if split is not None:
            right.markdown(f"**Where a {split['name']} iteration's time goes**")
            right.plotly_chart(split_figure((split["name"], split["rows"])), width="stretch", key="bench_split")
        for r in shipped:  # each figure's sources: machine, date and command
            st.caption(f"**{r['name']}**: " + about(r["file"], r["environment"], r["date"], r["command"]))
