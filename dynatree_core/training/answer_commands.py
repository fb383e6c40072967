"""The answer-data commands of `python -m dynatree_core.training`: where a target's answer shards
live, the answers / relabel / vocab-map stages, and the packed training run (train-packed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynatree_core.core.models import REPO_ROOT, cache_dir
from dynatree_core.runs.environment import portable

# Token ids (uint16) are small and committed, so training can continue on a fresh machine;
# labels, target trees and checkpoints are recomputed into the cache.
COMMITTED = REPO_ROOT / "assets" / "draft-data"


def answer_dirs(
    target: str, ids_dir: Path | None = None, features_dir: Path | None = None, *, ood: bool = False
) -> tuple[Path, Path]:
    """Where a target's answer shards live (`ood`: its answers to the OOD set, kept apart): the
    embedded target's ids are committed, any other target's stay in the cache (under a directory
    named after its spec); features always live in the cache."""
    slug = "embedded" if target == "embedded" else "".join(c if c.isalnum() else "-" for c in target).strip("-")
    name = "ood-answers" if ood else "answers"
    ids = COMMITTED / name if target == "embedded" else cache_dir() / "draft-data" / slug / name
    feats = cache_dir() / "draft-data" / slug / ("ood-answer-features" if ood else "answer-features")
    return ids_dir or ids, features_dir or feats


def _answers(args: argparse.Namespace) -> None:
    import torch

    from dynatree_core.core.models import load_model
    from dynatree_core.core.packing import pack_linears, packing_enabled
    from dynatree_core.training.answers import AnswerStore, generate, ood_answers, relabel

    if args.threads:
        torch.set_num_threads(args.threads)
    stages, limits = stage_spec(getattr(args, "stages", ""))
    store = AnswerStore(*answer_dirs(args.target, args.ids_dir, args.features_dir, ood=args.ood), limits)
    target = load_model(args.target, device=args.device, dtype=args.dtype)
    if packing_enabled(target.device, target.dtype):
        pack_linears(target.model)
    if args.command == "ood-answers":
        ood_answers(store, target, log=print_now)
        return
    if args.command == "answers-written":
        from dynatree_core.training.written import write_written

        vocab = target.model.config.get_text_config(decoder=True).vocab_size
        end = target.tokenizer.eos_token_id  # the end of an assistant turn (e.g. <|im_end|>)
        end = min(target.eos_token_ids) if end is None else end
        n = write_written(store, target.tokenizer, end, vocab, seed=args.seed, log=print_now)
        print_now(f"answers-written: {n} shards written to {portable(str(store.ids_dir))}; "
                  "next: answers-relabel --stages written --teacher")  # fmt: skip
        return
    if args.command == "answers-relabel":
        n_layers = target.model.config.get_text_config(decoder=True).num_hidden_layers
        taps = parse_taps(args.taps, n_layers)
        n = relabel(store, target, batch=args.batch, taps=taps, teacher=args.teacher, stages=stages,
                    max_shards=args.max_shards, log=print_now)  # fmt: skip
        print(f"answers-relabel: {n} shards relabelled", flush=True)
        return
    log = lambda m: print(m, flush=True)  # noqa: E731
    n = generate(store, target, stages=stages, max_shards=args.max_shards, main_shards=args.main_shards,
                 batch=args.batch, seed=args.seed, log=log)  # fmt: skip
    print(f"answers: {n} shards written to {store.ids_dir}", flush=True)


def stage_spec(spec: str) -> tuple[tuple[str, ...], dict[str, int]]:
    """--stages "questions,main,written:8": the stages in order, and those cut to their first N shards."""
    stages, limits = [], {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, _, n = part.partition(":")
        if n and not n.isdigit():
            raise SystemExit(f"--stages: {part!r}: write a stage as NAME or NAME:SHARDS")
        stages.append(name)
        if n:
            limits[name] = int(n)
    return tuple(stages), limits


def print_now(message: str) -> None:
    print(message, flush=True)


def parse_taps(spec: str, n_layers: int) -> tuple[int, ...]:
    """--taps: "" (none), "eagle3" (core/taps.eagle3_taps) or comma-separated layer inputs."""
    from dynatree_core.core.taps import check_taps, eagle3_taps

    if not spec:
        return ()
    if spec == "eagle3":
        return eagle3_taps(n_layers)
    try:
        return check_taps(tuple(int(t) for t in spec.split(",")), n_layers)
    except ValueError as exc:
        raise SystemExit(f"--taps: {exc}") from None


def _train_packed(args: argparse.Namespace) -> None:
    import numpy as np

    from dynatree_core.core.models import load_model
    from dynatree_core.core.vocab import TokenMap
    from dynatree_core.core.weights import load_weights
    from dynatree_core.drafts.feature import FeatureDraft
    from dynatree_core.drafts.fused import FusedDraft
    from dynatree_core.training.answer_data import source_summary
    from dynatree_core.training.answers import STAGES, AnswerStore
    from dynatree_core.training.packed import PackedAnswers
    from dynatree_core.training.step import PackedTrainConfig, train_packed

    cfg = PackedTrainConfig(**{k: getattr(args, k) for k in PackedTrainConfig.__dataclass_fields__})
    target = load_model(args.target, device=cfg.device, dtype="float32").model
    n_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    taps = parse_taps(args.taps, n_layers) if args.kind == "fused" else None
    token_map = TokenMap.load(args.token_map)
    stages, limits = stage_spec(args.stages)
    store = AnswerStore(*answer_dirs(args.target), limits)
    data = PackedAnswers(store, token_map, taps=taps, stages=stages)
    ood = PackedAnswers(
        AnswerStore(*answer_dirs(args.target, ood=True)), token_map, taps=taps, stages=("ood",), heldout=True
    )
    if not len(data.train_rows):
        what = f"--taps {args.taps} --teacher" if taps else "--teacher"
        raise SystemExit(
            f"train-packed: no answer shard has its teacher (and taps); run `answers-relabel {what}` first"
        )
    # the held-out check reads the answer stages only, so runs on different stages compare
    answer_rows = data.eval_rows[np.isin(data.windows.stage_of(data.eval_rows), STAGES)]
    heldout = np.random.default_rng(0).permutation(answer_rows)[: cfg.eval_windows]
    evals = (
        {"heldout": (data, np.sort(heldout)), "ood": (ood, ood.eval_rows)}
        if len(ood.eval_rows)
        else {"heldout": (data, heldout)}
    )
    if args.kind == "fused":
        draft = FusedDraft.from_target(target, token_map, taps=taps, seed=cfg.seed, fc_norm=args.fc_norm)
        start = FusedDraft.load(args.init_from, target) if args.init_from else None
    else:
        draft = FeatureDraft.from_target(target, token_map, seed=cfg.seed)
        start = FeatureDraft.load(args.init_from, target) if args.init_from else None
    if start is not None and not (args.out / "checkpoint.pt").exists():
        # everything but the head: this run's head is the target's rows for its own token map
        head = "lm_head" if args.kind == "fused" else "lm.lm_head"
        weights = {k: v for k, v in start.state_dict().items() if not (k == head or k.startswith(head + "."))}
        load_weights(draft, weights, what=str(args.init_from), allow_missing=(head,))
        print_now(f"train-packed: initialised from {args.init_from}")
    pairs = data.answer_pairs()
    print_now(f"train-packed: {args.kind} kind, {len(data.train_rows)} training windows ({pairs:,} answer pairs), "
              f"{len(heldout)} held-out and {len(ood.eval_rows)} OOD windows evaluated")  # fmt: skip
    about = {"kind": "answers", **data.windows.describe(), "sources": source_summary(store, stages)}
    if args.init_from:
        about["init_from"] = portable(str(args.init_from))
    train_packed(
        draft, data, args.out, cfg, target_head=target.get_output_embeddings(), evals=evals, about=about, log=print_now
    )


def _vocab_map(args: argparse.Namespace) -> None:
    import json

    from dynatree_core.core.models import load_model
    from dynatree_core.core.vocab import TokenMap
    from dynatree_core.training.answer_data import vocab_report
    from dynatree_core.training.answers import AnswerStore

    target = load_model(args.target, device="cpu", dtype="float32")
    vocab = target.model.config.get_text_config(decoder=True).vocab_size
    sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    report, maps = vocab_report(
        AnswerStore(*answer_dirs(args.target)),
        AnswerStore(*answer_dirs(args.target, ood=True)),
        sizes,
        vocab,
        current=TokenMap.load(args.current or REPO_ROOT / "assets" / "models" / "smollm2-feature-draft")
        if args.current or args.target == "embedded"
        else None,
        always=sorted(target.eos_token_ids),
    )
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        maps[sizes[0]].save(args.out)
        print(f"vocab-map: {args.out / 'token_map.json'} ({sizes[0]} slots)")
