"""Kernels one target forward launches, by the form its lean forward takes: the CPU's (transformers'
RMSNorm, the target's projections separate) and the GPU's (one fused RMSNorm kernel, q/k/v and
gate/up fused, the residual adds inside the o and down GEMMs and the rotation's add in one addcmul:
forward/fastpath.py's device_forms). On a GPU a
small model's forward is launch-bound (docs/gpu.md): a captured forward's time follows
its kernel count, which needs no GPU to count (every op torch dispatches, views and allocations
excluded, conversions and strided copies counted: measure/launches.py's rule). The embedded
target, unpacked (a GPU does not pack), a 1-row and a 16-row forward, with shared kernels and
with width-invariant rows at fixed shapes (static_rows.StaticRows, bfloat16's exact path on a GPU);
the logits of both forms are compared too.
The rotation's new form is the CPU's default too: its time on this CPU against transformers'
(`rotation_us`, q and k of one layer, the median of 5 rounds of 2,000 calls).

    PYTHONPATH=. .venv/bin/python -m benchmarks.forward_kernels [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels form runs Triton here in its interpreter (before torch)

import torch  # noqa: E402

from benchmarks import RESULTS  # noqa: E402
from dynatree_core.decoding.pairs import load_pair  # noqa: E402
from dynatree_core.forward import fastpath, kernels  # noqa: E402
from dynatree_core.forward.fastpath import _rotate, rope_pair  # noqa: E402
from dynatree_core.forward.kv import KVState  # noqa: E402
from dynatree_core.forward.rows import Rows  # noqa: E402
from dynatree_core.measure.launches import OpNames  # noqa: E402

FORMS = ("cpu", "gpu", "gpu+kernels")  # the last: with Triton's kernels (forward/kernels.py)


def forward_ops(model, prompt: list[int], rows: int, invariant: bool) -> tuple[Counter, torch.Tensor]:
    """The second `rows`-row forward after the prompt's prefill (chains of `rows` tokens; the
    first made the fixed-shape buffers): its ops by name, and its last row's logits."""
    ids = min(500, model.config.vocab_size - 10)  # token ids 10 .. 10 + ids
    kv = KVState(model, prompt, invariant=invariant, graphs=True if invariant else None)
    kv.run(Rows.chain(prompt, 0))
    for start in (len(prompt), len(prompt) + rows):
        kv.pending = []
        tokens = [(7 * i + start) % ids + 10 for i in range(rows)]
        batch = Rows.chain(tokens, start)
        with OpNames() as ops:
            logits = kv.run(batch).logits
    return ops.names, logits[-1].float()


def _rotation_us(model, rows: int) -> dict[str, float]:
    """Microseconds for one layer's q and k rotation: transformers' apply_rotary_pos_emb against
    _rotate over rope_pair's signed sin (made once per forward, so not timed)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lean = fastpath.LeanForward(model)
    block, dtype = lean.blocks[0], model.dtype
    cos, sin = lean.rotary(torch.zeros(1, rows, 1, dtype=dtype), torch.arange(rows)[None])
    q = torch.randn(1, block.heads, rows, block.head_dim).to(dtype)
    k = torch.randn(1, block.qk_heads - block.heads, rows, block.head_dim).to(dtype)
    pair = rope_pair(cos, sin)
    ways = {
        "transformers": lambda: apply_rotary_pos_emb(q, k, cos[:, None], sin[:, None]),
        "roll": lambda: (_rotate(q, *pair), _rotate(k, *pair)),
    }
    out = {}
    for name, fn in ways.items():
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                fn()
            rounds.append((time.perf_counter() - t0) / 2000 * 1e6)
        out[name] = round(statistics.median(rounds), 2)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", help="default: assets/benchmarks/cpu-forward-kernels[-bfloat16].json")
    args = parser.parse_args(argv)
    out = args.out or str(RESULTS / f"cpu-forward-kernels{'' if args.dtype == 'float32' else '-' + args.dtype}.json")
    prompt = [(13 * i) % 900 + 5 for i in range(40)]
    report: dict = {"dtype": args.dtype, "rows": {}}
    logits = {}
    with torch.inference_mode():
        for form in FORMS:
            gpu = fastpath.device_forms("cuda", on="cpu") if form != "cpu" else contextlib.nullcontext()
            # the interpreter runs a program at a time: one block of keys (the count is the same)
            fused = kernels.kernel_forms("cpu", block_keys=1024) if form == "gpu+kernels" else contextlib.nullcontext()
            with gpu, fused:
                model = load_pair("embedded", device="cpu", dtype=args.dtype, need_draft=False, pack=False).target.model
                if form == "cpu":
                    report["rotation_us"] = {f"{rows} rows": _rotation_us(model, rows) for rows in (1, 16)}
                for invariant in (False, True):
                    for rows in (1, 16):
                        names, last = forward_ops(model, prompt, rows, invariant)
                        key = f"{'invariant' if invariant else 'shared'} {rows} row{'s' if rows > 1 else ''}"
                        ops = sum(names.values())
                        report["rows"].setdefault(key, {})[form] = {"ops": ops, "by_op": dict(names.most_common(12))}
                        logits[form, key] = last
    print(f"| {args.dtype} forward | CPU form ops | GPU form ops | with Triton's kernels | max logit difference |")
    print("|---|---|---|---|---|")
    for key, forms in report["rows"].items():
        diff = max((logits["cpu", key] - logits[form, key]).abs().max().item() for form in FORMS[1:])
        forms["max_logit_difference"] = diff
        cpu, gpu, fused = (forms[form]["ops"] for form in FORMS)
        print(f"| {key} | {cpu} | {gpu} | {fused} | {diff:.3g} |")
    print(f"rotation, one layer's q and k (us): {report['rotation_us']}")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"report: {out}")


if __name__ == "__main__":
    main()
