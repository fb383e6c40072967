"""The project's own prompt material, read from `assets/draft-data/prompts.json` (data, not code).

Serves `make draft` (gen-data's on-policy prompts) and the answers of `make draft-feature`
(answers/sources.py's requests, answers/written.py's). Prompts are built from topics x templates
so the set is large and diverse without being a dataset download: chat instructions (the embedded
target is an instruct model) and plain-text openings (encyclopedic, narrative, code, lists).
`sample_prompts` is deterministic per seed.
"""

from __future__ import annotations

import json
import random

from dynatree_core.core.presets import REPO_ROOT

PROMPTS_FILE = REPO_ROOT / "assets" / "draft-data" / "prompts.json"
DATA: dict = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))
TOPICS: list[str] = DATA["topics"]


def sample_prompts(n: int, seed: int) -> list[tuple[str, bool]]:
    """Return n (text, is_chat) prompts; about 60% chat, 10% code chat, 30% plain text."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t, u = rng.sample(TOPICS, 2)
        r = rng.random()
        if r < 0.6:
            out.append((rng.choice(DATA["chat_templates"]).format(t=t, u=u), True))
        elif r < 0.7:
            out.append((rng.choice(DATA["code_chat"]), True))
        elif r < 0.93:
            text = rng.choice(DATA["plain_openings"]).format(t=t, T=t[0].upper() + t[1:])
            out.append((text, False))
        else:
            out.append((rng.choice(DATA["plain_code"]), False))
    return out
