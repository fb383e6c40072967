"""Rows per verify forward: queued from the device's rows (padded to a bound the host knows without
reading, decoding/batch.py) against the batch the host builds from the tree it read.

Decodes the embedded pair (its feature draft) on the first OOD prompts with the draft levels on the
device (`device_draft=True`, as on CUDA), once with the verify forward queued from the device's
rows and once with the host-built batch, and reports each policy's mean and largest forward width
(`IterationRecord.verify_rows`, the chain included) over the iterations that drafted. The trees
and tokens are the same both ways; only the rows sent differ. CPU or CUDA.

    PYTHONPATH=. .venv/bin/python -m benchmarks.verify_rows [--prompts 4] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks import RESULTS
from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.engine import DecodeConfig, decode
from dynatree_core.decoding.methods import make_method
from dynatree_core.decoding.pairs import encode_prompt, load_pair
from dynatree_core.measure.prompt_sets import load_prompts

POLICIES = ("fixed_tree", "dynatree", "dyspec_threshold", "linear", "delayed")


def widths(pair, prompts, policy: str, max_new: int, device_verify: bool) -> list[int]:
    """verify_rows of every drafting iteration of `policy` over `prompts`."""
    rows = []
    for prompt in prompts:
        ids = encode_prompt(pair.target.tokenizer, prompt.text, chat=prompt.chat, history=prompt.history)
        method = make_method(policy)
        config = DecodeConfig(
            max_new_tokens=max_new,
            eos_token_ids=pair.target.eos_token_ids,
            forward=ForwardSettings(device_draft=True, device_verify=device_verify),
        )
        records = decode(pair.target.model, ids, method, config=config, **pair.drafting(method))
        rows += [r.verify_rows for r in records if r.draft_forwards]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="the first N OOD prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(RESULTS / "cpu-verify-rows.json"))
    args = parser.parse_args(argv)
    pair = load_pair("embedded", device=args.device, dtype="float32")
    prompts = load_prompts("ood")[: args.prompts]
    report = {}
    for policy in POLICIES:
        report[policy] = {}
        for name, on in (("queued_from_device", True), ("host_batch", False)):
            rows = widths(pair, prompts, policy, args.max_new_tokens, on)
            report[policy][name] = {"mean": round(statistics.mean(rows), 2), "max": max(rows), "iterations": len(rows)}
        print(policy, json.dumps(report[policy]))
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args) | {"out": None}, "rows": report}, f, indent=1)


if __name__ == "__main__":
    main()
