"""Lean forward ms, query heads folded (current) vs enable_gqa (before), run from the repo root:

    PYTHONPATH=. .venv/bin/python assets/benchmarks/gqa_fold.py

Embedded target, float32, packed, batch 1, context 256, widths 1..64; 2 alternating rounds of 7
forwards each (first dropped), medians.
"""

import statistics
import time
import types

import torch
import torch.nn.functional as F

from dynatree_core.core import fastpath
from dynatree_core.core.kv import KVState, chain_then_tree_visibility
from dynatree_core.decoding.pairs import load_pair

pair = load_pair("embedded", dtype="float32", need_draft=False)
model = pair.target.model
ctx = 256
prompt = [1 + i % 1000 for i in range(ctx)]
orig_fold, orig_mask, orig_F = fastpath.fold_groups, fastpath.fold_mask, fastpath.F
gqa_F = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})


def _gqa_sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


gqa_F.scaled_dot_product_attention = _gqa_sdpa


def variant(name):
    if name == "fold":
        fastpath.fold_groups, fastpath.fold_mask, fastpath.F = orig_fold, orig_mask, orig_F
    else:
        fastpath.fold_groups, fastpath.fold_mask, fastpath.F = (lambda q, g: q), (lambda m, g: m), gqa_F


@torch.inference_mode()
def time_width(width, reps=7):
    kv = KVState(model, prompt, capacity=ctx + 128)
    kv.forward(prompt, list(range(ctx)), chain_then_tree_visibility(0, ctx, torch.zeros(0, 0, dtype=torch.bool)), 1)
    kv.pending = []
    see = chain_then_tree_visibility(ctx, width, torch.zeros(0, 0, dtype=torch.bool))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        kv.forward([5] * width, list(range(ctx, ctx + width)), see, 1)
        out.append((time.perf_counter() - t0) * 1e3)
        kv.keep(list(range(ctx)))
    return statistics.median(out[1:])


for width in (1, 4, 16, 32, 64):
    res = {}
    for _ in range(2):
        for name in ("fold", "gqa"):
            variant(name)
            res.setdefault(name, []).append(time_width(width))
    fold, gqa = statistics.median(res["fold"]), statistics.median(res["gqa"])
    print(f"width {width}: folded {fold:.1f} ms, enable_gqa {gqa:.1f} ms", flush=True)
