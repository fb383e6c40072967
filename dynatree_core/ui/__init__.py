"""The Streamlit pieces of the app and its pages, and the only package that imports Streamlit:
process-wide resources such as loaded pairs and engine processes (resources.py), the widgets
built from the registries (widgets.py), the opening replay (replay.py), the live page's
sections (live_view.py) and its analysis sections, drawn when a run pauses or finishes
(analysis_view.py).

May import: errors, core, forward, runs, verify, drafts, drafting, decoding, measure, live, viz, training.
"""
