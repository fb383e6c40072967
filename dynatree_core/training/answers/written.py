"""`answers-written` (`make draft-feature-long`): human-written text as training data, teacher-forced.

The answer stages (store.py) cost one target decode step per token. Text people wrote (the
Python documentation, the standard library's code, manual pages, fortunes: what sources.py
already reads offline) costs one target forward per window instead. Each item becomes one chat
exchange, a short user request for that kind of text and the text itself as the assistant's
turn, so the target's states are those of an assistant answering (EAGLE-1 and EAGLE-3 train on
fixed dataset responses the same way). The loss positions are the assistant turn's; the draft
still learns the target's own next-token distribution there (the compact teacher of
`answers-relabel --teacher`), never the written text's next token.

The sequences are stored as stage "written" of the answer store (ids committed, features and
teacher recomputed by `answers-relabel --stages written`), with their own source kinds
("written-pydoc", ...). Every source is one the prompt pool reads, so the OOD prompt set stays
disjoint from the training data by source.
"""

from __future__ import annotations

import random

import numpy as np

from dynatree_core.decoding.pairs import encode_prompt
from dynatree_core.training.answers import sources
from dynatree_core.training.answers.store import SHARD_JOBS, AnswerStore
from dynatree_core.training.prompts import DATA

STAGE = "written"
SIZES = {"pydoc": 3000, "stdlib": 2000, "manpages": 2500, "fortunes": 3000}  # items per source (~1.2M tokens)
ASK = DATA["written_ask"]  # assets/draft-data/prompts.json


def written_items(seed: int = 0, sizes: dict[str, int] | None = None, log=print) -> list[tuple[str, str, str]]:
    """(source kind, user request, written text) per item, shuffled with `seed`; a source whose
    text is missing on this machine contributes nothing, and the log says so."""
    want = SIZES | (sizes or {})
    rng = random.Random(seed)
    texts = {
        "pydoc": [("", t) for t in sources.doc_passages()],
        "stdlib": [("", f"```python\n{t}\n```") for t in sources.stdlib_snippets()],
        "manpages": sources.man_descriptions(),
        "fortunes": [("", t) for t in sources.fortunes()],
    }
    items = []
    for source, found in texts.items():
        chosen = rng.sample(found, min(want[source], len(found)))
        log(f"written: {source}: {len(found)} texts, {len(chosen)} used")
        items += [(f"written-{source}", rng.choice(ASK[source]).format(name=name), text) for name, text in chosen]
    rng.shuffle(items)
    return items


def encode_written(tokenizer, ask: str, text: str, end: int) -> tuple[list[int], int]:
    """(ids, prompt length): the chat prompt for `ask`, then `text` as the assistant's turn, closed
    by the end-of-turn id `end`. The text is tokenized as text (control strings stay characters)."""
    prompt = encode_prompt(tokenizer, ask, chat=True)
    body = tokenizer(text.replace("\x00", ""), add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return prompt + list(body) + [end], len(prompt)


def write_written(store: AnswerStore, tokenizer, end: int, vocab: int, *, seed: int = 0, sizes=None, log=print) -> int:
    """The stage's id shards (SHARD_JOBS sequences each), the missing ones only; returns how many
    were written. The same machine files and seed give the same shards."""
    items = written_items(seed, sizes, log)
    have = set(store.shards(STAGE))
    written = 0
    for k in range(0, (len(items) + SHARD_JOBS - 1) // SHARD_JOBS):
        if k in have:
            continue
        part = items[k * SHARD_JOBS : (k + 1) * SHARD_JOBS]
        seqs = [encode_written(tokenizer, ask, text, end) for _, ask, text in part]
        store.write_ids(
            STAGE, k, seqs, [source for source, _, _ in part], np.full(len(part), np.nan, dtype=np.float16), vocab
        )
        tokens = sum(len(ids) - plen for ids, plen in seqs)
        log(f"written: shard {k}: {len(seqs)} texts, {tokens} assistant-turn tokens")
        written += 1
    return written
