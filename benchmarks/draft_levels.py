"""Cost of one draft level in the decoding loop: token draft vs feature draft, run from
the repo root:

    PYTHONPATH=. .venv/bin/python -m benchmarks.draft_levels [--rounds 2] [--max-new-tokens 64]

One process, the embedded target (float32, packed as `load_pair` ships it); for each draft the
engine's own records give `draft_forward_ms / draft_forwards` (the prefill iteration excluded),
fixed_tree defaults on "Why is the sky blue?" (chat template). Drafts: the shipped token draft,
the shipped feature draft packed (the default path), the same unpacked, and the same in
bfloat16. Rounds alternate the drafts (this host drifts). The target's one-token step is the
median verify time of an `ar` run in the same process. Prints one line per draft and round.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from dynatree_core.core.threads import configure_threads
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.pairs import encode_prompt, load_pair
from dynatree_core.drafting import make_policy


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    configure_threads()
    token_pair = load_pair()
    target = token_pair.target
    feature = load_pair("embedded", "assets/models/smollm2-feature-draft").draft.model  # packed
    unpacked = load_pair("embedded", "assets/models/smollm2-feature-draft", pack=False).draft.model
    bf16 = copy.deepcopy(unpacked).to(torch.bfloat16)
    drafts = {
        "token (shipped)": (token_pair.draft.model, token_pair.draft.token_map),
        "feature, packed float32 (shipped path)": (feature, None),
        "feature, unpacked float32": (unpacked, None),
        "feature, bfloat16": (bf16, None),
    }
    ids = encode_prompt(target.tokenizer, "Why is the sky blue?", chat=True)
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids)
    ar = generate(target.model, ids, make_policy("ar"), config=config)
    print(f"target one-token step: {statistics.median(r.verify_ms for r in ar.records[1:]):.2f} ms")
    for rnd in range(args.rounds):
        for name, (draft, token_map) in drafts.items():
            run = generate(
                target.model, ids, make_policy("fixed_tree"), draft=draft, config=config, draft_token_map=token_map
            )
            recs = [r for r in run.records if r.draft_forwards]
            level = sum(r.draft_forward_ms for r in recs) / max(1, sum(r.draft_forwards for r in recs))
            print(
                f"round {rnd + 1} {name}: {level:.2f} ms per level, {run.tokens_per_iteration:.2f} tokens/iteration, "
                f"exact {run.token_ids == ar.token_ids}"
            )


if __name__ == "__main__":
    main()
