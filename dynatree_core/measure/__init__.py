"""Measuring decoding: a side-by-side comparison on one prompt (compare.py) of entries parsed
from specs (entries.py), benchmarks over prompt sets (bench.py, prompt_sets.py), the
verification lab's empirical law (lab.py), the dtype probe (dtype_probe.py), `gpu-check`
(gpu_check.py) with, for it, where a width-invariant tree run first leaves `ar`'s bits
(divergence.py), the device work an iteration launches outside its captured forwards, counted on
any device (launches.py), and a pair's latency profile (latency.py: the target's forwards and the
draft's levels, each timed on the engine's own path).

May import: errors, core, forward, runs, verify, drafts, drafting, decoding.
"""
