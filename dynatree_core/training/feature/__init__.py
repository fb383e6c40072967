"""The feature draft's KD recipe (`train-feature`; `make draft-feature-stages`): the target's
features of the sampled corpus (labels.py; made smollm2-feature-draft-corpus) or of the answer
shards (answers/), EAGLE's KD through the one loop (train.py), agreement by tree depth (train.py,
depth.py), and the card any trained head ships with (card.py, `export-feature`)."""
