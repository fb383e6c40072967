"""Launches per iteration outside the forwards, by where a tree's levels, verify batch and the
steps between forwards run: what a GPU pays per kernel, counted without one (measure/launches.py).

Decodes the embedded pair (its feature draft) on the first OOD prompts at fixed shapes (`--graphs`:
the padded forward a GPU captures, one launch a forward) for `ar` and each policy with a device
path, three ways: levels and verify batch on the host (`host`: the CPU default's drafting, one
read per level), on the device with the steps between forwards run op by op (`device_eager`), and
captured as one graph a step (`device_steps`: CUDA's default; stand-in graphs here). Counts ops
that launch work (views and allocations excluded) and replays, per iteration; on a CPU host and
device ops are one count. The tokens are the same every way (checked).

    PYTHONPATH=. .venv/bin/python -m benchmarks.launches [--prompts 2] [--max-new-tokens 48] [--dtype bfloat16]

`--admit-kernel`: the draft levels' admission as its one Triton kernel (drafting/admission.py),
as a GPU takes it; on a CPU in Triton's interpreter (TRITON_INTERPRET=1 before the command).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from benchmarks import RESULTS
from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.decoding.pairs import encode_prompt, load_pair
from dynatree_core.drafting import admission
from dynatree_core.measure.launches import per_iteration
from dynatree_core.measure.prompt_sets import load_prompts

POLICIES = ("fixed_tree", "dynatree", "dyspec_threshold", "linear", "eagle2", "delayed")
WAYS = {
    "host": (False, True),
    "device_eager": (True, False),
    "device_steps": (True, True),
}  # device path, steps captured


def counted(pair, ids, policy: str, max_new: int, on_device: bool, steps: bool) -> tuple[dict, list[int]]:
    method = make_method(policy)
    forward = ForwardSettings(graphs=True, step_graphs=steps, device_draft=on_device, device_verify=on_device)
    config = DecodeConfig(max_new_tokens=max_new, eos_token_ids=pair.target.eos_token_ids, forward=forward)
    out = {}

    def run():
        out["result"] = generate(pair.target.model, ids, method, config=config, **pair.drafting(method))
        return out["result"]

    counts = per_iteration(run, torch.device(pair.target.model.device.type), top=6)
    return counts, out["result"].token_ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, help="the first N OOD prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="bfloat16: width-invariant target forwards"
    )
    parser.add_argument("--admit-kernel", action="store_true", help="the levels' admission as one Triton kernel")
    parser.add_argument("--out", help="default: assets/benchmarks/cpu-launches[-bfloat16][-admit-kernel].json")
    args = parser.parse_args(argv)
    name = f"cpu-launches{'' if args.dtype == 'float32' else '-' + args.dtype}{'-admit-kernel' * args.admit_kernel}"
    args.out = args.out or str(RESULTS / f"{name}.json")
    if args.admit_kernel and not admission.available():
        parser.error("--admit-kernel needs Triton (on a CPU its interpreter: TRITON_INTERPRET=1 before the command)")
    with admission.admit_kernel_on(args.device) if args.admit_kernel else contextlib.nullcontext():
        count_all(args)


def count_all(args) -> None:
    pair = load_pair("embedded", device=args.device, dtype=args.dtype)
    prompts = load_prompts("ood")[: args.prompts]
    encoded = [encode_prompt(pair.target.tokenizer, p.text, chat=p.chat, history=p.history) for p in prompts]
    report = {}
    for policy in ("ar", *POLICIES):
        report[policy] = {}
        for way, (on_device, steps) in WAYS.items():
            runs = [counted(pair, ids, policy, args.max_new_tokens, on_device, steps) for ids in encoded]
            report[policy][way] = {
                k: round(sum(c[k] for c, _ in runs) / len(runs), 1) for k in ("ops", "host_ops", "replays")
            }
            report[policy][way]["sites"] = runs[0][0]["sites"]
            report[policy][way]["tokens"] = [tokens for _, tokens in runs]
            if policy == "ar":
                break
        tokens = {way: r.pop("tokens") for way, r in report[policy].items()}
        report[policy]["same_tokens"] = len({json.dumps(t) for t in tokens.values()}) == 1
        print(policy, json.dumps({w: (r["ops"], r["replays"]) for w, r in report[policy].items() if w in WAYS}))
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args) | {"out": None}, "launches": report}, f, indent=1)


if __name__ == "__main__":
    main()
