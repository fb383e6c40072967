"""The token draft's recipe (`make draft`; ships assets/models/smollm2-draft): the target samples
on-policy text (sample.py), windows of it and offline text with the target's top-k labels
(corpus.py), KD through the one loop (train.py), its quality (quality.py); its export and card are training/card.py."""
