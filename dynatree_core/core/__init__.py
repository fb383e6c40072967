"""The machinery under every layer: the draft tree and the reason behind each node (tree.py),
sampling settings applied to both models (sampling_config.py), host-device copies and clocks
(transfer.py), loading models (models.py), weights loaded whole and checkpoints written whole
(weights.py), reduced-vocabulary drafts (vocab.py), torch's thread count (threads.py), per-run KV
caches and tree-masked forwards (kv.py), the lean forward (fastpath.py), captured CUDA-graph
forwards (graphs.py), pre-packed CPU linear layers (packing.py) and the server log (log.py).
Nothing here knows a policy, a verifier or a run.

May import: errors.
"""
