"""Lean forward ms, query heads folded (current) vs enable_gqa (before), run from the repo root:

    PYTHONPATH=. .venv/bin/python -m benchmarks.gqa_fold

Embedded target, float32, packed, batch 1, context 256, widths 1..64; 2 alternating rounds of 7
forwards each (first dropped), medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
import torch.nn.functional as F

from dynatree_core.decoding.pairs import load_pair
from dynatree_core.forward import fastpath
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows

CONTEXT = 256
WIDTHS = (1, 4, 16, 32, 64)
ORIGINAL = (fastpath.fold_groups, fastpath.fold_mask, fastpath.F)


def _gqa_sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


def _gqa_functional() -> types.SimpleNamespace:
    """torch.nn.functional with scaled_dot_product_attention called with enable_gqa=True."""
    gqa_f = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    gqa_f.scaled_dot_product_attention = _gqa_sdpa
    return gqa_f


def variant(name: str, gqa_f: types.SimpleNamespace) -> None:
    """Patch fastpath to the folded path (`fold`, the current code) or the enable_gqa one."""
    if name == "fold":
        fastpath.fold_groups, fastpath.fold_mask, fastpath.F = ORIGINAL
    else:
        fastpath.fold_groups, fastpath.fold_mask, fastpath.F = (lambda q, g: q), (lambda m, g: m), gqa_f


@torch.inference_mode()
def time_width(model, prompt: list[int], width: int, reps: int = 7) -> float:
    ctx = len(prompt)
    kv = KVState(model, prompt, capacity=ctx + 128)
    kv.run(Rows.chain(prompt, 0))
    kv.pending = []
    rows = Rows.chain([5] * width, ctx)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        kv.run(rows)
        out.append((time.perf_counter() - t0) * 1e3)
        kv.keep(list(range(ctx)))
    return statistics.median(out[1:])


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    model = load_pair("embedded", dtype="float32", need_draft=False).target.model
    prompt = [1 + i % 1000 for i in range(CONTEXT)]
    gqa_f = _gqa_functional()
    try:
        for width in WIDTHS:
            res: dict[str, list[float]] = {}
            for _ in range(2):
                for name in ("fold", "gqa"):
                    variant(name, gqa_f)
                    res.setdefault(name, []).append(time_width(model, prompt, width))
            fold, gqa = statistics.median(res["fold"]), statistics.median(res["gqa"])
            print(f"width {width}: folded {fold:.1f} ms, enable_gqa {gqa:.1f} ms", flush=True)
    finally:
        variant("fold", gqa_f)


if __name__ == "__main__":
    main()
