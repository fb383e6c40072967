"""The packed recipe (`train-packed`; `make draft-feature-long`, `-final`; ships
smollm2-feature-draft and smollm2-fused-draft): answer windows packed into rows with the compact
teacher (data.py), the cheap step for either head kind, unrolled over tree levels (step.py), and
the long resumable schedule through the one loop (train.py)."""
