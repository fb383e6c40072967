"""The answer data's commands (`make draft-feature-stages`, `-long`): answers, ood-answers,
answers-relabel, answers-written, vocab-map (the reduced vocabulary rebuilt from the answers) and
prompt-pack (the prompts of every offline source, in one file for a GPU machine)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynatree_core.runs.environment import portable
from dynatree_core.training.cli import SHIPPED, Command, answer_dirs, data_root, print_now


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


def _store_flags(p: argparse.ArgumentParser, *, ood: bool = False) -> None:
    p.set_defaults(ood=ood)
    p.add_argument("--target", default="embedded", help="a Llama-family target: preset, hub id or directory")
    p.add_argument("--ids-dir", type=Path, default=None, help="token-id shards (default: by target)")
    p.add_argument("--features-dir", type=Path, default=None, help="feature shards (default: by target)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", help="auto: CUDA when present")
    p.add_argument("--threads", type=int, default=None)


def _store_and_target(args: argparse.Namespace):
    """The answer store the command writes (its stages cut as --stages says) and the target, packed."""
    import torch

    from dynatree_core.core.models import load_model
    from dynatree_core.core.packing import pack_linears, packing_enabled
    from dynatree_core.training.answers.store import AnswerStore

    if args.threads:
        torch.set_num_threads(args.threads)
    stages, limits = stage_spec(getattr(args, "stages", ""))
    store = AnswerStore(*answer_dirs(args.target, args.ids_dir, args.features_dir, ood=args.ood), limits)
    target = load_model(args.target, device=args.device, dtype=args.dtype)
    if packing_enabled(target.device, target.dtype):
        pack_linears(target.model)
    return store, target, stages


def _answers_flags(p: argparse.ArgumentParser) -> None:
    _store_flags(p)
    p.add_argument("--stages", default="questions,main", help="comma-separated, run in order")
    p.add_argument("--max-shards", type=int, default=None, help="stop after writing this many shards")
    p.add_argument("--main-shards", type=int, default=None, help="the main stage's shards in all (default: all)")
    p.add_argument("--batch", type=int, default=64, help="rows decoded together")
    p.add_argument("--seed", type=int, default=0)


def _answers(args: argparse.Namespace) -> None:
    from dynatree_core.training.answers.store import generate

    store, target, stages = _store_and_target(args)
    n = generate(store, target, stages=stages, max_shards=args.max_shards, main_shards=args.main_shards,
                 batch=args.batch, seed=args.seed, log=print_now)  # fmt: skip
    print_now(f"answers: {n} shards written to {store.ids_dir}")


def _ood_answers(args: argparse.Namespace) -> None:
    from dynatree_core.training.answers.store import ood_answers

    store, target, _ = _store_and_target(args)
    ood_answers(store, target, log=print_now)


def _relabel_flags(p: argparse.ArgumentParser) -> None:
    _store_flags(p)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--taps", default="", help='also the inputs of these layers: "eagle3" or e.g. "2,15,27"')
    p.add_argument("--teacher", action="store_true", help="also the compact teacher at every loss position")
    p.add_argument("--stages", default="questions,main,ood", help="comma-separated, in this order")
    p.add_argument("--ood", action="store_true", help="the OOD answers' store (ood-answers), not the training one")
    p.add_argument("--max-shards", type=int, default=None, help="relabel at most this many shards in this call")


def _relabel(args: argparse.Namespace) -> None:
    from dynatree_core.training.answers.store import relabel

    store, target, stages = _store_and_target(args)
    taps = parse_taps(args.taps, target.model.config.get_text_config(decoder=True).num_hidden_layers)
    n = relabel(store, target, batch=args.batch, taps=taps, teacher=args.teacher, stages=stages,
                max_shards=args.max_shards, log=print_now)  # fmt: skip
    print_now(f"answers-relabel: {n} shards relabelled")


def _written_flags(p: argparse.ArgumentParser) -> None:
    _store_flags(p)
    p.add_argument("--seed", type=int, default=0)


def _written(args: argparse.Namespace) -> None:
    from dynatree_core.training.answers.written import write_written

    store, target, _ = _store_and_target(args)
    vocab = target.model.config.get_text_config(decoder=True).vocab_size
    end = target.tokenizer.eos_token_id  # the end of an assistant turn (e.g. <|im_end|>)
    end = min(target.eos_token_ids) if end is None else end
    n = write_written(store, target.tokenizer, end, vocab, seed=args.seed, log=print_now)
    print_now(f"answers-written: {n} shards written to {portable(str(store.ids_dir))}; "
              "next: answers-relabel --stages written --teacher")  # fmt: skip


def _vocab_map_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="embedded")
    p.add_argument("--sizes", default="16384,24576,32768", help="map sizes to rebuild and compare")
    p.add_argument(
        "--current", type=Path, default=None, help="a draft directory whose map to compare (default: shipped)"
    )
    p.add_argument("--out", type=Path, default=None, help="write the first size's token_map.json into this directory")


def _vocab_map(args: argparse.Namespace) -> None:
    import json

    from dynatree_core.core.models import load_model
    from dynatree_core.core.vocab import TokenMap
    from dynatree_core.training.answers.store import AnswerStore
    from dynatree_core.training.answers.windows import vocab_report

    target = load_model(args.target, device="cpu", dtype="float32")
    vocab = target.model.config.get_text_config(decoder=True).vocab_size
    sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    current = args.current or (SHIPPED / "smollm2-feature-draft" if args.target == "embedded" else None)
    report, maps = vocab_report(
        AnswerStore(*answer_dirs(args.target)),
        AnswerStore(*answer_dirs(args.target, ood=True)),
        sizes,
        vocab,
        current=TokenMap.load(current) if current else None,
        always=sorted(target.eos_token_ids),
    )
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        maps[sizes[0]].save(args.out)
        print(f"vocab-map: {args.out / 'token_map.json'} ({sizes[0]} slots)")


def _pack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None, help="default: <cache>/draft-data/prompt-pack.jsonl.gz")
    p.add_argument("--prompts", type=int, default=260_000, help="about this many prompts in all")
    p.add_argument("--seed", type=int, default=0)


def _prompt_pack(args: argparse.Namespace) -> None:
    import time

    from dynatree_core.training.answers.pack import build_pack, source_table, table_markdown, write_pack

    t0 = time.perf_counter()
    header, jobs = build_pack(args.seed, target_prompts=args.prompts, log=print_now)
    out = args.out or data_root() / "prompt-pack.jsonl.gz"
    size = write_pack(out, header, jobs)
    print_now(table_markdown(source_table(header)))
    print_now(f"prompt-pack: {len(jobs):,} prompts ({header['ood_dropped']} dropped for sharing text with the "
              f"OOD set, {header['duplicates_dropped']} as repeats), {size / 1e6:.1f} MB, "
              f"{time.perf_counter() - t0:.0f} s: {portable(str(out))}")  # fmt: skip


COMMANDS = {
    "answers": Command(
        "on-policy answers to the source pool, features kept (resumable shards)", _answers_flags, _answers
    ),  # fmt: skip
    "ood-answers": Command(
        "the target's greedy answers to the OOD prompt set, features kept",
        lambda p: _store_flags(p, ood=True),
        _ood_answers,
    ),  # fmt: skip
    "vocab-map": Command(
        "rebuild the draft's reduced vocabulary from the answers; OOD coverage", _vocab_map_flags, _vocab_map
    ),  # fmt: skip
    "answers-relabel": Command("recompute missing answer features from the committed ids", _relabel_flags, _relabel),
    "answers-written": Command(
        "human-written text as teacher-forced assistant turns (stage written)", _written_flags, _written
    ),  # fmt: skip
    "prompt-pack": Command(
        "the prompts of every offline source, several instructions each, in one file", _pack_flags, _prompt_pack
    ),  # fmt: skip
}
