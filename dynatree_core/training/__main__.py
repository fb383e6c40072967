"""`python -m dynatree_core.training ...`: draft-model training pipeline (data generation first)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynatree_core.core.models import REPO_ROOT, cache_dir
from dynatree_core.training.answer_commands import COMMITTED, _answers, _train_packed, _vocab_map, answer_dirs  # noqa: F401


def _config_flags(parser: argparse.ArgumentParser, config_class) -> None:
    """One --flag per field of a training config dataclass, with its default."""
    for field in config_class.__dataclass_fields__.values():
        kind = _flag_bool if isinstance(field.default, bool) else type(field.default)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default)


def _flag_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")


def _export_parser(sub, name: str, help: str, run: Path, quality: str, recipe: str) -> argparse.ArgumentParser:
    ex = sub.add_parser(name, help=help)
    ex.add_argument("--run", type=Path, default=run)
    ex.add_argument("--dest", type=Path, default=None)
    ex.add_argument("--quality", type=Path, default=None, help=f"JSON written by `{quality} --out`")
    ex.add_argument("--recipe", default=recipe, help="the command that produced it (for the card)")
    ex.add_argument("--note", default="", help="extra text for the card (e.g. caveats about the compute ledger)")
    return ex


def _answer_flags(parser: argparse.ArgumentParser, *, ood: bool = False) -> None:
    parser.set_defaults(ood=ood)
    parser.add_argument("--target", default="embedded", help="a Llama-family target: preset, hub id or directory")
    parser.add_argument("--ids-dir", type=Path, default=None, help="token-id shards (default: by target)")
    parser.add_argument("--features-dir", type=Path, default=None, help="feature shards (default: by target)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto", help="auto: CUDA when present")
    parser.add_argument("--threads", type=int, default=None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dynatree_core.training")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("gen-data", help="sample on-policy training text from the embedded target")
    gen.add_argument("--out", type=Path, default=COMMITTED / "onpolicy")
    gen.add_argument("--chunks", type=int, default=100)
    gen.add_argument("--batch", type=int, default=48)
    gen.add_argument("--new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--dtype", default="bfloat16")
    gen.add_argument("--threads", type=int, default=None)
    gen.add_argument("--device", default="auto", help="auto: CUDA when present")
    data_root = cache_dir() / "draft-data"
    ans = sub.add_parser("answers", help="on-policy answers to the source pool, features kept (resumable shards)")
    _answer_flags(ans)
    ans.add_argument("--stages", default="questions,main,follow", help="comma-separated, run in order")
    ans.add_argument("--max-shards", type=int, default=None, help="stop after writing this many shards")
    ans.add_argument("--main-shards", type=int, default=None, help="the main stage's shards in all (default: all)")
    ans.add_argument("--batch", type=int, default=64, help="rows decoded together")
    ans.add_argument("--seed", type=int, default=0)
    ood = sub.add_parser("ood-answers", help="the target's greedy answers to the OOD prompt set, features kept")
    _answer_flags(ood, ood=True)
    vm = sub.add_parser("vocab-map", help="rebuild the draft's reduced vocabulary from the answers; OOD coverage")
    vm.add_argument("--target", default="embedded")
    vm.add_argument("--sizes", default="16384,24576,32768", help="map sizes to rebuild and compare")
    vm.add_argument(
        "--current", type=Path, default=None, help="a draft directory whose map to compare (default: shipped)"
    )
    vm.add_argument("--out", type=Path, default=None, help="write the first size's token_map.json into this directory")
    rel = sub.add_parser("answers-relabel", help="recompute missing answer features from the committed ids")
    _answer_flags(rel)
    rel.add_argument("--batch", type=int, default=16)
    rel.add_argument("--taps", default="", help='also the inputs of these layers: "eagle3" or e.g. "2,15,27"')
    rel.add_argument("--teacher", action="store_true", help="also the compact teacher at every loss position")
    rel.add_argument("--stages", default="questions,main,follow,ood", help="comma-separated, in this order")
    rel.add_argument("--ood", action="store_true", help="the OOD answers' store (ood-answers), not the training one")
    rel.add_argument("--max-shards", type=int, default=None, help="relabel at most this many shards in this call")
    wr = sub.add_parser("answers-written", help="human-written text as teacher-forced assistant turns (stage written)")
    _answer_flags(wr)
    wr.add_argument("--seed", type=int, default=0)
    cor = sub.add_parser("corpus", help="assemble training windows (docs, fortunes, on-policy chunks)")
    cor.add_argument("--out", type=Path, default=COMMITTED / "corpus.npz")
    cor.add_argument("--chunks-dir", type=Path, default=COMMITTED / "onpolicy")
    cor.add_argument("--max-text-windows", type=int, default=6000)
    lab = sub.add_parser("label", help="target top-k labels for every window (resumable shards)")
    lab.add_argument("--corpus", type=Path, default=COMMITTED / "corpus.npz")
    lab.add_argument("--labels", type=Path, default=data_root / "labels")
    lab.add_argument("--shards", type=int, default=None, help="label only the first N shards")
    lab.add_argument("--device", default="auto", help="auto: CUDA when present")
    lab.add_argument("--batch", type=int, default=8)
    tl = sub.add_parser("talf-label", help="target EAGLE-2 beam trees at sampled roots, for TALF")
    tl.add_argument("--corpus", type=Path, default=COMMITTED / "corpus.npz")
    tl.add_argument("--out", type=Path, default=data_root / "talf_trees.npz")
    tl.add_argument("--rows", type=int, default=1500)
    tl.add_argument("--roots", type=int, default=8)
    tr = sub.add_parser("train", help="distil the draft (resumable)")
    tr.add_argument("--corpus", type=Path, default=COMMITTED / "corpus.npz")
    tr.add_argument("--labels", type=Path, default=data_root / "labels")
    tr.add_argument("--out", type=Path, default=cache_dir() / "draft-runs" / "kd")
    tr.add_argument("--talf-trees", type=Path, default=data_root / "talf_trees.npz")
    tr.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from a checkpoint.pt or a saved draft directory (weights only)",
    )
    from dynatree_core.training.train import TrainConfig

    _config_flags(tr, TrainConfig)
    fl = sub.add_parser("feature-label", help="the target's final hidden states for the windows (feature draft)")
    fl.add_argument("--corpus", type=Path, default=COMMITTED / "corpus.npz")
    fl.add_argument("--features", type=Path, default=data_root / "features")
    fl.add_argument("--onpolicy-only", action="store_true", help="only the shards holding on-policy windows")
    fl.add_argument("--batch", type=int, default=8)
    fl.add_argument("--device", default="auto")
    fl.add_argument("--dtype", default="auto", help="the target's dtype while labelling (auto: bfloat16)")
    tf = sub.add_parser("train-feature", help="distil the feature draft from the stored features (resumable)")
    tf.add_argument("--corpus", type=Path, default=COMMITTED / "corpus.npz")
    tf.add_argument("--features", type=Path, default=data_root / "features")
    tf.add_argument("--out", type=Path, default=cache_dir() / "draft-runs" / "feature-kd")
    tf.add_argument("--token-map", type=Path, default=REPO_ROOT / "assets" / "models" / "smollm2-draft")
    tf.add_argument("--init-from", type=Path, default=None, help="a saved feature draft to start from (weights only)")
    tf.add_argument("--data", choices=("corpus", "answers"), default="corpus", help="answers: the answer shards")
    tf.add_argument("--target", default="embedded", help="the target whose features the draft reads")
    tf.add_argument(
        "--talf-trees", type=Path, default=data_root / "talf_trees.npz", help="target trees for --loss talf"
    )
    from dynatree_core.training.feature import FeatureTrainConfig

    _config_flags(tf, FeatureTrainConfig)
    tp = sub.add_parser("train-packed", help="the cheap step over packed answer windows, a long resumable schedule")
    tp.add_argument("--kind", choices=("feature", "fused"), default="fused", help="fused: EAGLE-3's three taps")
    tp.add_argument("--target", default="embedded", help="the target whose answers and states the draft reads")
    tp.add_argument("--taps", default="eagle3", help='fused kind: "eagle3" or comma-separated layer inputs')
    tp.add_argument(
        "--fc-norm",
        choices=("per_tap", "none", "concat"),
        default="per_tap",
        help='fused kind: how the taps are normed before fc; "none" is the form SGLang and vLLM serve '
        "(export-feature --layout eagle3 writes no other)",
    )
    tp.add_argument("--token-map", type=Path, default=REPO_ROOT / "assets" / "models" / "smollm2-feature-draft")
    tp.add_argument("--init-from", type=Path, default=None, help="a saved draft of the same kind (weights only)")
    tp.add_argument("--out", type=Path, default=cache_dir() / "draft-runs" / "packed")
    tp.add_argument("--stages", default="questions,main,follow", help='answer stages to train on ("written": text)')
    from dynatree_core.training.step import PackedTrainConfig

    _config_flags(tp, PackedTrainConfig)
    fq = sub.add_parser("feature-quality", help="held-out agreement by depth: feature draft(s) vs the token draft")
    fq.add_argument("--draft", type=Path, nargs="+", required=True, help="feature draft directories")
    fq.add_argument(
        "--token-draft", type=Path, default=None, help="default: the embedded token draft (embedded target)"
    )
    fq.add_argument("--corpus", type=Path, default=COMMITTED / "corpus.npz")
    fq.add_argument("--features", type=Path, default=data_root / "features")
    fq.add_argument("--out", type=Path, default=None, help="write the numbers as JSON")
    fq.add_argument("--answers", action="store_true", help="held-out answer shards and the OOD answers, side by side")
    fq.add_argument("--target", default="embedded")
    fq.add_argument("--no-token-draft", action="store_true", help="report the feature drafts only")
    exf = _export_parser(
        sub,
        "export-feature",
        "ship a trained feature draft into assets/models/ with its card",
        cache_dir() / "draft-runs" / "feature-kd",
        "feature-quality",
        "make draft-feature",
    )
    exf.add_argument("--target", default="embedded", help="the target the draft reads (not embedded: give --dest)")
    exf.add_argument(
        "--layout", choices=("dynatree", "eagle3"), default="dynatree",
        help="eagle3: the layout SGLang and vLLM load (a fused-kind draft without tap norms only; needs --dest)",
    )  # fmt: skip
    exf.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16",
        help="eagle3 layout: the weights' dtype (float32 reads back with identical logits)",
    )  # fmt: skip
    qu = sub.add_parser("quality", help="measure a draft: agreement, tokens/iteration, step cost")
    qu.add_argument("--draft", type=Path, nargs="+", required=True, help="one or more draft directories")
    qu.add_argument("--corpus", type=Path, default=COMMITTED / "corpus.npz")
    qu.add_argument("--labels", type=Path, default=data_root / "labels")
    qu.add_argument("--prompts", default="all")
    qu.add_argument("--max-new-tokens", type=int, default=64)
    qu.add_argument("--out", type=Path, default=None, help="write the numbers as JSON")
    _export_parser(
        sub,
        "export",
        "copy a trained draft into assets/models/ with its model card",
        cache_dir() / "draft-runs" / "kd",
        "quality",
        "make draft",
    )
    args = parser.parse_args(argv)
    if args.command in ("answers", "answers-relabel", "ood-answers", "answers-written"):
        _answers(args)
    elif args.command == "vocab-map":
        _vocab_map(args)
    elif args.command == "corpus":
        from dynatree_core.core.models import load_model
        from dynatree_core.training.corpus import build_corpus

        tok = load_model("embedded", device="cpu", dtype="float32").tokenizer
        data = build_corpus(args.out, args.chunks_dir, tok, max_text_windows=args.max_text_windows)
        print(f"corpus: {len(data['ids'])} windows, {int(data['lengths'].sum())} tokens -> {args.out}")
    elif args.command == "label":
        from dynatree_core.training.corpus import label_corpus

        label_corpus(args.corpus, args.labels, shards=args.shards, device=args.device, batch=args.batch)
    elif args.command == "feature-label":
        from dynatree_core.core.models import load_model
        from dynatree_core.training.feature_data import label_features, onpolicy_shards

        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        target = load_model("embedded", device=args.device, dtype=dtype).model
        shards = onpolicy_shards(args.corpus) if args.onpolicy_only else None
        label_features(args.corpus, args.features, target, shards=shards, batch=args.batch)
    elif args.command == "train-feature":
        from dynatree_core.core.models import load_model
        from dynatree_core.core.vocab import TokenMap
        from dynatree_core.training.feature import FeatureTrainConfig, train_feature_draft
        from dynatree_core.training.feature_data import FeatureCorpus

        cfg = FeatureTrainConfig(**{k: getattr(args, k) for k in FeatureTrainConfig.__dataclass_fields__})
        target = load_model(args.target, device=cfg.device, dtype="float32").model
        if args.data == "answers":
            from dynatree_core.training.answer_data import AnswerCorpus, source_summary
            from dynatree_core.training.answers import AnswerStore

            store = AnswerStore(*answer_dirs(args.target))
            data = AnswerCorpus(store)
            about = {"kind": "answers", **data.describe(), "sources": source_summary(store)}
        else:
            data, about = FeatureCorpus(args.corpus, args.features), None
        print(f"train-feature: {len(data.train_rows)} training windows, {len(data.eval_rows)} held out", flush=True)
        token_map = TokenMap.load(args.token_map) if args.token_map else None
        trees = None
        if cfg.loss == "talf":
            from dynatree_core.training.feature_talf import TargetTrees

            if not args.talf_trees.exists():
                raise SystemExit(f"--loss talf needs target trees at {args.talf_trees} (run talf-label first)")
            trees = TargetTrees(args.talf_trees, data.train_rows)
            print(f"train-feature: TALF over {len(trees)} windows' target trees", flush=True)
        train_feature_draft(
            target,
            token_map,
            data,
            args.out,
            cfg,
            init_from=args.init_from,
            trees=trees,
            about=about,
            log=lambda m: print(m, flush=True),
        )
        print(f"train-feature: saved {args.out / 'draft'}")
    elif args.command == "train-packed":
        _train_packed(args)
    elif args.command == "feature-quality":
        import json

        from dynatree_core.core.models import load_model
        from dynatree_core.drafts.feature import FeatureDraft
        from dynatree_core.training.feature import agreement_by_depth, token_draft_agreement
        from dynatree_core.training.feature_data import FeatureCorpus

        target = load_model(args.target, device="cpu", dtype="float32").model
        spec = args.token_draft or (
            REPO_ROOT / "assets" / "models" / "smollm2-draft" if args.target == "embedded" else None
        )
        token = None if args.no_token_draft or spec is None else load_model(str(spec), device="cpu", dtype="float32")
        if args.answers:
            from dynatree_core.training.answer_data import AnswerCorpus, agreement_report
            from dynatree_core.training.answers import AnswerStore

            seen = AnswerCorpus(AnswerStore(*answer_dirs(args.target)))
            ood = AnswerCorpus(AnswerStore(*answer_dirs(args.target, ood=True)), stages=("ood",), heldout=True)
            splits = {"in-distribution (held out)": (seen, seen.eval_rows), "out-of-distribution": (ood, ood.eval_rows)}
            result = agreement_report(target, args.draft, token, splits)
            print(json.dumps(result, indent=1))
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
            return
        data = FeatureCorpus(args.corpus, args.features)
        head = target.get_output_embeddings()
        result = {"heldout_windows": len(data.eval_rows), "heldout_tokens": int(data.lengths[data.eval_rows].sum())}
        if token is not None:
            agreement = token_draft_agreement(token.model, token.token_map, head, data, data.eval_rows)
            result[str(spec)] = {"kind": "token", "agreement": agreement}
        for path in args.draft:
            draft = FeatureDraft.load(path, target)
            result[str(path)] = {
                "kind": "feature",
                "agreement_by_depth": agreement_by_depth(draft, head, data, data.eval_rows),
            }
        print(json.dumps(result, indent=1))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    elif args.command == "export-feature":
        import json

        from dynatree_core.core.models import EMBEDDED_FEATURE_DRAFT_DIR, load_model
        from dynatree_core.training.feature_card import export_feature_draft

        target = load_model(args.target, device="cpu", dtype="float32").model
        quality = json.loads(args.quality.read_text()) if args.quality and args.quality.exists() else None
        if args.layout == "eagle3":
            import torch

            from dynatree_core.drafts.heads import load_head
            from dynatree_core.drafts.published import export_eagle3
            from dynatree_core.errors import DynaTreeError

            draft = load_head(str(args.run / "draft" if (args.run / "draft").is_dir() else args.run), target)
            if args.dest is None or draft.kind != "fused":
                raise SystemExit(
                    "export-feature --layout eagle3: a fused-kind draft (train-packed --kind fused) and --dest"
                )
            try:
                out = export_eagle3(draft, args.dest, target_name=args.target, dtype=getattr(torch, args.dtype))
                print(f"export-feature: {out}")
            except DynaTreeError as exc:
                raise SystemExit(f"export-feature: {exc}") from None
            return
        if args.dest is None and args.target != "embedded":
            raise SystemExit("export-feature: a draft for another target needs --dest (the default is the shipped one)")
        dest = args.dest or EMBEDDED_FEATURE_DRAFT_DIR
        export_feature_draft(args.run, dest, target, quality=quality, command=args.recipe, note=args.note)
        print(f"export-feature: {dest}")
    elif args.command == "talf-label":
        from dynatree_core.training.talf import label_trees

        label_trees(args.corpus, args.out, rows=args.rows, roots=args.roots)
    elif args.command == "quality":
        import json

        from dynatree_core.training.quality import decode_quality, heldout_agreement

        result = decode_quality(args.draft, args.prompts, args.max_new_tokens)
        for key in result:
            result[key]["heldout_agreement"] = heldout_agreement(Path(key), args.corpus, args.labels)
            print(f"quality: {key} held-out agreement {result[key]['heldout_agreement']:.3f}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    elif args.command == "export":
        from dynatree_core.core.models import EMBEDDED_DRAFT_DIR
        from dynatree_core.training.export import export

        export(
            args.run, args.dest or EMBEDDED_DRAFT_DIR, quality_json=args.quality, command=args.recipe, note=args.note
        )
        print(f"export: {args.dest or EMBEDDED_DRAFT_DIR}")
    elif args.command == "train":
        from dynatree_core.training.train import train

        cfg = TrainConfig(**{k: getattr(args, k) for k in TrainConfig.__dataclass_fields__})
        saved = train(args.out, args.corpus, args.labels, cfg, talf_trees=args.talf_trees, init_from=args.init_from)
        print(f"train: saved {saved}")
    if args.command == "gen-data":
        from dynatree_core.training.data import run

        run(
            args.out,
            chunks=args.chunks,
            batch=args.batch,
            new_tokens=args.new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            dtype=args.dtype,
            threads=args.threads,
            device=args.device,
        )


if __name__ == "__main__":
    main()
