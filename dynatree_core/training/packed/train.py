"""The packed recipe's schedule (`train-packed`; `make draft-feature-long` and `-final`): the cheap
step (packed/step.py) over packed answer windows, through the one loop (trainer.py).

`passes` over the training pairs, linear warm-up then cosine decay to zero over the whole run (by
loss pairs seen, or by training time under `budget_s`), gradient clip 0.5, a checkpoint at every
log line (or at the first after `checkpoint_every_s` seconds) and at the end (a rerun resumes it
only for the same draft and loss: resume.py; its place in the data included, so a run stopped with
`stop_after_s` continues the same schedule), and held-out and OOD
agreement by depth at fixed intervals of training time into `curve.json` (the card's learning curve).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from dynatree_core.drafts.fused import FusedDraft
from dynatree_core.training import trainer
from dynatree_core.training.packed.data import PackedAnswers, prefetch
from dynatree_core.training.packed.step import PackedTrainConfig, packed_agreement, packed_loss, plan_step
from dynatree_core.training.resume import head_run
from dynatree_core.training.trainer import Loop, Recipe, open_checkpoint

# what a resumed run must share with the one that wrote its checkpoint (besides the draft's form): the
# loss and the optimiser's settings. The schedule's length (passes, budget_s) may grow, and how the
# process runs (device, logging, evaluations, stop_after_s) may change between runs.
RUN_SETTINGS = ("pairs_per_step", "lr", "warmup", "weight_decay", "levels", "level_decay", "regression_weight",
                "ce_weight", "ce_share", "noise", "train_head", "seed")  # fmt: skip
PREFETCH_WORKERS = 4  # batch-building threads beside a GPU (one beside a CPU, whose cores train)


def _recipe(draft, data: PackedAnswers, cfg: PackedTrainConfig, run: dict, *, target_head, evals, info, log):
    """The packed loss, batches (in a seeded order per pass, built on prefetch threads) and the
    agreement by depth on each of `evals`, for the one loop."""
    device = torch.device(cfg.device)
    pass_pairs = max(data.answer_pairs(), 1)

    fused, pin = isinstance(draft, FusedDraft), device.type == "cuda"

    def batches(state: dict):
        torch.manual_seed(cfg.seed + state["step"])

        def make():  # the steps' windows in order, each with its place in the data (handed over with its batch)
            epoch, cursor = state.get("pass", 0), state.get("cursor", 0)
            while True:
                order = np.random.default_rng(cfg.seed + epoch).permutation(data.train_rows)
                while cursor < len(order):
                    # the step's random choices follow its place in the data: a resumed run makes the same
                    seed = cfg.seed + 1_000_003 * epoch + cursor
                    rows, cursor = data.step_rows(order, cursor, cfg.pairs_per_step)
                    yield rows, seed, {"pass": epoch, "cursor": cursor}
                epoch, cursor = epoch + 1, 0

        def build(item):  # on a prefetch thread
            rows, seed, place = item
            batch = data.batch(rows)
            batch.plan = plan_step(batch, cfg, fused, torch.Generator().manual_seed(seed))  # the step never waits
            return batch.pinned() if pin else batch, place

        for batch, place in prefetch(make, build, workers=PREFETCH_WORKERS if pin else 1):
            yield batch.to(device), place

    def loss(batch, parts: bool):
        value, terms = packed_loss(draft, batch, cfg, parts=parts)
        return value, terms, batch.answer_pairs, batch.pairs

    def point(state: dict, loss: float) -> dict:
        point = {k: state.get(k, 0) for k in ("step", "seen", "pass")} | {"train_s": round(state["spent_s"], 1)}
        for name, (split, rows) in (evals or {}).items():
            point[name] = [round(a, 4) for a in packed_agreement(draft, split, rows, target_head)]
        log(f"train-packed: step {state['step']} agreement by depth " + json.dumps({k: point[k] for k in evals or {}}))
        return point

    def saved(out: Path) -> None:
        draft.save(out / "draft")
        log(f"train-packed: the schedule is complete; saved {out / 'draft'}")

    params = [p for p in draft.parameters() if p.requires_grad]
    note = lambda state: f" pass {state['seen'] / pass_pairs:.2f}"  # noqa: E731
    return Recipe(draft, params, batches, loss, point, saved, run, info=info, note=note)


def train_packed(
    draft,
    data: PackedAnswers,
    out: Path,
    cfg: PackedTrainConfig,
    *,
    target_head,
    evals: dict[str, tuple[PackedAnswers, np.ndarray]] | None = None,
    about: dict | None = None,
    clock=None,
    log=print,
):
    """Train `draft` on `data` (resumable from `out/checkpoint.pt`); returns the draft, saved to
    `out/draft` when the schedule ends. `evals`: {name: (data, rows)} measured at every
    evaluation (the learning curve); `about`: what curve.json says of the data."""
    device = torch.device(cfg.device)
    draft = draft.float().to(device).train()
    # the feature kind's head is the target's rows, always frozen; the fused kind's may train
    frozen = ([] if cfg.train_head else ["lm_head"]) if isinstance(draft, FusedDraft) else ["lm.lm_head"]
    for name, param in draft.named_parameters():
        param.requires_grad_(not any(name.startswith(f) for f in frozen))
    run = head_run(draft, **{k: getattr(cfg, k) for k in RUN_SETTINGS})
    saved = open_checkpoint(out / "checkpoint.pt", run, device)
    info = {"config": dataclasses.asdict(cfg), "kind": draft.kind} | ({"data": about} if about is not None else {})
    recipe = _recipe(draft, data, cfg, run, target_head=target_head, evals=evals, info=info, log=log)
    loop = Loop("train-packed", cfg.lr, cfg.warmup, clip=0.5, weight_decay=cfg.weight_decay,
                total=cfg.passes * max(data.answer_pairs(), 1), budget_s=cfg.budget_s, log_every=cfg.log_every,
                checkpoint_every_s=cfg.checkpoint_every_s,
                eval_every_s=cfg.eval_every_s, eval_first=cfg.eval_first, stop_after_s=cfg.stop_after_s,
                autocast=cfg.autocast, device=cfg.device, unit="pairs")  # fmt: skip
    state = trainer.train(recipe, out, loop, saved=saved, clock=clock, log=log)
    if not trainer.finished(loop, state):
        log(f"train-packed: stopped at {trainer.progress(loop, state):.1%} of the schedule; rerun to continue")
    return draft
