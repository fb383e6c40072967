"""Measuring decoding: a side-by-side comparison on one prompt (compare.py) of entries parsed
from specs (entries.py), benchmarks over prompt sets (bench.py, prompt_sets.py), the
verification lab's empirical law (lab.py), the dtype probe (dtype_probe.py) and `gpu-check`
(gpu_check.py).

May import: errors, core, runs, verify, drafts, drafting, decoding.
"""
