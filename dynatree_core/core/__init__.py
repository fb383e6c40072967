"""The machinery under every layer. Nothing here knows a policy, a verifier or a run.

- The draft tree and the reason behind each node (tree.py); sampling settings applied to both
  models (sampling_config.py); the hidden states a feature draft reads (taps.py).
- Forwards: one result type, `Forward` (forward.py, beside the HF reference forward); the one
  place that picks an implementation for a model, `choose_forward` (choice.py); the lean forward
  (fastpath.py), captured CUDA-graph forwards (graphs.py), the tensor work between forwards
  captured as steps (capture.py), forwards captured with the inputs they make on the device
  (filled.py) and width-invariant forwards (invariant.py; the same attention at fixed shapes, what
  a captured forward replays: static_rows.py); fused kernels for the lean forward on a GPU (Triton:
  kernels.py, its programs in triton_kernels.py); per-run KV caches that run the chosen forward and
  compact in place (kv.py) over the static cache's buffers, preallocated for the run (slots.py);
  how forwards run, as one settings object, and every environment override (settings.py).
- Models: loading them (models.py), the preset pairs (presets.py), the deployer's allow-list
  (specs.py), device and dtype names (devices.py), GGUF conversion (gguf.py), the hub probe
  (hub.py), the cache root (cache_dir.py), weights loaded whole and checkpoints written whole
  (weights.py), reduced-vocabulary drafts (vocab.py), pre-packed CPU linear layers (packing.py).
- Host-device copies and clocks (transfer.py), torch's thread count (threads.py), the server
  log (log.py).

May import: errors.
"""
