"""The Streamlit front page renders and builds its widgets from the policy registry."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest


def test_front_page_renders_with_policy_sliders():
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    assert at.title[0].value.endswith("DynaTree Explorer")
    labels = {s.label for s in at.slider}
    assert {"depth", "branch", "budget"} <= labels, labels
    next(s for s in at.selectbox if s.label == "Policy").set_value("linear").run()
    assert "k" in {s.label for s in at.slider}


@pytest.mark.slow
def test_one_step_with_the_embedded_pair_draws_a_tree_and_a_mask():
    import json

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=300)
    at.run()
    next(b for b in at.button if "Step" in b.label).click().run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    tree = next(c for c in charts if any(t.get("name") == "root" for t in c["data"]))
    nodes = sum(len(t["customdata"]) for t in tree["data"] if t.get("mode") == "markers+text")
    assert nodes >= 2  # root + bonus at least; every drafted node once
    assert any(t["type"] == "heatmap" for c in charts for t in c["data"])
    assert at.metric[0].label == "Tokens / iteration"
