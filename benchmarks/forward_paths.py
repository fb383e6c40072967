"""One cached forward on each forward path, in ONE process, run from the repo root:

    PYTHONPATH=. .venv/bin/python -m benchmarks.forward_paths [--widths 1,4,8,16] [--context 128]
        [--repeats 60] [--out assets/benchmarks/cpu-forward-paths.json]

For the embedded pair (float32, packed linears, the CLI's thread count) it times a forward over
`width` new tokens with `context` tokens cached, through kv.KVState exactly as the engine calls
it, on the three paths: `lean` (static cache + lean forward, the default), `static` (static
cache, stock HF forward) and `dynamic` (transformers' DynamicCache, the reference). Paths are
interleaved width by width, so their ratios come from the same minutes of this shared machine.
Prints median and minimum ms per point and writes them as JSON.

What it does not show: inside the decoding loop every draft level runs right after the target's
forward has streamed ~500 MB of weights through the caches, so the draft's first level reads its
weights from DRAM; the per-level cost the engine records (`draft_forward_ms / draft_forwards`) is
therefore higher than these back-to-back timings (docs/benchmark-log.md, "Live at engine speed").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import RESULTS
from dynatree_core.core.threads import configure_threads
from dynatree_core.decoding.pairs import load_pair
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows

PATHS = {"lean": (True, True), "static": (True, False), "dynamic": (False, False)}  # (static, fast)


@torch.inference_mode()
def time_forward(model, context: int, width: int, repeats: int, static: bool, fast: bool) -> list[float]:
    ids = [(7 * i + 3) % 1000 for i in range(context + width)]
    kv = KVState(model, ids[:context], capacity=context + width, static=static, fast=fast)
    kv.run(Rows.chain(kv.pending, 0))
    kv.pending = []
    rows = Rows.chain(ids[context:], context, width)
    times = []
    for _ in range(repeats + 3):  # the first three warm up
        t0 = time.perf_counter()
        kv.run(rows)
        times.append((time.perf_counter() - t0) * 1e3)
        kv.keep(list(range(context)))
    return times[3:]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="1,4,8,16")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=60, help="timed draft forwards per point (target: a sixth)")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu-forward-paths.json")
    args = p.parse_args(argv)
    threads = configure_threads(None)
    pair = load_pair("embedded", None, device="cpu", dtype="float32")
    points = []
    for name, model in (("draft", pair.draft.model), ("target", pair.target.model)):
        repeats = args.repeats if name == "draft" else max(5, args.repeats // 6)
        for width in (int(w) for w in args.widths.split(",")):
            for path, (static, fast) in PATHS.items():
                ms = time_forward(model, args.context, width, repeats, static, fast)
                points.append(
                    {"model": name, "path": path, "width": width, "median_ms": statistics.median(ms), "min_ms": min(ms)}
                )
                print(f"{name:6} {path:7} width {width:3}: median {points[-1]['median_ms']:.2f} ms, min {min(ms):.2f}")
    command = " ".join(["python -m benchmarks.forward_paths", *(sys.argv[1:] if argv is None else argv)])
    report = {"command": command, "threads": threads, "context": args.context, "points": points}
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
