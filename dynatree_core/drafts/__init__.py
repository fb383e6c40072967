"""Draft models: the token draft's session (session.py) and the heads that read the target's own
hidden states (feature.py, fused.py), the published EAGLE layouts they load from and export to
(published.py), and the one door the engine opens them through (heads.py).

May import: errors, core, forward.
"""
