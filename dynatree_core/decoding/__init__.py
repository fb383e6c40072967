"""Decoding with a model pair: the draft -> verify -> commit loop (engine.py), what its verify
forward reads (batch.py), an iteration's timings (clock.py), the black-box
baselines (baselines.py), the catalogue of everything runnable by name (methods.py), loading a
pair and encoding prompts (pairs.py), the fastest correct dtype per pair (dtype_choice.py), and
the registry of run settings that a CLI flag and a page widget share (settings.py).

May import: errors, core, forward, runs, verify, drafts, drafting.
"""
