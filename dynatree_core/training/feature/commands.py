"""The feature draft's commands: feature-label and train-feature (KD on the corpus or the answers),
feature-quality (agreement by depth), export-feature (ships a train-feature or train-packed run)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynatree_core.training.cli import (
    CORPUS,
    SHIPPED,
    Command,
    answer_dirs,
    config_flags,
    config_from,
    data_root,
    export_flags,
    print_now,
    runs_root,
    write_json,
)


def _label_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--features", type=Path, default=data_root() / "features")
    p.add_argument("--onpolicy-only", action="store_true", help="only the shards holding on-policy windows")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="the target's dtype while labelling (auto: bfloat16)")


def _label(args: argparse.Namespace) -> None:
    from dynatree_core.core.models import load_model
    from dynatree_core.training.feature.labels import label_features, onpolicy_shards

    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    target = load_model("embedded", device=args.device, dtype=dtype).model
    shards = onpolicy_shards(args.corpus) if args.onpolicy_only else None
    label_features(args.corpus, args.features, target, shards=shards, batch=args.batch)


def _train_flags(p: argparse.ArgumentParser) -> None:
    from dynatree_core.training.feature.train import FeatureTrainConfig

    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--features", type=Path, default=data_root() / "features")
    p.add_argument("--out", type=Path, default=runs_root() / "feature-kd")
    p.add_argument("--token-map", type=Path, default=SHIPPED / "smollm2-draft")
    p.add_argument("--init-from", type=Path, default=None, help="a saved feature draft to start from (weights only)")
    p.add_argument("--data", choices=("corpus", "answers"), default="corpus", help="answers: the answer shards")
    p.add_argument("--target", default="embedded", help="the target whose features the draft reads")
    config_flags(p, FeatureTrainConfig)


def _train(args: argparse.Namespace) -> None:
    from dynatree_core.core.models import load_model
    from dynatree_core.core.vocab import TokenMap
    from dynatree_core.training.feature.labels import FeatureCorpus
    from dynatree_core.training.feature.train import FeatureTrainConfig, train_feature_draft

    cfg = config_from(args, FeatureTrainConfig)
    target = load_model(args.target, device=cfg.device, dtype="float32").model
    if args.data == "answers":
        from dynatree_core.training.answers.store import AnswerStore
        from dynatree_core.training.answers.windows import AnswerCorpus, source_summary

        store = AnswerStore(*answer_dirs(args.target))
        data = AnswerCorpus(store)
        about = {"kind": "answers", **data.describe(), "sources": source_summary(store)}
    else:
        data, about = FeatureCorpus(args.corpus, args.features), None
    print_now(f"train-feature: {len(data.train_rows)} training windows, {len(data.eval_rows)} held out")
    token_map = TokenMap.load(args.token_map) if args.token_map else None
    train_feature_draft(target, token_map, data, args.out, cfg, init_from=args.init_from, about=about, log=print_now)
    print(f"train-feature: saved {args.out / 'draft'}")


def _quality_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", type=Path, nargs="+", required=True, help="feature draft directories")
    p.add_argument("--token-draft", type=Path, default=None, help="default: the embedded token draft (embedded target)")
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--features", type=Path, default=data_root() / "features")
    p.add_argument("--out", type=Path, default=None, help="write the numbers as JSON")
    p.add_argument("--answers", action="store_true", help="held-out answer shards and the OOD answers, side by side")
    p.add_argument("--target", default="embedded")
    p.add_argument("--no-token-draft", action="store_true", help="report the feature drafts only")


def _quality(args: argparse.Namespace) -> None:
    from dynatree_core.core.models import load_model

    target = load_model(args.target, device="cpu", dtype="float32").model
    spec = args.token_draft or (SHIPPED / "smollm2-draft" if args.target == "embedded" else None)
    token = None if args.no_token_draft or spec is None else load_model(str(spec), device="cpu", dtype="float32")
    result = _answers_quality(args, target, token) if args.answers else _corpus_quality(args, target, token, spec)
    write_json(result, args.out)


def _answers_quality(args: argparse.Namespace, target, token) -> dict:
    """In-distribution (held-out answer shards) and OOD agreement by depth, side by side."""
    from dynatree_core.training.answers.store import AnswerStore
    from dynatree_core.training.answers.windows import agreement_report, answer_splits

    stores = AnswerStore(*answer_dirs(args.target)), AnswerStore(*answer_dirs(args.target, ood=True))
    return agreement_report(target, args.draft, token, answer_splits(*stores))


def _corpus_quality(args: argparse.Namespace, target, token, spec) -> dict:
    """Agreement by depth on the sampled corpus's held-out windows, beside the token draft's."""
    from dynatree_core.drafts.feature import FeatureDraft
    from dynatree_core.training.feature.labels import FeatureCorpus
    from dynatree_core.training.feature.train import agreement_by_depth, token_draft_agreement

    data = FeatureCorpus(args.corpus, args.features)
    head = target.get_output_embeddings()
    result = {"heldout_windows": len(data.eval_rows), "heldout_tokens": int(data.lengths[data.eval_rows].sum())}
    if token is not None:
        agreement = token_draft_agreement(token.model, token.token_map, head, data, data.eval_rows)
        result[str(spec)] = {"kind": "token", "agreement": agreement}
    for path in args.draft:
        draft = FeatureDraft.load(path, target)
        by_depth = agreement_by_depth(draft, head, data, data.eval_rows)
        result[str(path)] = {"kind": "feature", "agreement_by_depth": by_depth}
    return result


def _export_flags(p: argparse.ArgumentParser) -> None:
    export_flags(p, run=runs_root() / "feature-kd", quality="feature-quality", recipe="make draft-feature")
    p.add_argument("--target", default="embedded", help="the target the draft reads (not embedded: give --dest)")
    p.add_argument(
        "--layout", choices=("dynatree", "eagle3"), default="dynatree",
        help="eagle3: the layout SGLang and vLLM load (a fused-kind draft without tap norms only; needs --dest)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16",
        help="eagle3 layout: the weights' dtype (float32 reads back with identical logits)",
    )  # fmt: skip


def _export(args: argparse.Namespace) -> None:
    import json

    from dynatree_core.core.models import load_model
    from dynatree_core.core.presets import EMBEDDED_FEATURE_DRAFT_DIR
    from dynatree_core.training.card import export_feature_draft

    target = load_model(args.target, device="cpu", dtype="float32").model
    if args.layout == "eagle3":
        return _export_eagle3(args, target)
    if args.dest is None and args.target != "embedded":
        raise SystemExit("export-feature: a draft for another target needs --dest (the default is the shipped one)")
    quality = json.loads(args.quality.read_text()) if args.quality and args.quality.exists() else None
    dest = args.dest or EMBEDDED_FEATURE_DRAFT_DIR
    export_feature_draft(args.run, dest, target, quality=quality, command=args.recipe, note=args.note)
    print(f"export-feature: {dest}")


def _export_eagle3(args: argparse.Namespace, target) -> None:
    """A fused-kind draft without tap norms, in the layout SGLang and vLLM load."""
    import torch

    from dynatree_core.drafts.heads import load_head
    from dynatree_core.drafts.published import export_eagle3
    from dynatree_core.errors import DynaTreeError

    draft = load_head(str(args.run / "draft" if (args.run / "draft").is_dir() else args.run), target)
    if args.dest is None or draft.kind != "fused":
        raise SystemExit("export-feature --layout eagle3: a fused-kind draft (train-packed --kind fused) and --dest")
    try:
        out = export_eagle3(draft, args.dest, target_name=args.target, dtype=getattr(torch, args.dtype))
    except DynaTreeError as exc:
        raise SystemExit(f"export-feature: {exc}") from None
    print(f"export-feature: {out}")


COMMANDS = {
    "feature-label": Command("the target's final hidden states for the windows (feature draft)", _label_flags, _label),
    "train-feature": Command("distil the feature draft from the stored features (resumable)", _train_flags, _train),
    "feature-quality": Command(
        "held-out agreement by depth: feature draft(s) vs the token draft", _quality_flags, _quality
    ),  # fmt: skip
    "export-feature": Command("ship a trained feature draft into assets/models/ with its card", _export_flags, _export),
}
