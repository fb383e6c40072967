"""The live page's sections (Streamlit): the metrics row, the draft tree beside the attention
mask with its node panel, the stage controls and `render`, which places them for one run (with
the analysis sections of analysis_view.py). app.py keeps the inputs and starts runs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import streamlit as st

from dynatree_core.live.engine_run import EngineRun
from dynatree_core.live.run import LiveRun
from dynatree_core.runs.metrics import exactness_note
from dynatree_core.runs.records import IterationRecord
from dynatree_core.ui.analysis_view import ar_reference, verification_view, why_view
from dynatree_core.ui.resources import threads_caption
from dynatree_core.viz import (
    clicked_node,
    mask_figure,
    node_details,
    order_block_counts,
    run_charts,
    salf_mass_figure,
    stop_text,
    text_html,
    tree_figure,
)
from dynatree_core.viz.prose import explain_iteration, glossary
from dynatree_core.viz.stages import Stage, iteration_stages, slot_figure, stage_caption, stage_categories
from dynatree_core.viz.svg import figure_svg
from dynatree_core.viz.tree import TREE_HEIGHT_PX

# The engine decodes in its own process, a Ray actor (or a worker thread); the page draws its latest iteration
# at most this often. Three figures per page update: one update every 0.6 s keeps the browser near
# 5 figure updates per second. A browser on the same machine draws on the same CPU cores (its cost
# per figure update: BENCHMARKS.md, "The live page against the CLI"), which is why the app leaves it a core.
RENDER_INTERVAL_S = 0.6
TEXT_TAIL_TOKENS = 120  # a running page draws this much text: its drawing cost stays flat as the run grows
STAGE_PLAY_S = 1.2  # Play stages: seconds per stage


def frame_metrics(run: LiveRun, shown: int, *, finished: bool) -> None:
    """The metrics of iterations 1..`shown` (the iteration on show), saying whether that is the
    whole run; then how the run ended (once it has) and where it was measured."""
    n = len(run.records)
    whole = shown == n
    if whole:
        scope = f"Whole run so far: {n} iterations." if not finished else f"Whole run: {n} iterations."
    else:
        scope = f"Iterations 1-{shown} of {n} (up to the one on show)."
    st.caption(f"**{scope}**")
    metrics_row(run.result(upto=shown), "Tokens / s (engine time)")
    if finished:
        st.info(stop_text(run.records[-1].stop), icon=":material/flag:")
    st.caption(measured_caption(run))


def metrics_row(result, tps_label: str) -> None:
    m = st.columns(5)
    m[0].metric("Tokens / iteration", f"{result.tokens_per_iteration:.2f}")
    m[1].metric("Acceptance", f"{result.acceptance_rate:.0%}")
    m[2].metric(tps_label, f"{result.throughput_tps:.1f}")
    m[3].metric("Iterations", result.iterations)
    m[4].metric("New tokens", result.new_tokens)


def node_panel(rec: IterationRecord, node: int | None, decode: Callable[[int], str]) -> None:
    if node is None:
        st.caption("Click a node for its path as text and the target's prediction there.")
        return
    try:
        details = node_details(rec, node, decode)
    except ValueError:  # a stale selection from another tree
        return
    st.markdown(
        "**Selected node**\n\n" + "\n".join(f"- **{k}**: `{v.replace('`', 'ˋ')}`" for k, v in details.items()),
    )


def measured_caption(run: LiveRun) -> str:
    """Where and how the run's throughput was measured."""
    if run.imported:
        threads = f", {run.threads} torch thread{'s' if run.threads != 1 else ''}" if run.threads else ""
        return f"Measured on {run.device}, {run.dtype}, from engine time{threads}: an imported run, measured elsewhere."
    kind = f" with the {run.draft_kind} draft" if run.draft_kind else ""
    where = (
        f"in its own process ({threads_caption(run.threads)})"
        if isinstance(run, EngineRun)
        else f"in a thread of the page's process ({threads_caption()})"
    )
    path = run.records[-1].forward_path if run.records else ""
    note = exactness_note(run.dtype, path)
    if "capture failed" in path:  # the GPU fallback: the run goes on without graphs, and says so
        note = f"{note} Forwards: {path}." if note else f"Forwards: {path}."
    return (
        f"Measured on {run.device}, {run.dtype}, from engine time (drawing excluded): the engine decodes{kind} {where} "
        f"and the page draws its latest iteration every {RENDER_INTERVAL_S} s." + (f" {note}" if note else "")
    )


def stage_control(rec: IterationRecord, running: bool) -> Stage | None:
    """The stage of the iteration to show (None: the outcome, as while decoding), and Play."""
    stages = iteration_stages(rec)
    if running or len(stages) < 2:
        return None
    labels = [s.label for s in stages]
    key = f"stage_{rec.index}"
    playing = st.session_state.get("stage_play")
    if playing is not None and playing[0] == rec.index:  # Play: one stage per rerun
        st.session_state[key] = labels[min(playing[1], len(labels) - 1)]
    if st.session_state.get(key) not in labels:
        st.session_state[key] = labels[-1]
    left, right = st.columns([3, 1])
    with right:
        st.button(
            "Play stages",
            icon=":material/play_arrow:",
            help="Step through this iteration's stages.",
            on_click=_start_play,
            args=(rec.index, key, labels[0]),
        )
    with left:
        label = st.select_slider("Stage", labels, key=key, help=STAGE_HELP)
    return stages[labels.index(label)]


STAGE_HELP = "The iteration as it stood after each step: the draft grows level by level, then verification and commit."


def _start_play(index: int, key: str, first: str) -> None:
    st.session_state.stage_play = (index, 0)
    st.session_state[key] = first


def _advance_play(rec: IterationRecord) -> None:
    playing = st.session_state.get("stage_play")
    if playing is None or playing[0] != rec.index:
        return
    if playing[1] + 1 >= len(iteration_stages(rec)):
        st.session_state.stage_play = None
        return
    st.session_state.stage_play = (rec.index, playing[1] + 1)
    time.sleep(STAGE_PLAY_S)
    st.rerun()


# The tree's picture and its chart stacked in one grid cell, the picture on top until the chart shows
# its node markers: Streamlit loads plotly's code (~4.7 MB) when the first chart arrives, and the
# chart is an empty box until then (seconds on a slow machine), then hidden until it has its size
# (the `visibility` style). Only the browser knows when the chart is drawn, so CSS swaps them (`:has`,
# Chromium 105+, Firefox 121+, Safari 15.4+). Charts of earlier iterations (other keys) stay in the
# box, hidden: Streamlit marks them `data-retained`.
DRAWN_CHART = (
    "> [data-testid=stElementContainer]:not([data-retained]) [data-testid=stPlotlyChart] "
    ".js-plotly-plot:not([style*=visibility]) .scatterlayer .point"
)
TREE_VIEW_CSS = f"""<style>
.st-key-tree_view {{ display: grid; grid-template-columns: minmax(0, 1fr); }}
.st-key-tree_view > * {{ grid-area: 1 / 1; }}
.st-key-tree_view > :has([data-testid=stImage]) {{ z-index: 1; }}
.st-key-tree_view [data-testid=stImage] img {{ max-height: {TREE_HEIGHT_PX}px; width: auto; max-width: 100%; }}
.st-key-tree_view:has({DRAWN_CHART}) > :has([data-testid=stImage]) {{ display: none; }}
</style>"""


def tree_and_mask(
    run: LiveRun, rec: IterationRecord, stage: Stage | None = None, poster: bool = False, running: bool = False
) -> None:
    """One iteration's draft tree (clickable) beside the attention mask the target received; at a
    `stage`, both as they stood after it (the mask once it is built), and the cache at commit.
    The tree is drawn twice in one box: as a picture (static SVG, viz/svg.py) and as the clickable
    chart, which hides the picture once it has drawn its nodes (TREE_VIEW_CSS).
    `poster`: the picture alone, drawn before the browser has loaded plotly.
    `running`: the chart alone, under one key and not selectable until the run stops. (Streamlit
    1.67 still mounts a new chart whenever the figure changes: its element id includes the figure's
    spec, `key_as_main_identity=False` in st.plotly_chart.)"""
    if stage is not None:
        st.markdown(stage_caption(rec, stage, run.text))
    left, right = st.columns([3, 2])
    with left:
        st.markdown(f"##### Draft tree — iteration {rec.index}")
        chart_key = "tree_running" if running else f"tree_{rec.index}"  # one selection per iteration
        selected = None if running else clicked_node(st.session_state.get(chart_key))
        staged = (
            {}
            if stage is None
            else dict(categories=stage_categories(rec, stage), bonus=stage.kind in ("bonus", "commit"))
        )
        figure = tree_figure(rec, run.text, selected=selected, **staged)
        with st.container(key="tree_view"):  # the picture and the chart share one box (TREE_VIEW_CSS)
            if not running:
                st.image(figure_svg(figure), width="stretch", alt=f"Draft tree of iteration {rec.index}")
            if not poster:
                st.plotly_chart(
                    figure,
                    width="stretch",
                    key=chart_key,
                    **({} if running else dict(on_select="rerun", selection_mode="points")),
                )
        st.html(TREE_VIEW_CSS)
        if running:
            st.caption("Click a node once the run pauses or finishes, for its path and the target's prediction.")
        else:
            node_panel(rec, selected, run.text)
    with right:
        if stage is not None and stage.kind in ("draft", "prune"):
            st.markdown("##### Attention mask")
            st.caption("Built once drafting and pruning are over: one row per verified node, seeing its ancestors.")
        else:
            st.markdown("##### Attention mask sent to the target")
            if poster:
                st.caption("Drawn in a moment, with the rest of the page.")
            else:
                st.plotly_chart(mask_figure(rec, run.text), width="stretch", key="mask")
        counts = order_block_counts(rec.tree)
        st.caption(
            f"{len(rec.order)} nodes (root first), positions {rec.position_ids[0]}..{max(rec.position_ids)}; "
            f"non-zero 32x32 blocks: BFS {counts['bfs']}, DFS {counts['dfs']}"
        )
    if poster:  # no chart yet: plotly's code (~4.7 MB) would hold back the whole first drawing
        return
    if stage is not None and stage.kind == "commit":
        st.caption("The target's cache slots this forward wrote, and what commit kept")
        st.plotly_chart(slot_figure(rec, run.text), width="stretch", key="slots")
    if rec.tree.notes.get("salf_mass"):
        st.caption("SALF: probability mass of each drafting step's batch; drafting stops below th.")
        st.plotly_chart(salf_mass_figure(rec.tree.notes["salf_mass"], float(run.params.get("th", 0))), key="salf")


def render(run: LiveRun | None, running: bool = False, poster: bool = False, replaying: bool = False) -> None:
    """The run's latest (or scrubbed-to) iteration: the iteration and stage controls, then the tree
    beside the mask (the first screen), then the metrics of the iterations up to the one on show.
    `running`: its worker is decoding, so the page draws only what changes each iteration (metrics,
    tree, mask, text, charts); the verification trace, the speed analysis and the export (which
    serialises every record) wait until the run pauses or finishes: every drawing costs the engine
    CPU time and, in Python, the GIL. `poster`: the page's first drawings: the tree as an SVG image
    and no chart or table, whose browser code (plotly's is ~4.7 MB) would hold the page back for
    seconds on a slow machine. `replaying`: the opening replay is playing (more frames follow),
    so the run is not presented as finished yet."""
    if run is None or not run.records:
        st.info(
            "Decoding the first iteration..."
            if running
            else "Press **Run** to decode live, or **Step** for one iteration at a time."
        )
        return
    running = running and not run.done  # the worker may end between its flag and the snapshot: drawn finished
    n = len(run.records)
    st.session_state.setdefault(f"scrub_{n}", n)  # the last iteration, unless a replay or the user moved it
    scrub, stages = st.columns([2, 3])
    with scrub:
        pick = (
            st.slider("Iteration", 1, n, key=f"scrub_{n}", help="Go back to any iteration's tree and mask.")
            if n > 1
            else 1
        )
    rec = run.records[pick - 1]
    with stages:
        stage = stage_control(rec, running)
    tree_and_mask(run, rec, stage, poster, running)
    frame_metrics(run, pick, finished=run.done and not replaying)
    with st.expander("What happened in this iteration (draft → verify → commit)"):
        st.markdown(explain_iteration(rec, run.text, run.verifier()))
    if poster:  # no chart or table yet: the browser draws this before it loads their code
        st.subheader("Generated text")
        st.html(text_html(run.records, run.text))
        return
    verification_view(run, rec, running)
    with st.expander("Glossary of tree terms"):
        st.markdown(glossary())
    st.subheader("Generated text")
    if running:
        st.caption(f"While decoding: at most the last {TEXT_TAIL_TOKENS} tokens; all of it once the run stops.")
    st.html(text_html(run.records, run.text, tail=TEXT_TAIL_TOKENS if running else None))
    ref_key = json.dumps({k: v for k, v in run.settings.items() if k not in ("policy", "params", "order")})
    if st.button(
        "Measure AR reference",
        disabled=running,
        help="Decode the same prompt with the target alone (our loop and HF generate with a static cache), "
        "for the speedup over the faster"
        + (" (after the run pauses or finishes: both would share the cores)." if running else "."),
    ):
        ar_reference(run, ref_key)
    ar_tps = st.session_state.setdefault("ar_tps", {}).get(ref_key)
    if ar_tps:
        refs = st.session_state.get("ar_refs", {}).get(ref_key, {})
        each = ", ".join(f"{name} {tps:.1f} ({path})" for name, (tps, path) in refs.items())
        st.caption(
            f"AR reference: {ar_tps:.1f} tokens/s, the faster of {each or 'ar'}, on the same prompt, device and dtype."
        )
    st.plotly_chart(run_charts(run.records, ar_tps), width="stretch", key="charts")
    why_view(run, ar_tps, running)
    if running:
        return
    _advance_play(rec)
    st.download_button(
        "Export run (JSON)",
        run.to_json,  # built on click (a sampled run's draws make it megabytes), not on every rerun
        file_name="dynatree-run.json",
        mime="application/json",
        help="Every iteration's record, settings and token texts; Import replays it here.",
    )
