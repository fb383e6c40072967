"""What width-invariant forwards cost, in ONE process, run from the repo root:

    PYTHONPATH=. .venv/bin/python -m benchmarks.invariance_cost [--context 160] [--repeats 15]
        [--dtypes float32,bfloat16] [--out assets/benchmarks/cpu-invariance-cost.json]

For the embedded target it times, through kv.KVState exactly as the engine calls it, a verify
forward of a 31-node tree (depth 6, the root's chain token plus 30 nodes) and a one-token `ar`
forward after `context` cached tokens, with the shared-kernel lean forward (the float32 default)
and with the width-invariant one (forward/invariant.py; the bfloat16 default). The four variants
alternate within each repeat, so their ratios come from the same minutes of this shared machine.
Prints and writes median ms per point, and checks that the tree's path nodes got `ar`'s bits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import RESULTS, ROOT
from dynatree_core.core.tree import DraftTree
from dynatree_core.decoding.pairs import load_pair
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows, lineage
from dynatree_core.measure.gpu_check import path_bits_match


def _tree() -> DraftTree:
    """Two children for each of the first three nodes of every level, six levels: 31 nodes."""
    tree, frontier = DraftTree.with_root(17), [0]
    for depth in range(6):
        frontier = [tree.add(p, 30 + b + depth, -0.1) for p in frontier[:3] for b in range(2)]
    return tree


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu-invariance-cost.json")
    args = parser.parse_args(argv)
    prompt = [100 + i % 500 for i in range(args.context)]
    tree = _tree()
    order = tree.order("bfs")
    report = {"context": args.context, "tree_nodes": len(order), "repeats": args.repeats, "points": {}}
    for dtype in args.dtypes.split(","):
        model = load_pair("embedded", None, device="cpu", dtype=dtype).target.model
        states = {}
        for invariant in (False, True):
            kv = KVState(model, prompt, invariant=invariant)
            kv.run(Rows.chain(prompt, 0))
            kv.pending = []
            states[invariant] = kv
        times: dict[str, list[float]] = {}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            for invariant, kv in states.items():
                lines = lineage(tree.parent_rows(order))
                tokens, positions = [tree.tokens[n] for n in order[1:]], tree.position_ids(order[1:], len(prompt))
                batch = Rows.tree(kv.length, [tree.tokens[0]], len(prompt), tokens, positions, lines, keep=len(order))
                for name, step in (
                    ("tree", lambda kv=kv, batch=batch: kv.run(batch)),
                    ("ar", lambda kv=kv: kv.run(Rows.chain([5], len(prompt)))),
                ):
                    t0 = time.perf_counter()
                    step()
                    times.setdefault(f"{name} {'invariant' if invariant else 'shared'}", []).append(
                        (time.perf_counter() - t0) * 1e3
                    )
                    kv.keep(list(range(len(prompt))))
        point = {key: round(statistics.median(ms[1:]), 1) for key, ms in times.items()}
        point["tree invariant / shared"] = round(point["tree invariant"] / point["tree shared"], 2)
        point["ar invariant / shared"] = round(point["ar invariant"] / point["ar shared"], 2)
        point["path bits equal ar's"] = path_bits_match(model, prompt[:40])
        report["points"][dtype] = point
        print(dtype, point, flush=True)
    report["threads"] = torch.get_num_threads()
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written to {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
