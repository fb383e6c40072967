"""The files and functions one decoding iteration passes through: what a reader of the engine must
follow, counted by tracing the calls, not by reading.

Decodes one OOD prompt with the embedded pair (its feature draft) on this device's defaults and
traces the calls into dynatree_core during one iteration after the first few (the prefill-only
first iteration and the draft's first levels are not typical). A function (properties included;
comprehensions and lambdas are parts of theirs) counts once however often it runs; `record`
lists the calls that only build the iteration's record (runs/), which the engine's work does not
need. Writes the list so a change to the engine's heart can be read as a diff of it.

    PYTHONPATH=. .venv/bin/python -m benchmarks.iteration_path [--policy fixed_tree] [--iteration 4]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

from benchmarks import RESULTS
from dynatree_core.decoding.engine import DecodeConfig, iterate, start_run
from dynatree_core.decoding.methods import make_method
from dynatree_core.decoding.pairs import encode_prompt, load_pair
from dynatree_core.measure.prompt_sets import load_prompts

PACKAGE = Path(__file__).resolve().parent.parent / "dynatree_core"
RECORD_ONLY = ("runs/",)  # building the record: not the engine's work


def traced(step) -> list[tuple[str, str]]:
    """(file relative to dynatree_core, qualified name) of every dynatree_core function `step()`
    calls, directly or not, in first-call order."""
    seen: dict[tuple[str, str], None] = {}
    root = str(PACKAGE) + "/"

    def profile(frame, event, arg):
        code = frame.f_code  # comprehensions and lambdas are parts of a function, not functions to follow
        if event == "call" and code.co_filename.startswith(root) and not code.co_name.startswith("<"):
            seen.setdefault((code.co_filename.removeprefix(root), code.co_qualname), None)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return list(seen)


def iteration_calls(pair, ids: list[int], policy: str, iteration: int) -> list[tuple[str, str]]:
    """The calls of iteration `iteration` (counted from 1) of a greedy run of `policy`."""
    method = make_method(policy)
    config = DecodeConfig(max_new_tokens=4 * iteration + 16, eos_token_ids=frozenset())
    state = start_run(pair.target.model, ids, method, config=config, **pair.drafting(method))
    records = iterate(state)
    for _ in range(iteration - 1):
        next(records)
    return traced(lambda: next(records))


def summary(calls: list[tuple[str, str]]) -> dict:
    work = [c for c in calls if not c[0].startswith(RECORD_ONLY)]
    by_file = collections.Counter(f for f, _ in work)
    return {
        "files": len(by_file),
        "functions": len(work),
        "record_functions": len(calls) - len(work),
        "by_file": dict(by_file.most_common()),
        "calls": [f"{f}:{name}" for f, name in calls],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="fixed_tree")
    parser.add_argument("--iteration", type=int, default=4, help="the traced iteration, counted from 1")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", help="default: assets/benchmarks/cpu-iteration-path.json")
    args = parser.parse_args(argv)
    pair = load_pair("embedded", device=args.device, dtype=args.dtype)
    prompt = load_prompts("ood")[0]
    ids = encode_prompt(pair.target.tokenizer, prompt.text, chat=prompt.chat, history=prompt.history)
    with torch.inference_mode():
        result = summary(iteration_calls(pair, ids, args.policy, args.iteration))
    files, functions, record = result["files"], result["functions"], result["record_functions"]
    print(f"{args.policy}: {files} files, {functions} functions (+{record} for the record)")
    for name, n in result["by_file"].items():
        print(f"  {n:3d}  {name}")
    out = Path(args.out or RESULTS / "cpu-iteration-path.json")
    out.write_text(json.dumps({"settings": vars(args) | {"out": None}, **result}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
