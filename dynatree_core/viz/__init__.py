"""Figures as pure functions of records (no Streamlit here), by subject:

  tree.py      the draft tree (tidy layout, node categories and colours, source rings, the clickable figure)
  node.py      a clicked node's details as text
  mask.py      the attention mask the target received; block counts by node order
  runs.py      a run: text, running charts, SALF mass, verification rows, acceptance by depth, speed
  compare.py   the compare page's figures
  bench.py     benchmark sweeps, saved reports, the latency profile; writing figures to files
  prose.py     the words beside them (why a run is faster or not, why it stopped)
  stages.py    one iteration, stage by stage: the tree, the mask and the cache after each step
  svg.py       a plotly scatter figure as a static SVG string: the live page's first drawing

The analysis the figures draw (acceptance by depth, the speed breakdown) lives in runs/metrics.py;
this package re-exports it with the figures.

May import: errors, core, forward, runs, verify, drafts, drafting, decoding, measure.
"""

from __future__ import annotations

from dynatree_core.runs.metrics import acceptance_by_depth, acceptance_by_source, speed_breakdown
from dynatree_core.viz.compare import compare_figures
from dynatree_core.viz.mask import block_count, mask_figure, order_block_counts
from dynatree_core.viz.node import clicked_node, node_details
from dynatree_core.viz.prose import STOP_TEXT, stop_text, why_text
from dynatree_core.viz.runs import (
    acceptance_figure,
    first_token_figure,
    run_charts,
    salf_mass_figure,
    text_html,
    verification_rows,
    why_figure,
)
from dynatree_core.viz.tree import (
    BONUS,
    COLOURS,
    PRUNED_SYMBOLS,
    fitting_labels,
    legend_html,
    node_categories,
    tidy_layout,
    tree_figure,
    visible,
)

__all__ = [
    "first_token_figure",
    "BONUS",
    "COLOURS",
    "PRUNED_SYMBOLS",
    "STOP_TEXT",
    "acceptance_by_depth",
    "acceptance_by_source",
    "acceptance_figure",
    "block_count",
    "clicked_node",
    "compare_figures",
    "fitting_labels",
    "legend_html",
    "mask_figure",
    "node_categories",
    "node_details",
    "order_block_counts",
    "run_charts",
    "salf_mass_figure",
    "speed_breakdown",
    "stop_text",
    "text_html",
    "tidy_layout",
    "tree_figure",
    "verification_rows",
    "visible",
    "why_figure",
    "why_text",
]
