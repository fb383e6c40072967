"""The Streamlit front page renders and builds its widgets from the policy registry."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest


def test_front_page_renders_with_policy_sliders():
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    assert at.title[0].value.endswith("DynaTree Explorer")
    labels = {s.label for s in at.slider}
    assert {"depth", "branch", "budget"} <= labels, labels
    at.selectbox[0].set_value("linear").run()
    assert "k" in {s.label for s in at.slider}
