"""Where the draft recipe's training step spends its time (`draft-gpu`'s train stage), run from the
repo root with nothing else torch-heavy running, on a run directory whose answers exist:

    PYTHONPATH=. python -m benchmarks.train_profile --run RUN [--device cuda] [--seconds 20]
        [--profile-steps 6] [--out FILE.json]

One process, the recipe's own pieces (its answer store, token map and training settings; a fresh
feature draft from the target, so nothing of the run is changed: the schedule runs into a scratch
folder):

1. a timed schedule of `--seconds` training seconds through the one loop (`train_packed`, the
   recipe's settings, no evaluation): its log lines' pairs/s and the wall time per step;
2. the profiled steps (torch.profiler) over `--profile-steps` more steps: the ops with the most self
   time on the device and on the host, and the device's busy share (its kernels' summed time over
   the steps' wall): near 1, the GPU bounds the step; far below 1, the host does.

The 2026-11-28 H100 smoke logged 23,770-61,732 pairs/s on 256 jobs' data; this says where the time
of a step goes on a full shard.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.answer_profile import finish, profiled_tables
from dynatree_core.drafts.feature import FeatureDraft
from dynatree_core.training.gpu.recipe import TRAIN_SETTINGS, GpuRecipe, GpuRun
from dynatree_core.training.packed.data import PackedAnswers
from dynatree_core.training.packed.step import PackedTrainConfig
from dynatree_core.training.packed.train import train_packed


def _schedule(draft, data, folder: Path, cfg: PackedTrainConfig, head) -> tuple[list[str], float]:
    """`cfg`'s schedule into `folder`; its log lines and wall seconds."""
    lines: list[str] = []
    sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else lambda: None
    sync()
    t0 = time.perf_counter()
    train_packed(draft, data, folder, cfg, target_head=head, log=lines.append)
    sync()
    return lines, time.perf_counter() - t0


def _rates(lines: list[str]) -> tuple[list[float], int]:
    """The log lines' pairs/s, block by block, and the last step logged."""
    rates = [float(m.group(1)) for line in lines if (m := re.search(r"\((\d+) pairs/s\)", line))]
    steps = [int(m.group(1)) for line in lines if (m := re.search(r"step (\d+) loss", line))]
    return rates, max(steps, default=0)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a draft-gpu run directory with answers")
    p.add_argument("--target", default="embedded")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--profile-steps", type=int, default=6)
    p.add_argument("--pairs-per-step", type=int, default=8192)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not (args.run / "answers").is_dir():
        p.error(f"no answers under {args.run} (run `draft-gpu --until answers` first)")

    run = GpuRun(GpuRecipe(pack=args.run / "pack.json", out=args.run, target=args.target, device=args.device))
    target = run.target("float32")
    token_map = run.token_map(target)
    data = PackedAnswers(run.store, token_map, stages=run.answer_stages())
    head = target.model.get_output_embeddings()
    settings = TRAIN_SETTINGS | {"log_every": 5, "checkpoint_every_s": 1e9}  # one checkpoint: the end's
    cfg = PackedTrainConfig(**settings, budget_s=args.seconds, eval_every_s=0, device=str(run.device),
                            pairs_per_step=args.pairs_per_step)  # fmt: skip
    draft = FeatureDraft.from_target(target.model, token_map)
    with tempfile.TemporaryDirectory() as scratch:
        lines, wall = _schedule(draft, data, Path(scratch) / "timed", cfg, head)
        rates, steps = _rates(lines)
        timed = {"train_s": args.seconds, "wall_s": round(wall, 2), "steps": steps,
                 "ms_per_step": round(1000 * wall / max(steps, 1), 1), "pairs_per_s_by_block": rates,
                 "windows": len(data.train_rows), "answer_pairs": data.answer_pairs()}  # fmt: skip
        print(f"timed: {json.dumps(timed)}", flush=True)

        cuda = run.device.type == "cuda"
        # about `--profile-steps` steps: a schedule of that many steps' pairs (windows vary in size)
        passes = args.profile_steps * args.pairs_per_step / max(data.answer_pairs(), 1)
        short = dataclasses.replace(cfg, budget_s=0.0, passes=passes, log_every=args.profile_steps, warmup=1)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            lines, profiled_wall = _schedule(draft, data, Path(scratch) / "profiled", short, head)
    tables = profiled_tables(prof, profiled_wall, cuda, args.top)
    profiled = {"steps": _rates(lines)[1], "wall_s": round(profiled_wall, 3),
                "device_busy_share": tables.pop("device_busy_share")}  # fmt: skip
    report = {"target": args.target, "device": str(run.device), "pairs_per_step": args.pairs_per_step,
              "timed": timed, "profiled": profiled} | tables  # fmt: skip
    return finish(report, args.out)


if __name__ == "__main__":
    main()
