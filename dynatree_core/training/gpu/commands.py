"""The one-sitting GPU recipe's command, draft-gpu (`make draft-gpu`): a prompt pack in, the feature
draft and its card out, in a wall-time budget, resumable stage by stage (gpu/recipe.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynatree_core.training.cli import Command, data_root, print_now, runs_root
from dynatree_core.training.gpu.settings import STAGES, GpuRecipe


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pack", type=Path, default=data_root() / "prompt-pack.jsonl.gz", help="the prompt pack")
    p.add_argument("--out", type=Path, default=runs_root() / "gpu", help="the run directory (all it writes)")
    p.add_argument("--budget-s", type=float, default=1500.0, help="seconds of the stages' work, split across them")
    p.add_argument("--until", choices=STAGES, default="export", help="stop after this stage (a rerun goes on)")
    p.add_argument("--stop-after-s", type=float, default=0.0, help="end this call after this long (a rerun goes on)")
    p.add_argument("--target", default="embedded", help="a Llama-family target: preset, hub id or directory")
    p.add_argument("--device", default="auto", help="auto: CUDA when present")
    p.add_argument("--dtype", default="bfloat16", help="the target's dtype while answering and relabelling")
    p.add_argument("--batch-rows", type=int, default=0, help="rows decoded together (0: 1024 on CUDA, 16 on CPU)")
    p.add_argument("--shard-jobs", type=int, default=0, help="jobs a shard (0: 8 x batch rows on CUDA, 512 on CPU)")
    p.add_argument("--answer-tokens", type=int, default=0, help="stop answering at this many answer tokens")
    p.add_argument("--train-s", type=float, default=0.0, help="seconds of training (0: the budget's share)")
    p.add_argument("--pairs-per-step", type=int, default=8192, help="packed answer pairs a training step reads")
    p.add_argument("--init-from", type=Path, default=None, help="a saved feature draft to start from")
    p.add_argument("--prior-answers", type=Path, default=None,
                   help="answers made before (an answer store's ids) to relabel and train on too")  # fmt: skip
    p.add_argument("--token-map", type=Path, default=None, help="default: the shipped map (embedded) or rebuilt")
    p.add_argument("--ood-max-new", type=int, default=256, help="a generated OOD answer's token limit")
    p.add_argument("--seed", type=int, default=0)


def _run(args: argparse.Namespace) -> None:
    import dataclasses

    from dynatree_core.training.gpu.recipe import GpuRun

    cfg = GpuRecipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GpuRecipe)})
    if not cfg.pack.is_file() and not (cfg.out / "answers" / "main.jobs.gz").exists():  # a started run has its copy
        raise SystemExit(f"draft-gpu: no prompt pack at {cfg.pack}: build it with `python -m dynatree_core.training "
                         "prompt-pack`, or name one with --pack")  # fmt: skip
    if cfg.prior_answers is not None and not cfg.prior_answers.is_dir():
        raise SystemExit(f"draft-gpu: no answer store at {cfg.prior_answers} (--prior-answers: a directory of "
                         "id shards such as assets/draft-data/answers)")  # fmt: skip
    try:
        done = GpuRun(cfg, log=print_now).run()
    except ValueError as exc:  # read_pack: not a pack, or its jobs do not match its digest
        raise SystemExit(f"draft-gpu: {exc}") from None
    if not done:
        raise SystemExit(3)  # stopped early on purpose: the same command continues it


COMMANDS = {
    "draft-gpu": Command(
        "a prompt pack to an exported feature draft in one GPU sitting (resumable stages)", _flags, _run
    ),  # fmt: skip
}
