"""Where a decoding run's host time goes, function by function: cProfile over `generate()` of one
policy on the first N OOD prompts (the embedded pair, this device's defaults, greedy), after one
unprofiled pass over the same prompts. Prints the wall time and the top functions by own time;
the model GEMMs (`mkldnn._linear_pointwise` on a CPU) show apart from the engine's own work, so
two checkouts' runs can tell a slower host from slower code:

    PYTHONPATH=. .venv/bin/python -m benchmarks.decode_profile [--policy linear] [--prompts 3]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.decoding.pairs import encode_prompt, load_pair
from dynatree_core.measure.prompt_sets import load_prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="linear")
    parser.add_argument("--prompts", type=int, default=3, help="the first N OOD prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=25, help="functions listed")
    args = parser.parse_args(argv)
    pair = load_pair()
    prompts = load_prompts("ood")[: args.prompts]
    ids = [encode_prompt(pair.target.tokenizer, p.text, chat=p.chat, history=p.history) for p in prompts]
    method = make_method(args.policy)

    def run() -> None:
        for prompt in ids:
            config = DecodeConfig(max_new_tokens=args.max_new_tokens)
            generate(pair.target.model, prompt, method, config=config, **pair.drafting(method))

    run()  # warm-up: caches, packed weights
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    run()
    profile.disable()
    print(f"wall {time.perf_counter() - start:.3f} s")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
