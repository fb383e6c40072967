"""Training throughput of the feature draft's step before and after the cheap step, in one process.

Before: `train-feature`'s step (training/feature/train.py): 32 windows padded to the longest, the
target's LM head recomputed over the reduced vocabulary for the teacher, CE on a random 25% of
the answer positions (the recipe's --ce-share 0.25), bfloat16 autocast. After: `train-packed`'s
step (training/packed/step.py): the same windows packed into 512-slot rows, the compact teacher, the
query side only where a loss is taken, the same CE share and autocast. Both start from the same
weights; rounds alternate (before, after, before, ...) over the same windows, each timed after a
warm-up step. Reported: positions read per second (every position with a target state, prompts
as context included: the unit train-feature logs) and answer (loss) positions per second.

    PYTHONPATH=. .venv/bin/python -m benchmarks.train_step [--kind fused --levels 3] [--steps 6]

Run it alone on the machine (torch jobs sharing 2 cores slow each other ~10x).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np
import torch

from benchmarks import ROOT
from dynatree_core.core.models import load_model
from dynatree_core.core.taps import eagle3_taps
from dynatree_core.core.vocab import TokenMap
from dynatree_core.drafts.feature import FeatureDraft
from dynatree_core.drafts.fused import FusedDraft
from dynatree_core.training.answers.commands import answer_dirs
from dynatree_core.training.answers.store import AnswerStore
from dynatree_core.training.answers.windows import AnswerCorpus
from dynatree_core.training.feature.train import feature_kd_loss
from dynatree_core.training.packed.data import PackedAnswers
from dynatree_core.training.packed.step import PackedTrainConfig, packed_loss

MAP = ROOT / "assets" / "models" / "smollm2-feature-draft"


def old_loss(draft, x, f, valid, kd):
    return feature_kd_loss(draft, x, f, valid, **kd)[0]


def new_loss(draft, batch, cfg):
    return packed_loss(draft, batch, cfg, parts=False)[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kind", choices=("feature", "fused"), default="feature", help="the after side's draft kind")
    ap.add_argument("--levels", type=int, default=1)
    ap.add_argument("--ce-share", type=float, default=0.25)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    target = load_model("embedded", device="cpu", dtype="float32").model
    token_map = TokenMap.load(MAP)
    store = AnswerStore(*answer_dirs("embedded"))
    taps = eagle3_taps(30) if args.kind == "fused" else None
    padded = AnswerCorpus(store)
    packed = PackedAnswers(store, token_map, taps=taps)
    rows = np.random.default_rng(0).permutation(packed.train_rows)[: 32 * (args.steps + 1) * args.rounds]
    before = FeatureDraft.from_target(target, token_map).float().train()
    after = (FusedDraft.from_target(target, token_map, taps=taps) if taps else before).float().train()
    cfg = PackedTrainConfig(levels=args.levels, ce_share=args.ce_share)

    def train_step(draft, loss_fn):
        params = [p for n, p in draft.named_parameters() if "lm_head" not in n]
        opt = torch.optim.AdamW(params, lr=1e-5)

        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        return run

    cpu = torch.device("cpu")
    result = {"before": [], "after": []}
    for r in range(args.rounds):
        chunk = rows[r * 32 * (args.steps + 1) : (r + 1) * 32 * (args.steps + 1)]
        groups = [chunk[i * 32 : (i + 1) * 32] for i in range(args.steps + 1)]
        for side in ("before", "after"):
            read = answer = 0
            elapsed = 0.0
            for i, group in enumerate(groups):
                if side == "before":
                    x, f, valid, ans = padded.batch(group, cpu, with_loss_mask=True)
                    kd = dict(noise=0.1, ce_weight=0.1, ce_share=args.ce_share, answer=ans)
                    step = train_step(before, functools.partial(old_loss, before, x, f, valid, kd))
                    n_read, n_answer = int(valid.sum()), int((ans[:, 1:] & valid[:, 1:]).sum())
                else:
                    batch = packed.batch(group)
                    step = train_step(after, functools.partial(new_loss, after, batch, cfg))
                    n_read, n_answer = batch.pairs + len(group), int(batch.answer.sum())
                t0 = time.perf_counter()
                step()
                if i:  # the first step of a side warms up
                    elapsed += time.perf_counter() - t0
                    read, answer = read + n_read, answer + n_answer
            result[side].append({"positions_per_s": read / elapsed, "answer_positions_per_s": answer / elapsed})
            print(f"round {r} {side}: {read / elapsed:.0f} positions/s, {answer / elapsed:.0f} answer positions/s",
                  flush=True)  # fmt: skip
    summary = {side: {k: float(np.mean([p[k] for p in points])) for k in points[0]} for side, points in result.items()}
    summary["ratio"] = {k: summary["after"][k] / summary["before"][k] for k in summary["before"]}
    summary["config"] = vars(args)
    print(json.dumps(summary, indent=1))
    if args.out:
        (ROOT / args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
