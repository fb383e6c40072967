"""Runs that advance one iteration at a time, for the live page, built by composition: a `LiveRun`
(run.py) is a `RunState` (state.py: settings, records, token texts, where it was measured; its run
file is read and written by runs/run_file.py) driven by one backend per execution mode, behind one
small interface (run.Backend): `ThreadBackend` (thread_backend.py: the engine's generator in a
worker thread of this process) or `EngineBackend` (engine_backend.py: the run's commands to a
pair's engine; engine_run.EngineRun starts such a run). The engine itself is engine.py (the
parent side and the protocol), actor.py (the Ray actor it runs in, and where it is placed) and
engine_child.py (the actor's loop, one handler per command); jobs.py holds the one-off work it runs
for the pages, pool.py the resident engines of a server and their replicas.

May import: errors, core, forward, runs, verify, drafts, drafting, decoding, measure.
"""
