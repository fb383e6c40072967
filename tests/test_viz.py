"""viz: layout, node categories, figure contents (pure functions, no models)."""

from __future__ import annotations

import math

import pytest
from conftest import ancestor_mask

from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.runs.records import IterationRecord
from dynatree_core.viz import (
    BONUS,
    COLOURS,
    block_count,
    clicked_node,
    mask_figure,
    node_categories,
    node_details,
    salf_mass_figure,
    tidy_layout,
    tree_figure,
)


def sample_record() -> IterationRecord:
    """root -> a(.6) -> c -> e ; a -> d ; root -> b(.3) -> f ; b -> g (pruned: threshold).
    Accepted a, c; bonus token 99."""
    t = DraftTree.with_root(10)
    t.mark_expanded(0)
    a = t.add(0, 11, math.log(0.6))
    b = t.add(0, 12, math.log(0.3))
    t.mark_expanded(a)
    t.mark_expanded(b)
    c = t.add(a, 13, math.log(0.7))
    t.add(a, 14, math.log(0.2))
    t.mark_expanded(c)
    t.add(c, 15, math.log(0.5))
    t.add(b, 16, math.log(0.5))
    g = t.add(b, 17, math.log(0.01))
    t.prune(g, Reason.THRESHOLD)
    order = t.order("bfs")
    mask = ["".join("1" if v else "0" for v in row) for row in ancestor_mask(t, order).tolist()]
    return IterationRecord(
        index=1,
        tree=t,
        order=order,
        mask=mask,
        position_ids=t.position_ids(order, 5),
        prefix_len=5,
        chain_len=1,
        accepted=[a, c],
        bonus_token=99,
        committed=[11, 13, 99],
        target_tokens=[11 if n == 0 else 13 if n == a else 99 if n == c else 0 for n in order],
        draft_forwards=3,
        draft_ms=1.0,
        verify_ms=2.0,
        commit_ms=0.1,
        overhead_ms=0.1,
        memory_mb=1.0,
    )


def test_layout_centres_parents_and_orders_leaves():
    kids = {0: [1, 2], 1: [3, 4, 5], 2: [6]}
    pos = tidy_layout(kids)
    assert [pos[n][0] for n in (3, 4, 5, 6)] == [0, 1, 2, 3]  # leaves left to right in child order
    for parent, children in kids.items():
        assert pos[parent][0] == pytest.approx((pos[children[0]][0] + pos[children[-1]][0]) / 2)
        assert all(pos[c][1] == pos[parent][1] + 1 for c in children)
    deep = {i: [i + 1] for i in range(5000)}  # no recursion limit
    assert tidy_layout(deep)[5000] == (0.0, 5000)


def test_categories_follow_verification():
    rec = sample_record()
    cats = node_categories(rec)
    assert cats == {
        0: "root",
        1: "accepted",
        2: "rejected",  # sibling of an accepted node
        3: "accepted",
        4: "rejected",
        5: "rejected",  # child of the last accepted node: the bonus won instead
        6: "unreached",  # below a rejected node
        7: "pruned",
    }


def test_tree_figure_has_every_node_once_and_colours_by_category():
    rec = sample_record()
    fig = tree_figure(rec, decode=lambda t: f" t{t}\n")
    markers = [tr for tr in fig.data if tr.mode == "markers+text"]
    ids = sorted(row[0] for tr in markers for row in tr.customdata)
    assert ids == sorted([*range(len(rec.tree)), BONUS])
    for tr in markers:
        assert tr.marker.color == COLOURS[tr.name.split(":")[0]]
    by_name = {tr.name: tr for tr in markers}
    assert by_name["pruned: threshold"].marker.symbol == ("x",)  # one legend entry per pruning reason
    assert [row[0] for row in by_name["accepted"].customdata] == [1, 3]
    assert "␣t11⏎" in by_name["accepted"].text
    assert "threshold" in by_name["pruned: threshold"].hovertext[0]
    path = next(tr for tr in fig.data if tr.name == "accepted path")
    assert sum(v is None for v in path.x) == 3  # root-a, a-c, c-bonus
    edges = fig.data[0]
    assert sum(v is None for v in edges.x) == 5  # the other tree edges
    assert fig.to_json()  # serialisable for st.plotly_chart


def test_mask_figure_and_block_counts():
    rec = sample_record()
    fig = mask_figure(rec)
    z = fig.data[0].z
    assert len(z) == len(rec.order) == 7  # verified nodes only
    assert all(row[0] == 1 for row in z)  # the collapsed prefix column
    assert sum(map(sum, z)) == len(z) + sum(row.count("1") for row in rec.mask)
    assert block_count(rec.mask) == 1
    big = ["1" * 40] * 40
    assert block_count(big) == 4
    assert block_count(["1" + "0" * 39] * 40) == 2


def test_text_marks_accepted_and_bonus_tokens_and_escapes_html():
    from dynatree_core.viz import text_html

    rec = sample_record()
    out = text_html([rec, rec], decode=lambda t: {11: "<a>", 13: " b", 99: "\n"}[t])
    assert out.count("iteration 1: accepted") == 4 and out.count("iteration 1: bonus") == 2
    assert "&lt;a&gt;" in out and "<a>" not in out
    assert "⏎<br>" in out


def test_text_tail_keeps_the_last_iterations_and_counts_the_rest():
    from dataclasses import replace

    from dynatree_core.viz import text_html

    recs = [replace(sample_record(), index=i) for i in range(1, 6)]  # 3 tokens committed each
    decode = {11: "x", 13: "y", 99: "z"}.get
    out = text_html(recs, decode=decode, tail=4)  # 4 tokens need the last two iterations
    assert "… 9 earlier tokens (3 iterations) …" in out
    assert "iteration 3:" not in out and out.count("iteration 4:") == 3 and out.count("iteration 5:") == 3
    assert text_html(recs, decode=decode, tail=100) == text_html(recs, decode=decode)  # short: all of it


def test_run_charts_series():
    from dynatree_core.viz import run_charts

    rec = sample_record()
    fig = run_charts([rec, rec])
    assert list(fig.data[0].y) == [3, 3]  # tokens committed per iteration
    assert list(fig.data[1].y) == pytest.approx([2 / 6, 2 / 6])  # 2 accepted of 6 drafted
    assert fig.data[2].y[-1] == pytest.approx(1000 * 6 / (2 * rec.wall_ms))
    assert run_charts([rec], ar_tps=fig.data[2].y[0]).data[2].y[0] == pytest.approx(1.0)
    assert [tr.name for tr in fig.data[3:]] == ["draft", "verify", "commit", "overhead"]


def test_dfs_order_packs_two_long_chains_into_fewer_blocks():
    from dynatree_core.viz import order_block_counts

    t = DraftTree.with_root(0)
    for start in (1, 2):
        node = 0
        for i in range(100):
            node = t.add(node, start * 100 + i, math.log(0.9 if start == 1 else 0.5))
    counts = order_block_counts(t)
    assert counts["dfs"] < counts["bfs"], counts


def test_node_details_path_and_target_predictions():
    rec = sample_record()
    word = {10: "The", 11: " cat", 12: " dog", 13: " sat", 14: " ran", 15: " on", 17: " xyz", 99: " down"}

    def decode(t):
        return word.get(t, f"<{t}>")

    rejected = node_details(rec, 5, decode)  # c -> " on" (rejected: the target chose the bonus)
    assert rejected["path"].startswith("␣cat␣sat␣on") and "after the root The" in rejected["path"]
    assert rejected["status"].startswith("rejected")
    assert rejected["target at the parent"] == "␣down (not this node)"
    accepted = node_details(rec, 1, decode)
    assert accepted["target at the parent"] == "␣cat (same as this node)"
    assert accepted["target after this node"] == "␣sat" and accepted["draft p"] == "0.6000"
    pruned = node_details(rec, 7, decode)
    assert "threshold" in pruned["status"] and "not computed" in pruned["target after this node"]
    bonus = node_details(rec, BONUS, decode)
    assert bonus["path"].startswith("␣cat␣sat␣down") and bonus["status"].startswith("bonus")
    assert node_details(rec, 0, decode)["path"].startswith("(the root itself)")
    with pytest.raises(ValueError, match="no node"):
        node_details(rec, 42, decode)


def test_clicked_node_reads_the_selection_event():
    assert clicked_node(None) is None
    assert clicked_node({"selection": {"points": []}}) is None
    assert clicked_node({"selection": {"points": [{"x": 1.0}]}}) is None  # an edge: no customdata
    assert clicked_node({"selection": {"points": [{"customdata": [BONUS, None, None, 2]}]}}) == BONUS
    assert clicked_node({"selection": {"points": [{"customdata": [3, 0.5, 0.2, 2]}]}}) == 3


def test_salf_mass_figure_marks_the_step_below_threshold():
    fig = salf_mass_figure([1.0, 0.8, 0.4], th=0.6)
    bar = fig.data[0]
    assert list(bar.y) == [1.0, 0.8, 0.4]
    assert list(bar.marker.color) == [COLOURS["accepted"], COLOURS["accepted"], COLOURS["rejected"]]


def test_speed_breakdown_is_the_iteration_arithmetic():
    from dynatree_core.viz import speed_breakdown, why_text

    records = [sample_record(), sample_record()]
    for r, (draft, verify) in zip(records, ((10.0, 30.0), (20.0, 50.0)), strict=True):
        r.draft_ms, r.verify_ms, r.commit_ms, r.overhead_ms, r.draft_forwards = draft, verify, 1.0, 1.0, 3
    b = speed_breakdown(records, step_ms=40.0)
    tpi = sum(len(r.committed) for r in records) / 2
    assert b["iteration_ms"] == 15.0 + 40.0 + 2.0 and b["draft_forwards"] == 3
    assert b["expected_speedup"] == pytest.approx(tpi * 40.0 / 57.0)
    assert b["break_even_tokens"] == pytest.approx(57.0 / 40.0) and b["verify_vs_step"] == 1.0
    text = why_text(b)
    assert f"{tpi:.2f}" in text and f"{57.0 / 40.0:.2f}" in text  # commits, break-even
    slow = speed_breakdown(records, step_ms=10.0)  # verification 4x a step, drafting 26%: advice
    assert "smaller node budget" in why_text(slow) and slow["expected_speedup"] < 1
    assert "Measure the latency profile" in why_text(speed_breakdown(records))
    assert speed_breakdown([]) == {}


def test_the_static_tree_draws_every_node_edge_label_and_legend_entry_of_the_plotly_tree():
    """The first drawing of the page (viz/svg.py) is the same tree as the interactive chart: one
    marker per node of each marker trace, the edges, the labels (escaped) and the legend."""
    import re

    from dynatree_core.live.run import LiveRun
    from dynatree_core.ui.replay import REPLAY_FILE
    from dynatree_core.viz import tree_figure
    from dynatree_core.viz.svg import figure_svg

    run = LiveRun.from_json(REPLAY_FILE.read_bytes())
    for rec in run.records[:3]:
        last = rec.tree.tokens[-1]
        fig = tree_figure(rec, lambda t, last=last: "<&>" if t == last else run.text(t))
        svg = figure_svg(fig)
        markers = sum(len(t.x) for t in fig.data if "markers" in t.mode)
        legend = [t.name for t in fig.data if t.name and t.showlegend is not False and "markers" in t.mode]
        shapes = len(re.findall(r"<circle |<rect |<polygon ", svg))
        assert shapes == markers + len(legend), (shapes, markers, legend)
        assert svg.count("<path ") == sum(1 for t in fig.data if "lines" in t.mode and len(t.x or ()) > 1)
        assert "&lt;&amp;&gt;" in svg and "<&>" not in svg
        assert all(f">{name}</text>" in svg for name in legend)


def test_a_compact_tree_has_no_legend_and_labels_only_the_tokens_that_fit():
    """The compare page's small multiples: one legend for the row (legend_html), so none per tree;
    a token whose label would overlap a neighbour's is left to the hover, at every width."""
    from dynatree_core.viz import fitting_labels, legend_html

    rec = sample_record()
    decode = lambda t: f"token{t}"  # noqa: E731  eight characters: a wide label
    wide, narrow = (tree_figure(rec, decode, compact_px=px) for px in (2000, 120))
    for fig in (wide, narrow):
        markers = [tr for tr in fig.data if tr.mode == "markers+text"]
        assert all(tr.showlegend is False for tr in fig.data), "no legend in a small multiple"
        assert sorted(r[0] for tr in markers for r in tr.customdata) == sorted([*range(len(rec.tree)), BONUS])
        hovers = {row[0]: h for tr in markers for h, row in zip(tr.hovertext, tr.customdata, strict=True)}
        assert all(f"token{rec.tree.tokens[n]}" in hovers[n] for n in range(len(rec.tree))), "every token in the hover"
    labels = lambda fig: [x for tr in fig.data if tr.mode == "markers+text" for x in tr.text]  # noqa: E731
    assert all(labels(wide)), "2000 px: every label fits"
    assert "" in labels(narrow) and any(labels(narrow)), "120 px: some labels go to the hover, not all"
    pos = {0: (0.0, 0), 1: (0.0, 1), 2: (1.0, 1), 3: (10.0, 1)}
    fits = fitting_labels(pos, lambda n: "abcd", 60 + 100)  # 10 px per x unit; labels 34 px wide
    assert fits == {0, 3}, "1 and 2 sit 10 px apart: neither label fits; 3 is far from both"
    html = legend_html()
    assert all(COLOURS[c] in html for c in ("root", "accepted", "bonus", "rejected", "unreached", "pruned"))


def _replay_figures(widths=(None,)):
    """Tree figures of the recorded run (assets/replay/) as the live page draws them: every
    iteration's outcome and every stage of its last iteration."""
    from dynatree_core.live.run import LiveRun
    from dynatree_core.ui.replay import REPLAY_FILE
    from dynatree_core.viz.stages import iteration_stages, stage_categories

    run = LiveRun.from_json(REPLAY_FILE.read_bytes())
    figures = [tree_figure(rec, run.text) for rec in run.records]
    rec = run.records[-1]
    for stage in iteration_stages(rec):
        cats = stage_categories(rec, stage)
        figures.append(tree_figure(rec, run.text, categories=cats, bonus=stage.kind in ("bonus", "commit")))
    return [*figures, tree_figure(sample_record())]


def test_the_tree_legend_stands_above_the_plotting_area_so_it_covers_no_node():
    """A horizontal legend anchored by its bottom edge above the plotting area (plotly widens the
    top margin for the rows it wraps into), on an autoranged depth axis: every node lies inside
    the area, the legend outside it, for any tree and any chart width."""
    for fig in _replay_figures():
        legend, yaxis = fig.layout.legend, fig.layout.yaxis
        assert legend.orientation == "h" and legend.yanchor == "bottom" and legend.y >= 1, legend
        assert legend.yref in (None, "paper") and fig.layout.margin.autoexpand is not False
        assert yaxis.range is None and yaxis.autorange in (None, True), "the axis spans every node"


def _svg_boxes(svg: str) -> tuple[list[tuple[float, float, float, float]], list[tuple[float, float, float, float]]]:
    """(node boxes, legend entry boxes) of a figure_svg picture, as (left, top, right, bottom)."""
    import xml.etree.ElementTree as ET

    ns = "{http://www.w3.org/2000/svg}"
    root = ET.fromstring(svg)
    legend = root.find(f"{ns}g[@class='legend']")
    nodes = []
    for el in root.iter():
        if el.get("class") != "node":
            continue
        if el.tag == f"{ns}circle":
            x, y, r = (float(el.get(k)) for k in ("cx", "cy", "r"))
            nodes.append((x - r, y - r, x + r, y + r))
        elif el.tag == f"{ns}rect":
            x, y, w, h = (float(el.get(k)) for k in ("x", "y", "width", "height"))
            nodes.append((x, y, x + w, y + h))
        else:
            xy = [tuple(map(float, p.split(","))) for p in el.get("points").split()]
            nodes.append((min(p[0] for p in xy), min(p[1] for p in xy), max(p[0] for p in xy), max(p[1] for p in xy)))
    entries = []
    for text in legend.iter(f"{ns}text"):  # the entry's dot sits 14 px left of its name; 12 px font
        x, y = float(text.get("x")), float(text.get("y"))
        entries.append((x - 14, y - 12, x + 7 * len(text.text), y + 4))
    return nodes, entries


def test_the_tree_picture_wraps_its_legend_above_every_node_at_any_width():
    """The picture drawn before plotly has loaded (viz/svg.py): its legend wraps into rows inside
    the picture's width, and every node marker lies below the legend's last row."""
    import plotly.graph_objects as go

    from dynatree_core.viz.svg import figure_svg

    many = go.Figure()  # more legend entries than one row holds at 300 px
    for i in range(8):
        many.add_trace(go.Scatter(x=[i], y=[-(i % 3)], mode="markers", name=f"pruned: reason {i}"))
    many.update_layout(height=420)
    for fig in [*_replay_figures(), many]:
        for width in (300, 720):
            nodes, entries = _svg_boxes(figure_svg(fig, width=width))
            assert nodes and entries
            legend_bottom = max(e[3] for e in entries)
            assert all(n[1] > legend_bottom for n in nodes), "a node drawn under the legend"
            for top in {e[1] for e in entries}:  # a row of two or more ends inside the picture
                row = [e for e in entries if e[1] == top]
                assert len(row) == 1 or max(e[2] for e in row) <= width, f"a legend row runs off {width} px"
    rows = {e[1] for e in _svg_boxes(figure_svg(many, width=300))[1]}
    assert len(rows) > 2, "eight long entries take several rows at 300 px"


def test_nodes_from_other_sources_wear_a_ring_with_a_legend_entry_and_say_where_they_came_from():
    """A joined tree marks its recycled and retrieved nodes (a ring per source, one legend entry
    each, in the interactive chart, its static picture and the compact row's legend); the hover
    and a clicked node's details name the source; a model-only tree draws no ring."""
    from dynatree_core.viz import legend_html, node_details, tree_figure
    from dynatree_core.viz.svg import figure_svg

    rec = sample_record()
    assert not [t for t in tree_figure(rec).data if (t.name or "").startswith("source")]
    rec.tree.sources = {2: "retrieved", 5: "recycled", 6: "retrieved"}
    fig = tree_figure(rec, str)
    rings = {t.name: len(t.x) for t in fig.data if (t.name or "").startswith("source")}
    assert rings == {"source: recycled": 1, "source: retrieved": 2}
    hovers = [h for t in fig.data if t.hovertext for h in t.hovertext]
    assert any("source retrieved" in h for h in hovers) and any("source model" in h for h in hovers)
    assert "source: retrieved</text>" in figure_svg(fig)
    assert node_details(rec, 2, str)["source"].startswith("retrieved")
    assert node_details(rec, 1, str)["source"] == "the draft model"
    assert "recycled" in legend_html(sources=True) and "recycled" not in legend_html()
