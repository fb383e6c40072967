"""The token draft's commands (`make draft`): gen-data, corpus, label, train, quality, export."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynatree_core.training.cli import (
    COMMITTED,
    CORPUS,
    Command,
    config_flags,
    config_from,
    data_root,
    export_flags,
    runs_root,
)


def _gen_data_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=COMMITTED / "onpolicy")
    p.add_argument("--chunks", type=int, default=100)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto: CUDA when present")


def _gen_data(args: argparse.Namespace) -> None:
    from dynatree_core.training.token.sample import run

    run(args.out, chunks=args.chunks, batch=args.batch, new_tokens=args.new_tokens, temperature=args.temperature,
        top_p=args.top_p, dtype=args.dtype, threads=args.threads, device=args.device)  # fmt: skip


def _corpus_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=CORPUS)
    p.add_argument("--chunks-dir", type=Path, default=COMMITTED / "onpolicy")
    p.add_argument("--max-text-windows", type=int, default=6000)


def _corpus(args: argparse.Namespace) -> None:
    from dynatree_core.core.models import load_model
    from dynatree_core.training.token.corpus import build_corpus

    tok = load_model("embedded", device="cpu", dtype="float32").tokenizer
    data = build_corpus(args.out, args.chunks_dir, tok, max_text_windows=args.max_text_windows)
    print(f"corpus: {len(data['ids'])} windows, {int(data['lengths'].sum())} tokens -> {args.out}")


def _label_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--labels", type=Path, default=data_root() / "labels")
    p.add_argument("--shards", type=int, default=None, help="label only the first N shards")
    p.add_argument("--device", default="auto", help="auto: CUDA when present")
    p.add_argument("--batch", type=int, default=8)


def _label(args: argparse.Namespace) -> None:
    from dynatree_core.training.token.corpus import label_corpus

    label_corpus(args.corpus, args.labels, shards=args.shards, device=args.device, batch=args.batch)


def _train_flags(p: argparse.ArgumentParser) -> None:
    from dynatree_core.training.token.train import TrainConfig

    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--labels", type=Path, default=data_root() / "labels")
    p.add_argument("--out", type=Path, default=runs_root() / "kd")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from a checkpoint.pt or a saved draft directory (weights only)")  # fmt: skip
    config_flags(p, TrainConfig)


def _train(args: argparse.Namespace) -> None:
    from dynatree_core.training.token.train import TrainConfig, train

    saved = train(args.out, args.corpus, args.labels, config_from(args, TrainConfig), init_from=args.init_from)
    print(f"train: saved {saved}")


def _quality_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", type=Path, nargs="+", required=True, help="one or more draft directories")
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--labels", type=Path, default=data_root() / "labels")
    p.add_argument("--prompts", default="all")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="write the numbers as JSON")


def _quality(args: argparse.Namespace) -> None:
    import json

    from dynatree_core.training.token.quality import decode_quality, heldout_agreement

    result = decode_quality(args.draft, args.prompts, args.max_new_tokens)
    for key in result:
        result[key]["heldout_agreement"] = heldout_agreement(Path(key), args.corpus, args.labels)
        print(f"quality: {key} held-out agreement {result[key]['heldout_agreement']:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


def _export_flags(p: argparse.ArgumentParser) -> None:
    export_flags(p, run=runs_root() / "kd", quality="quality", recipe="make draft")


def _export(args: argparse.Namespace) -> None:
    from dynatree_core.core.presets import EMBEDDED_DRAFT_DIR
    from dynatree_core.training.card import export_token_draft

    dest = args.dest or EMBEDDED_DRAFT_DIR
    export_token_draft(args.run, dest, quality_json=args.quality, command=args.recipe, note=args.note)
    print(f"export: {dest}")


COMMANDS = {
    "gen-data": Command("sample on-policy training text from the embedded target", _gen_data_flags, _gen_data),
    "corpus": Command("assemble training windows (docs, fortunes, on-policy chunks)", _corpus_flags, _corpus),
    "label": Command("target top-k labels for every window (resumable shards)", _label_flags, _label),
    "train": Command("distil the draft (resumable)", _train_flags, _train),
    "quality": Command("measure a draft: agreement, tokens/iteration, step cost", _quality_flags, _quality),
    "export": Command("copy a trained draft into assets/models/ with its model card", _export_flags, _export),
}
