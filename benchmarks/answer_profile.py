"""Where the draft recipe's answer decoding spends its time (`draft-gpu`'s answers stage), run from
the repo root with nothing else torch-heavy running:

    PYTHONPATH=. python -m benchmarks.answer_profile --pack PACK [--jobs 2048] [--batch 1024]
        [--device cuda] [--target embedded] [--out FILE.json]

One process, the target in the recipe's dtype (bfloat16), the pack's first `--jobs` jobs sorted by
prompt length (as `decode_shard` sorts a shard) and decoded as the recipe decodes them (continuous
batching, features and the compact teacher kept):

1. a warm-up: 64 jobs, 8 tokens each;
2. the timed runs, the same jobs twice: the decoding step captured (the recipe's way on CUDA: one
   graph per attention span while the batch is whole) and eager (`graphs=False`); each with answer
   tokens/s, decoding steps and live rows per step (the progress callback is told each step's
   rows), ms per step; and the captured run's speed over the eager one's;
3. the profiled run (torch.profiler) over the first `--profile-jobs` jobs at `--profile-new` tokens
   at most: the ops with the most self time on the device and on the host, and the device's busy
   share (its kernels' summed time over the run's wall): near 1, the GPU bounds the decoding; far
   below 1, the host does (Python, launches, syncs) and capture or fewer syncs would pay.

The 2026-11-28 H100 sitting decoded 16,261 answer tokens/s at 1,024 rows (a step ~63 ms), far from
what a 135M model's arithmetic and its cache's reads need; this names the reason.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from dynatree_core.core.models import load_model
from dynatree_core.training.answers.decode_batch import BatchDecoder
from dynatree_core.training.answers.pack import read_pack
from dynatree_core.training.answers.store import encode_job


def _decode(decoder, target, prompts, jobs, *, batch: int, max_new: int | None = None) -> dict:
    """One `generate` call as `decode_shard` makes it; its answer tokens, steps, rows per step, wall."""
    steps: list[int] = []
    sync = torch.cuda.synchronize if decoder.device.type == "cuda" else lambda: None
    sync()
    t0 = time.perf_counter()
    limits = [min(j.max_new, max_new or j.max_new) for j in jobs]
    rows = decoder.generate(
        prompts, max_new=limits, temperature=[j.temperature for j in jobs], eos=target.eos_token_ids, seed=0,
        batch=batch, progress=steps.append, teacher=True,
    )  # fmt: skip
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.ids) - r.prompt_len for r in rows)
    return {"jobs": len(jobs), "answer_tokens": tokens, "prompt_tokens": sum(len(p) for p in prompts),
            "wall_s": round(wall, 3), "answer_tokens_per_s": round(tokens / wall), "steps": len(steps),
            "rows_per_step": round(float(np.mean(steps)), 1) if steps else 0.0,
            "ms_per_step": round(1000 * wall / max(len(steps), 1), 2)}  # fmt: skip


def _table(events, key: str, n: int) -> list[dict]:
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"op": e.key, "calls": e.count, "self_ms": round(getattr(e, key) / 1000, 2)} for e in rows]


def profiled_tables(prof, wall_s: float, cuda: bool, top: int) -> dict:
    """A torch.profiler run's report: the device's busy share (its kernels' summed self time over
    `wall_s`; None off CUDA), the device's name, and the `top` ops by self time on device and host."""
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    busy = sum(getattr(e, device_key) for e in events) / 1e6 if cuda else None
    return {
        "device_busy_share": round(busy / wall_s, 3) if cuda else None,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "device_top": _table(events, device_key, top) if cuda else [],
        "host_top": _table(events, "self_cpu_time_total", top),
    }


def finish(report: dict, out: Path | None) -> dict:
    """Print the report's profiled line and top ops; write it to `out` as JSON."""
    print(f"profiled: {json.dumps(report['profiled'])}")
    for name in ("device_top", "host_top"):
        print(name)
        for row in report[name]:
            print(f"  {row['self_ms']:10.2f} ms  {row['calls']:7d}  {row['op'][:70]}")
    if out:
        out.write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--target", default="embedded")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--jobs", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--profile-jobs", type=int, default=1024)
    p.add_argument("--profile-new", type=int, default=48)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not args.pack.is_file():
        p.error(f"no prompt pack at {args.pack} (build one: python -m dynatree_core.training prompt-pack)")

    target = load_model(args.target, device=args.device, dtype=args.dtype)
    decoder, eager = BatchDecoder(target.model), BatchDecoder(target.model, graphs=False)
    jobs = read_pack(args.pack)[1][: args.jobs]
    prompts = [encode_job(target.tokenizer, j) for j in jobs]
    order = np.argsort([len(q) for q in prompts], kind="stable")
    jobs, prompts = [jobs[i] for i in order], [prompts[i] for i in order]

    for dec in (decoder, eager):
        _decode(dec, target, prompts[:64], jobs[:64], batch=args.batch, max_new=8)  # warm-up
    timed = _decode(decoder, target, prompts, jobs, batch=args.batch)
    print(f"timed: {json.dumps(timed)}", flush=True)
    timed_eager = _decode(eager, target, prompts, jobs, batch=args.batch)
    timed["speed_over_eager"] = round(timed_eager["wall_s"] / timed["wall_s"], 3)
    print(f"timed eager: {json.dumps(timed_eager)}; captured / eager speed {timed['speed_over_eager']}", flush=True)

    cuda = decoder.device.type == "cuda"
    n = args.profile_jobs
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        profiled = _decode(decoder, target, prompts[:n], jobs[:n], batch=args.batch, max_new=args.profile_new)
    tables = profiled_tables(prof, profiled["wall_s"], cuda, args.top)
    profiled["device_busy_share"] = tables.pop("device_busy_share")
    report = {"target": args.target, "device": str(decoder.device), "dtype": args.dtype, "batch": args.batch,
              "timed": timed, "timed_eager": timed_eager, "profiled": profiled} | tables  # fmt: skip
    return finish(report, args.out)


if __name__ == "__main__":
    main()
