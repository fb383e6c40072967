"""Runs that advance one iteration at a time, for the live page: `LiveRun` decoding in this
process (run.py), `ProcessRun`, the same run decoded by an engine process (process_run.py), and
the engine process itself (engine_process.py).

May import: errors, core, runs, verify, drafts, drafting, decoding, measure.
"""
