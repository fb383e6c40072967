"""The answer data every head recipe trains on (`make draft-feature-stages`, `-long`): offline
sources (sources.py), the target answering them in batches that keep its features
(decode_batch.py; its forward, sampling and compact teacher: decode_ops.py; store.py),
human-written text as assistant turns (written.py), the answer shards read as training windows,
with the reduced vocabulary rebuilt from them (windows.py), and the prompt pack: every offline
source's passages under several instructions, in one file for a GPU machine (passages.py,
pack.py)."""
