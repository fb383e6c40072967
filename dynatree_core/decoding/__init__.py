"""Decoding with a model pair: the draft -> verify -> commit loop (engine.py), the black-box
baselines (baselines.py), the catalogue of everything runnable by name (methods.py), loading a
pair and encoding prompts (pairs.py), and the fastest correct dtype per pair (dtype_choice.py).

May import: errors, core, runs, verify, drafts, drafting.
"""
