"""The CLI's commands: each `cmd_<name>(args)` runs one subcommand of `python -m dynatree_core`
(arguments from parser.py); input errors are DynaTreeErrors, which `main` turns into one line."""

from __future__ import annotations

import dataclasses
import datetime
import json
import shlex
import sys

from tqdm import tqdm

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.settings import RunSpec
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.environment import portable


class _Progress:
    """A tqdm bar on stderr fed by progress callbacks (done, total, label); a context manager."""

    def __init__(self, unit: str = "run"):
        self.unit, self.bar = unit, None

    def __call__(self, done: int, total: int, label: str) -> None:
        if self.bar is None or self.bar.total != total:
            self.close()
            self.bar = tqdm(total=total, unit=self.unit, file=sys.stderr, dynamic_ncols=True)
        self.bar.set_postfix_str(label[:60], refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def forward_settings(args) -> ForwardSettings:
    """The run's ForwardSettings from the engine flags (None: auto, the override or the library's rule)."""
    auto = {"on": True, "off": False}  # auto: None, the library's choice
    return ForwardSettings(
        static_cache=False if args.no_static_cache else None,
        fast_forward=False if args.no_fast_forward else None,
        graphs=False if args.no_graphs else None,
        **{k: auto.get(getattr(args, k)) for k in ("width_invariant", "device_draft", "device_verify")},
    )


def command_line(args) -> str:
    """The command as a report records it (this machine's paths made portable)."""
    return portable("python -m dynatree_core " + shlex.join(args.argv))


def stamp(args, model, dtype_source: str, forward_path: str = "") -> dict:
    """What a report records about its run: the environment, the date and the command."""
    from dynatree_core.core.packing import is_packed
    from dynatree_core.runs.environment import environment

    dtype = str(model.dtype).removeprefix("torch.")
    env = environment(str(model.device), dtype, is_packed(model), dtype_source, forward_path=forward_path)
    return {"environment": env, "date": datetime.date.today().isoformat(), "command": command_line(args)}


def load_run(args, target_spec: str, draft_spec: str | None):
    """The pair the arguments name, loaded, and the run's engine config (settings + what the pair knows)."""
    from dynatree_core.decoding.pairs import load_pair

    pair = load_pair(target_spec, draft_spec, device=args.device, dtype=args.dtype, pack=not args.no_pack)
    config = RunSpec.of(args).decode_config(
        eos_token_ids=pair.target.eos_token_ids,
        context_length=pair.target.context_length,
        forward=forward_settings(args),
    )
    return pair, config


def ray_workers(args, target_spec: str, draft_spec: str | None):
    """With --ray, Ray workers each holding the pair the arguments name, started (measure/cluster.py); else None."""
    if args.ray_workers < 0:
        raise DynaTreeError(f"--ray-workers must be 0 (one per GPU or node) or more, got {args.ray_workers}")
    if not args.ray:
        if args.ray_workers:
            raise DynaTreeError("--ray-workers needs --ray")
        return None
    from dynatree_core.measure.cluster import PairSource, Workers

    source = PairSource(target_spec, draft_spec, device=args.device, dtype=args.dtype, pack=not args.no_pack)
    print("starting Ray workers ...", file=sys.stderr, flush=True)
    return Workers(source, args.ray_workers).start()


def _read_prompt(args) -> str:
    """The prompt from --prompt or --prompt-file, refused when empty (with --max-new-tokens < 1)."""
    if args.prompt_file is not None:
        try:
            prompt = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DynaTreeError(f"cannot read prompt file {args.prompt_file}: {exc}") from exc
    else:
        prompt = args.prompt
    if prompt is None or not prompt.strip():
        raise DynaTreeError("the prompt is empty (use --prompt TEXT or --prompt-file FILE)")
    if args.max_new_tokens < 1:
        raise DynaTreeError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    return prompt


def _refuse_long_prompt(target_spec: str, prompt: str, chat: bool | None) -> None:
    """A prompt the target's context cannot hold is refused before the models load (tokenizer, config)."""
    from dynatree_core.core.models import peek_model
    from dynatree_core.decoding.pairs import encode_prompt

    peeked = peek_model(target_spec)
    if peeked is None:
        return
    tokenizer, context = peeked
    chat = chat if chat is not None else bool(getattr(tokenizer, "chat_template", None))
    n = len(encode_prompt(tokenizer, prompt, chat=chat))
    if n >= context:
        raise DynaTreeError(f"the prompt has {n} tokens; the model's context is {context}")


def _parse_params(items: list[str]) -> dict[str, str]:
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise DynaTreeError(f"--param expects key=value, got {item!r}")
        params[key.strip()] = value.strip()
    return params


def cmd_policies(args) -> None:
    from dynatree_core.decoding.methods import catalogue

    described = [cls.describe() for cls in catalogue().values()]
    if args.json:
        print(json.dumps(described, indent=2))
        return
    for d in described:
        print(f"{d['name']} [{d['family']}]: {d['summary']}")
        for p in d["params"]:
            rng = f", range [{p['min']}, {p['max']}]" if p["min"] is not None else ""
            print(f"    {p['name']} ({p['type']}, default {p['default']}{rng}): {p['help']}")


def cmd_verifiers(args) -> None:
    from dynatree_core.verify.registry import VERIFIERS

    rows = [v.to_dict() for v in VERIFIERS.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        accepts = ", ".join(a.replace("_", " ") for a in r["accepts"])
        print(f"{r['name']} ({r['direction']}, temperature {r['temperature']}): {r['summary']}")
        print(f"    drafting it accepts: {accepts}; {r['reference']}")


def cmd_presets(args) -> None:
    from dynatree_core.core.presets import PRESETS

    if args.json:
        return print(json.dumps([vars(p) for p in PRESETS.values()], indent=2))
    for p in map(vars, PRESETS.values()):
        where = "offline" if p["offline"] else "needs network (downloads from the hub, or a warm HF cache)"
        draft = (portable(p["draft"]) + (" (head)" if p["head"] else "")) if p["draft"] else "(none yet)"
        print(f"{p['name']}: target {p['target']}, draft {draft} - {p['description']}; {where}")


def cmd_bench(args) -> None:
    from dynatree_core.decoding.methods import REFERENCES, candidates, make_method
    from dynatree_core.measure import bench as B
    from dynatree_core.measure.entries import Entry, parse_spec
    from dynatree_core.measure.prompt_sets import choose_prompts

    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    specs = [(n, {}, "auto") for n in names] + [parse_spec(s) for s in args.policy]
    sweeps = [B.parse_sweep(s) for s in args.sweep]
    setting, param_sweeps = B.split_sweeps(sweeps)
    if not specs and not param_sweeps:
        specs = [(n, {}, "auto") for n in candidates()]
    if args.grid and len(param_sweeps) < 2:
        raise DynaTreeError(
            "--grid needs two or more parameter sweeps, e.g. --sweep tau_h=0.6,0.8 --sweep tau_l=0.2,0.4"
        )
    if not param_sweeps:
        entries = []
    elif args.grid:
        entries = B.grid_entries(args.sweep_policy, param_sweeps)
    else:
        entries = B.sweep_entries(args.sweep_policy, param_sweeps)
    entries += [Entry(n, p, verifier="" if v == "auto" else v) for n, p, v in specs if n not in REFERENCES]
    for e in entries:
        make_method(e.policy, e.params)  # validate before loading models
    if args.repeats < 1:
        raise DynaTreeError(f"--repeats must be at least 1, got {args.repeats}")
    if args.warmup < 0:
        raise DynaTreeError(f"--warmup must be >= 0, got {args.warmup}")
    chosen = choose_prompts(args.prompts, args.limit, args.skip)
    target_spec, draft_spec = _resolve_models(args)
    pair, config = load_run(args, target_spec, draft_spec)
    common = dict(
        config=config,
        repeats=args.repeats,
        warmup=args.warmup,
        include_hf=not args.no_hf,
        max_prompt_tokens=args.max_prompt_tokens,
        workers=ray_workers(args, target_spec, draft_spec),
    )
    with _Progress() as progress:
        if setting is None:
            report = B.run_bench(pair, entries, chosen, progress=progress, **common)
        else:
            sweep = dict(setting=setting[0], values=setting[1])
            report = B.run_setting_sweep(pair, entries, chosen, progress=progress, **sweep, **common)
    report.settings["command"] = command_line(args)
    report.settings["date"] = datetime.date.today().isoformat()
    report.settings["models"] = {"target": portable(target_spec), "draft": draft_spec and portable(draft_spec)}
    if args.out is not None:
        args.out.write_text(report.to_json(), encoding="utf-8")
        args.out.with_suffix(".csv").write_text(report.csv(), encoding="utf-8")
        if param_sweeps or setting is not None:  # a sweep's figures: the only use of plotly here
            from dynatree_core.viz.bench import grid_figure, setting_figure, sweep_figures, write_figure

            figures = sweep_figures(report, param_sweeps) if param_sweeps and not args.grid else {}
            if args.grid:
                figures["-".join(n for n, _ in param_sweeps[:2])] = grid_figure(report, param_sweeps)
            if setting is not None:
                figures[setting[0]] = setting_figure(report, *setting)
            for name, fig in figures.items():
                for path in write_figure(fig, args.out.with_name(f"{args.out.stem}.sweep-{name}"), png=args.png):
                    print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(report.to_json())
    else:
        print(report.markdown())


def cmd_latency(args) -> None:
    from dynatree_core.decoding.pairs import load_pair
    from dynatree_core.forward.choice import forward_path
    from dynatree_core.measure.latency import pair_profile
    from dynatree_core.viz.bench import latency_figure

    try:
        tokens = tuple(int(t) for t in args.tokens.split(","))
        contexts = tuple(int(t) for t in args.contexts.split(","))
    except ValueError as exc:
        raise DynaTreeError(f"--tokens / --contexts take comma-separated integers: {exc}") from exc
    if min(tokens) < 1 or min(contexts) < 1 or args.repeats < 1:
        raise DynaTreeError("--tokens, --contexts and --repeats must be positive")
    target_spec, draft_spec = _resolve_models(args)
    pair = load_pair(target_spec, draft_spec, device=args.device, dtype=args.dtype, pack=not args.no_pack)
    settings = forward_settings(args)
    with _Progress("point") as progress:
        points = pair_profile(pair, tokens, contexts, args.repeats, progress, settings=settings)
    model = pair.target.model
    report = {
        **stamp(args, model, pair.dtype_source, forward_path(model, **settings.choice_switches())),
        "points": [dataclasses.asdict(p) for p in points],
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2), encoding="utf-8")
        latency_figure(points).write_html(args.out.with_suffix(".html"))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print("| model | context | " + " | ".join(str(n) for n in tokens) + " |")
    print("|---|---|" + "---|" * len(tokens))
    for name in dict.fromkeys(p.model for p in points):
        for context in contexts:
            row = [p.ms for p in points if p.model == name and p.context == context]
            print(f"| {name} | {context} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |")


def _resolve_models(args) -> tuple[str, str | None]:
    """--preset fills in --target/--draft; explicit flags win."""
    from dynatree_core.core.presets import EMBEDDED, PRESETS

    if args.preset is None:
        return args.target or EMBEDDED, args.draft
    if args.preset not in PRESETS:
        raise DynaTreeError(f"unknown preset {args.preset!r}; choose one of: {', '.join(PRESETS)}")
    preset = PRESETS[args.preset]
    return args.target or preset.target, args.draft or preset.draft


def cmd_dtype(args) -> None:
    from dynatree_core.core.devices import resolve_device
    from dynatree_core.decoding.dtype_choice import choose, save_choice
    from dynatree_core.measure.dtype_probe import probe

    if args.max_new_tokens < 1 or args.limit < 1:
        raise DynaTreeError("--max-new-tokens and --limit must be at least 1")
    target_spec, draft_spec = _resolve_models(args)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()] or None
    with _Progress("dtype") as progress:
        rows = probe(target_spec, draft_spec, device=args.device, limit=args.limit, max_new_tokens=args.max_new_tokens,
                     policy=args.policy, dtypes=dtypes, progress=progress)  # fmt: skip
    best = choose(rows)
    if not args.no_save:
        from dynatree_core.decoding.pairs import default_draft_for

        save_choice(resolve_device(args.device), target_spec, draft_spec or default_draft_for(target_spec), best, rows)
    if args.json:
        print(json.dumps({"chosen": best.dtype, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2))
        return
    print(f"| dtype | AR tokens/s | {args.policy} tokens/s | exact |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r.dtype} | {r.ar_tps:.1f} | {r.tree_tps:.1f} | {r.exact}/{r.prompts} |")
    saved = "" if args.no_save else " (saved: --dtype auto uses it for this device and pair)"
    print(f"fastest exact dtype: {best.dtype}{saved}")


def cmd_generate(args) -> None:
    import torch

    from dynatree_core.decoding.engine import generate
    from dynatree_core.decoding.methods import make_method, verifier_for
    from dynatree_core.decoding.pairs import encode_prompt, load_pair

    prompt = _read_prompt(args)
    policy = make_method(args.policy, _parse_params(args.param))  # validate before loading models
    if args.num_samples < 1:
        raise DynaTreeError(f"--num-samples must be at least 1, got {args.num_samples}")
    spec = RunSpec.of(args)
    verifier_for(policy, spec.decode_config())  # refuse an invalid pairing before loading models
    target_spec, draft_spec = _resolve_models(args)
    _refuse_long_prompt(target_spec, prompt, args.chat)
    torch.manual_seed(args.seed)
    pair = load_pair(
        target_spec,
        draft_spec,
        device=args.device,
        dtype=args.dtype,
        need_draft=policy.needs_draft_model,
        pack=not args.no_pack,
    )
    target = pair.target
    chat = args.chat if args.chat is not None else target.has_chat_template
    prompt_ids = encode_prompt(target.tokenizer, prompt, chat=chat)
    results = []
    for i in range(args.num_samples):
        config = spec.decode_config(
            eos_token_ids=target.eos_token_ids,
            context_length=target.context_length,
            seed=spec.seed + i,
            forward=forward_settings(args),
        )
        results.append(
            generate(
                target.model,
                prompt_ids,
                policy,
                config=config,
                tokenizer=target.tokenizer,
                **pair.drafting(policy),
            )
        )
    if args.export:  # the app's run file: a replay (live.export_run)
        from dynatree_core.live.run import export_run

        models = dataclasses.replace(spec, target=target_spec, draft=draft_spec)  # as resolved, not as typed
        export_run(args.export, results[0], models, policy, prompt, chat, target)
    if args.json:
        if args.num_samples == 1:
            print(results[0].to_json(with_records=args.trace))
        else:
            print("[" + ",".join(r.to_json(with_records=args.trace) for r in results) + "]")
        return
    for result in results:
        print(result.text)
        print(
            f"\n[{result.policy}] {result.new_tokens} tokens in {result.iterations} iterations "
            f"({result.tokens_per_iteration:.2f} tokens/iteration, acceptance {result.acceptance_rate:.2f}), "
            f"{result.throughput_tps:.1f} tokens/s, stop: {result.stop_reason}",
            file=sys.stderr,
        )
