"""The packed recipe's command, train-packed: the cheap step over packed answer windows, a long
resumable schedule (`make draft-feature-long`, `make draft-feature-final`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynatree_core.runs.environment import portable
from dynatree_core.training.cli import SHIPPED, Command, answer_dirs, config_flags, config_from, print_now, runs_root


def _flags(p: argparse.ArgumentParser) -> None:
    from dynatree_core.drafts.fused import FC_NORMS
    from dynatree_core.training.packed.step import PackedTrainConfig

    p.add_argument("--kind", choices=("feature", "fused"), default="fused", help="fused: EAGLE-3's three taps")
    p.add_argument("--target", default="embedded", help="the target whose answers and states the draft reads")
    p.add_argument("--taps", default="eagle3", help='fused kind: "eagle3" or comma-separated layer inputs')
    p.add_argument(
        "--fc-norm",
        choices=tuple(FC_NORMS),
        default="per_tap",
        help='fused kind: how the taps are normed before fc; "none" is the form SGLang and vLLM serve '
        '(export-feature --layout eagle3 writes no other); "scale": a fixed factor a tap from the data, '
        "folded into fc at that export",
    )
    p.add_argument("--token-map", type=Path, default=SHIPPED / "smollm2-feature-draft")
    p.add_argument("--init-from", type=Path, default=None, help="a saved draft of the same kind (weights only)")
    p.add_argument("--out", type=Path, default=runs_root() / "packed")
    p.add_argument("--stages", default="questions,main", help='answer stages to train on ("written": text)')
    config_flags(p, PackedTrainConfig)


def eval_splits(data, ood, cfg) -> dict:
    """The held-out check reads the answer stages only (so runs on different stages compare), and
    the OOD answers when there are any."""
    import numpy as np

    from dynatree_core.training.answers.store import STAGES

    answer_rows = data.eval_rows[np.isin(data.windows.stage_of(data.eval_rows), STAGES)]
    heldout = np.random.default_rng(0).permutation(answer_rows)[: cfg.eval_windows]
    if len(ood.eval_rows):
        return {"heldout": (data, np.sort(heldout)), "ood": (ood, ood.eval_rows)}
    return {"heldout": (data, heldout)}


def start_draft(kind: str, target, token_map, taps, seed: int, *, init_from: Path | None, out: Path,
                fc_norm: str = "per_tap"):  # fmt: skip
    """A fresh draft of `kind`; with `init_from` (and no checkpoint in `out` yet) everything but the
    head from that draft: this run's head is the target's rows for its own token map."""
    from dynatree_core.core.weights import load_weights
    from dynatree_core.drafts.feature import FeatureDraft
    from dynatree_core.drafts.fused import FusedDraft

    if kind == "fused":
        draft = FusedDraft.from_target(target, token_map, taps=taps, seed=seed, fc_norm=fc_norm)
    else:
        draft = FeatureDraft.from_target(target, token_map, seed=seed)
    if init_from and not (out / "checkpoint.pt").exists():
        start = type(draft).load(init_from, target)
        head = "lm_head" if kind == "fused" else "lm.lm_head"
        weights = {k: v for k, v in start.state_dict().items() if not (k == head or k.startswith(head + "."))}
        load_weights(draft, weights, what=str(init_from), allow_missing=(head,))
        print_now(f"train-packed: initialised from {init_from}")
    return draft


def set_tap_scale(draft, data, windows: int = 64) -> None:
    """fc_norm "scale": each tap's factor makes its mean root-mean-square 1 over `windows` training
    windows spread over the data (their real pairs), so fc sees the taps at one scale, as a per-tap
    norm would on average, with nothing the eagle3 export cannot fold into fc."""
    import torch

    rows = data.train_rows[:: max(1, len(data.train_rows) // windows)][:windows]
    batch = data.batch(rows)
    taps = batch.inputs[batch.seg >= 0].float()  # (pairs, taps, H)
    with torch.no_grad():
        draft.tap_scale.copy_(1.0 / taps.pow(2).mean(-1).sqrt().mean(0))
    print_now(f"train-packed: tap scales {[round(float(s), 4) for s in draft.tap_scale]}")


def _train_packed(args: argparse.Namespace) -> None:
    from dynatree_core.core.models import load_model
    from dynatree_core.core.vocab import TokenMap
    from dynatree_core.training.answers.commands import parse_taps, stage_spec
    from dynatree_core.training.answers.store import AnswerStore
    from dynatree_core.training.answers.windows import source_summary
    from dynatree_core.training.packed.data import PackedAnswers
    from dynatree_core.training.packed.step import PackedTrainConfig
    from dynatree_core.training.packed.train import train_packed

    cfg = config_from(args, PackedTrainConfig)
    target = load_model(args.target, device=cfg.device, dtype="float32").model
    n_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    taps = parse_taps(args.taps, n_layers) if args.kind == "fused" else None
    token_map = TokenMap.load(args.token_map)
    stages, limits = stage_spec(args.stages)
    store = AnswerStore(*answer_dirs(args.target), limits)
    data = PackedAnswers(store, token_map, taps=taps, stages=stages)
    ood_store = AnswerStore(*answer_dirs(args.target, ood=True))
    ood = PackedAnswers(ood_store, token_map, taps=taps, stages=("ood",), heldout=True)
    if not len(data.train_rows):
        what = f"--taps {args.taps} --teacher" if taps else "--teacher"
        raise SystemExit(
            f"train-packed: no answer shard has its teacher (and taps); run `answers-relabel {what}` first"
        )
    evals = eval_splits(data, ood, cfg)
    draft = start_draft(args.kind, target, token_map, taps, cfg.seed, init_from=args.init_from, out=args.out,
                        fc_norm=args.fc_norm)  # fmt: skip
    if getattr(draft, "fc_norm_kind", None) == "scale" and not args.init_from:  # a checkpoint restores its own
        set_tap_scale(draft, data)
    windows = f"{len(data.train_rows)} training windows ({data.answer_pairs():,} answer pairs)"
    print_now(f"train-packed: {args.kind} kind, {windows}, {len(evals['heldout'][1])} held-out and "
              f"{len(ood.eval_rows)} OOD windows evaluated")  # fmt: skip
    about = {"kind": "answers", **data.windows.describe(), "sources": source_summary(store, stages)}
    if args.init_from:
        about["init_from"] = portable(str(args.init_from))
    head = target.get_output_embeddings()
    train_packed(draft, data, args.out, cfg, target_head=head, evals=evals, about=about, log=print_now)


COMMANDS = {
    "train-packed": Command(
        "the cheap step over packed answer windows, a long resumable schedule", _flags, _train_packed
    ),  # fmt: skip
}
