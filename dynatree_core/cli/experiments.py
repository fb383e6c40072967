"""The CLI's one-prompt experiments, the two the pages also run: `compare` (policies side by side)
and `lab` (one verifier's first-token law against the target's). Each can write its report
(`--out`) stamped with the machine, the date and the command, as the pages' opening views read it."""

from __future__ import annotations

import json

from dynatree_core.cli.commands import (
    _Progress,
    _read_prompt,
    _refuse_long_prompt,
    _resolve_models,
    load_run,
    ray_workers,
    stamp,
)
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.environment import portable


def _pair_and_config(args):
    """The prompt, the loaded pair, its engine config and the models as a report records them."""
    prompt = _read_prompt(args)
    target_spec, draft_spec = _resolve_models(args)
    _refuse_long_prompt(target_spec, prompt, args.chat)  # before any model loads, as `generate` does
    pair, config = load_run(args, target_spec, draft_spec)
    models = {"target": portable(target_spec), "draft": portable(draft_spec or ""), "device": args.device}
    return prompt, pair, config, {**models, "dtype": args.dtype}


def _encode(args, pair, prompt: str) -> list[int]:
    from dynatree_core.decoding.pairs import encode_prompt

    chat = args.chat if args.chat is not None else pair.target.has_chat_template
    return encode_prompt(pair.target.tokenizer, prompt, chat=chat)


def cmd_compare(args) -> None:
    from dynatree_core.measure.compare import compare
    from dynatree_core.measure.entries import parse_entries

    entries = parse_entries(args.policy or ["linear", "fixed_tree", "dynatree", "salf"])
    prompt, pair, config, models = _pair_and_config(args)
    workers = ray_workers(args, *_resolve_models(args))
    with _Progress() as progress:
        result = compare(
            pair,
            entries,
            _encode(args, pair, prompt),
            config=config,
            repetitions=args.repetitions,
            include_hf=not args.no_hf,
            prompt=prompt,
            models=models,
            on_progress=progress,
            tokenizer=pair.target.tokenizer,
            workers=workers,
        )
    for name, value in stamp(args, pair.target.model, pair.dtype_source).items():
        setattr(result, name, value)
    if workers is not None:  # where the runs ran: each worker's host, device and threads
        result.environment["workers"] = workers.places
    if args.csv is not None:
        args.csv.write_text(result.csv(), encoding="utf-8")
    if args.out is not None:
        args.out.write_text(result.to_json(indent=1), encoding="utf-8")
    if args.json:
        print(result.to_json(indent=2))
        return
    print(result.markdown())
    mark = {True: "OK", False: "DIFFERS", None: "not checked"}[result.correctness["ok"]]
    print(f"\ncorrectness: {mark}: {result.correctness['message']}")


def cmd_lab(args) -> None:
    from dynatree_core.decoding.methods import verifier_for
    from dynatree_core.drafting import make_policy
    from dynatree_core.measure.entries import parse_entries
    from dynatree_core.measure.lab import chi_square_critical, lab_report, run_lab

    if args.temperature <= 0:
        raise DynaTreeError("the lab checks a sampled law: --temperature must be above 0")
    if args.trials < 1:
        raise DynaTreeError(f"--trials must be at least 1, got {args.trials}")
    entry = parse_entries([args.policy])[0]
    policy = make_policy(entry.policy, entry.params)
    prompt, pair, config, models = _pair_and_config(args)
    verifier = verifier_for(policy, config)  # an invalid pairing is refused before the work
    context = _encode(args, pair, prompt)
    with _Progress("step") as progress:
        result = run_lab(
            pair.target.model,
            context,
            policy,
            config,
            args.trials,
            **pair.drafting(policy),
            progress=lambda done: progress(done, args.trials, verifier),
        )
    stat, dof = result.chi_square()
    decode = pair.target.tokenizer.decode
    about = {
        "verifier": verifier,
        "policy": entry.policy,
        "params": dict(policy.config),
        "temperature": config.sampling.temperature,
        "top_p": config.sampling.top_p,
        "prompt": prompt,
        "context_tokens": len(context),
        "models": models,
        "trials": args.trials,
        "chi_square": stat,
        "dof": dof,
        **stamp(args, pair.target.model, pair.dtype_source),
    }
    report = lab_report(result, lambda t: decode([t]), about)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    if args.json:
        print(json.dumps(report, indent=2))
        return
    critical = chi_square_critical(dof)
    verdict = "consistent" if stat < critical else "NOT consistent"
    print(f"{verifier} on {entry.policy}: chi-square {stat:.1f} ({dof} dof), critical at 0.001: {critical:.1f}")
    print(f"the first committed token's histogram over {args.trials} steps is {verdict} with the target's law")
