"""Training the drafts (`python -m dynatree_core.training`, stages recorded in ledger.py).

Data: prompts written for the project (prompts.py) and drawn from offline text (sources.py); the
target answers them in batches that keep its features (decode_batch.py, answers.py, data.py), as
fixed-length windows with the target's labels (corpus.py, answer_data.py, feature_data.py).
Losses: knowledge distillation from the target's top-k (train.py), the tree-aware loss TALF
(talf.py, feature_talf.py), the feature draft trained on the target's features (feature.py) and
unrolled over its own predictions (unrolled.py); what a checkpoint records so that only the same
run resumes it (resume.py). Then its measured quality (quality.py) and the shipped weights with
their model card (export.py).

May import: errors, core, runs, verify, drafts, drafting, decoding, measure.
"""
