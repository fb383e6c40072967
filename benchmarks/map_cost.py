"""What a larger draft vocabulary costs per draft level, run from the repo root (nothing else
torch-heavy running):

    PYTHONPATH=. .venv/bin/python -m benchmarks.map_cost [--sizes 16384,24576,32768] [--rounds 2]

One process, the embedded target (float32, packed as `load_pair` ships it) and the shipped feature
draft's trained layer, with its head rebuilt over maps of each size (the shipped map, grown with the
most frequent answer tokens it lacks, `training/answers/windows.py`; which tokens does not change the
cost). For each size the engine's own records give `draft_forward_ms / draft_forwards` (prefill
iteration excluded), fixed_tree defaults, "Why is the sky blue?" (chat), 64 tokens; rounds
alternate the sizes (this host drifts). The target's one-token step (median verify time of an
`ar` run) is the unit.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from dynatree_core.core.packing import pack_linears
from dynatree_core.core.presets import EMBEDDED_FEATURE_DRAFT_DIR
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.pairs import encode_prompt, load_pair
from dynatree_core.drafting.policy import make_policy
from dynatree_core.drafts.feature import FeatureDraft


def grown(base: TokenMap, size: int, counts: np.ndarray | None) -> TokenMap:
    have = [int(t) for t in base.draft_to_target[1:].tolist()]
    seen = set(have)
    order = np.argsort(-counts) if counts is not None else np.arange(base.target_vocab)
    extra = [int(t) for t in order if int(t) not in seen][: max(size - 1 - len(have), 0)]
    return TokenMap([-1, *have[: size - 1], *extra], base.target_vocab)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16384,24576,32768")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    pair = load_pair("embedded", dtype="float32")
    target, tok = pair.target, pair.target.tokenizer
    shipped = FeatureDraft.load(EMBEDDED_FEATURE_DRAFT_DIR, target.model)
    counts = None
    try:
        from dynatree_core.training.answers.commands import answer_dirs
        from dynatree_core.training.answers.store import AnswerStore
        from dynatree_core.training.answers.windows import token_counts

        counts = token_counts(AnswerStore(*answer_dirs("embedded")), shipped.token_map.target_vocab)
    except Exception:  # noqa: BLE001 - no answers here: grow by id order (same cost)
        counts = None
    drafts = {}
    for size in [int(s) for s in args.sizes.split(",")]:
        draft = FeatureDraft.from_target(target.model, grown(shipped.token_map, size, counts))
        draft.fc.load_state_dict(shipped.fc.state_dict())
        draft.lm.model.layers.load_state_dict(shipped.lm.model.layers.state_dict())
        pack_linears(draft)
        drafts[size] = draft
    ids = encode_prompt(tok, "Why is the sky blue?", chat=True)
    config = DecodeConfig(max_new_tokens=64, eos_token_ids=frozenset())
    with torch.inference_mode():
        ar = generate(target.model, ids, make_policy("ar"), config=config)
    step_ms = statistics.median(r.verify_ms for r in ar.records[1:])
    print(f"target 1-token step {step_ms:.1f} ms")
    for rnd in range(args.rounds):
        for size, draft in drafts.items():
            run = generate(target.model, ids, make_policy("fixed_tree"), draft=draft, config=config)
            recs = [r for r in run.records[1:] if r.draft_forwards]
            level = sum(r.draft_forward_ms for r in recs) / max(sum(r.draft_forwards for r in recs), 1)
            print(
                f"round {rnd}: map {size}: draft level {level:.2f} ms = {level / step_ms:.3f} x a target step; "
                f"{run.tokens_per_iteration:.2f} tokens / iteration",
                flush=True,
            )


if __name__ == "__main__":
    main()
