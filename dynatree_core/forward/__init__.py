"""How a model's forward runs: rows in (ids, positions, which keys each row sees), logits out.

Nothing here knows a tree, a policy or a verifier: the engine and the drafts hand in rows and
read a `Forward` back. README.md beside this file walks one forward on a CPU first, then what a
GPU adds.

- The result type and the reference (HF) forward (reference.py); the one place that picks an
  implementation for a model (choice.py); a run's cache and its forward entry (kv.py) over the
  static cache's buffers (slots.py).
- The lean forward of Llama-family models (fastpath.py) and its fused GPU kernels (kernels.py,
  the Triton programs in triton_kernels.py); width-invariant attention (invariant.py) and the
  same at fixed shapes (static_rows.py).
- What a GPU adds: forwards captured as CUDA graphs at padded, bucketed shapes (graphs.py), the
  tensor work between forwards captured as steps (capture.py) and forwards captured with the
  inputs the device makes for them (filled.py).

May import: errors, core.
"""
