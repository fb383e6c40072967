"""Where a greedy iteration's time goes, per policy: draft / verify / commit / outside ms an
iteration, tokens an iteration and draft forwards an iteration, from the engine's own records.

The embedded pair at this device's defaults, greedy, the first N OOD prompts (chat template),
`--max-new-tokens` each. Prints one JSON line. To compare two versions of the code, run it from
each checkout in turn, alternating (this host drifts):

    PYTHONPATH=. .venv/bin/python -m benchmarks.iteration_split [--policies fixed_tree,dynatree] [--prompts 6]
"""

from __future__ import annotations

import argparse
import json

from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.decoding.pairs import encode_prompt, load_pair
from dynatree_core.measure.prompt_sets import load_prompts

POLICIES = "fixed_tree,dynatree,dyspec_threshold,eagle2,delayed,linear"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--prompts", type=int, default=6, help="the first N OOD prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    pair = load_pair()
    prompts = load_prompts("ood")[: args.prompts]
    ids = [encode_prompt(pair.target.tokenizer, p.text, chat=p.chat, history=p.history) for p in prompts]
    out = {}
    for policy in args.policies.split(","):
        total = dict.fromkeys(("draft", "verify", "commit", "outside", "iterations", "tokens", "draft_forwards"), 0.0)
        for prompt_ids in ids:
            method = make_method(policy)
            r = generate(
                pair.target.model, prompt_ids, method, config=DecodeConfig(args.max_new_tokens), **pair.drafting(method)
            )
            for key, value in (("draft", r.draft_ms), ("verify", r.verify_ms), ("commit", r.commit_ms)):
                total[key] += value
            total["outside"] += r.overhead_ms
            total["iterations"] += r.iterations
            total["tokens"] += r.new_tokens
            total["draft_forwards"] += r.draft_forwards
        n = total.pop("iterations")
        out[policy] = {f"{k}_per_iteration": round(v / n, 3) for k, v in total.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
