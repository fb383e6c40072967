"""The machinery under every layer. Nothing here knows a policy, a verifier or a run.

- The draft tree and the reason behind each node (tree.py); sampling settings applied to both
  models (sampling_config.py); the hidden states a feature draft reads (taps.py).
- How forwards run, as one settings object, and every environment override (settings.py); the
  forward machinery itself is the next layer up (dynatree_core/forward/).
- Models: loading them (models.py), the preset pairs (presets.py), the deployer's allow-list
  (specs.py), device and dtype names (devices.py), GGUF conversion (gguf.py), the hub probe
  (hub.py), the cache root (cache_dir.py), weights loaded whole and checkpoints written whole
  (weights.py), reduced-vocabulary drafts (vocab.py), pre-packed CPU linear layers (packing.py).
- Host-device copies and clocks (transfer.py), torch's thread count (threads.py), the server
  log (log.py).

May import: errors.
"""
