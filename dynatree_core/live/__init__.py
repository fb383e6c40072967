"""Runs that advance one iteration at a time, for the live page, built by composition: a `LiveRun`
(run.py) is a `RunState` (state.py: settings, records, token texts, where it was measured; its run
file is read and written by runs/run_file.py) driven by one backend per execution mode, behind one
small interface (run.Backend): `ThreadBackend` (thread_backend.py: the engine's generator in a
worker thread of this process) or `ProcessBackend` (process_backend.py: the run's commands to an
engine process; process_run.ProcessRun starts such a run). The engine process itself is
engine_process.py (the parent side and the protocol) and engine_child.py (the child's loop, one
handler per command); jobs.py holds the one-off work it runs for the pages, pool.py the resident
engines of a server.

May import: errors, core, forward, runs, verify, drafts, drafting, decoding, measure.
"""
