"""The CLI's arguments: one parser, the shared flags generated from the run-settings registry
(decoding/settings.py) and written once per group (run, models, engine)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynatree_core.decoding.settings import add_flags
from dynatree_core.errors import DynaTreeError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + message; we want one line
        raise DynaTreeError(message)


def output(text: str) -> Path:
    """A file the command will write (argparse type): its folder is made now, before the work, so
    a long run never ends in a traceback about a missing folder."""
    path = Path(text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot create the folder {path.parent}: {exc.strerror}") from None
    return path


def _run_arguments(p: argparse.ArgumentParser) -> None:
    """What `generate` and `compare` share: prompt, models, length, sampling."""
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--prompt-file", type=Path, help="read the prompt from a file")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the model's chat template (default: on when the tokenizer has one)",
    )
    add_flags(p, ("max_new_tokens", "seed", "temperature", "top_p", "top_k", "verifier"))
    _model_arguments(p)
    _engine_arguments(p)


def _model_arguments(p: argparse.ArgumentParser, *, dtype: bool = True) -> None:
    """The model pair and where it runs: one definition for every command that loads models."""
    p.add_argument("--preset", default=None, help="model pair preset (see `presets`); sets --target/--draft")
    add_flags(p, ["target", "draft", "device", *(["dtype"] if dtype else [])])
    if dtype:
        p.add_argument("--no-pack", action="store_true", help="CPU: plain nn.Linear (no oneDNN pre-packing)")


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """How forwards run: torch threads, the static cache and the lean forward (each with an off switch)."""
    add_flags(p, ["threads"])
    p.add_argument(
        "--no-static-cache", action="store_true", help="transformers' DynamicCache (concatenates per forward)"
    )
    p.add_argument("--no-fast-forward", action="store_true", help="the stock HF forward instead of the lean one")
    p.add_argument("--no-graphs", action="store_true", help="CUDA: eager forwards instead of captured CUDA graphs")
    _auto_on_off(
        p,
        "--width-invariant",
        "the target's rows get the bits they would get alone, so trees match ar exactly in any dtype "
        "(auto: on for bfloat16/float16, off for float32; DYNATREE_INVARIANT=0/1 sets auto's choice)",
    )
    _auto_on_off(
        p,
        "--device-draft",
        "greedy draft levels run at fixed widths and the tree is read once per iteration, not once per level "
        "(auto: on for CUDA; off for CPU, where each level's count is read at once)",
    )
    _auto_on_off(
        p,
        "--device-verify",
        "greedy trees drafted as levels: queue the verify forward from the tree's rows built from the levels "
        "before the host reads the tree (one draining read per iteration with --device-draft; "
        "not with --width-invariant at free shapes; auto: on)",
    )


def _auto_on_off(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """A switch whose `auto` leaves the choice to the library (commands.forward_settings maps it)."""
    p.add_argument(flag, choices=("auto", "on", "off"), default="auto", help=help)


def build_parser() -> argparse.ArgumentParser:
    """The `python -m dynatree_core` parser: one subcommand per `cmd_<name>` in commands.py, listed
    in this order by `--help`."""
    parser = _Parser(prog="python -m dynatree_core", description="Tree-based speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_compare(sub)
    _add_lab(sub)
    ver = sub.add_parser("verifiers", help="list verification algorithms and the drafting each accepts")
    ver.add_argument("--json", action="store_true")
    pol = sub.add_parser("policies", help="list drafting policies and their parameters")
    pol.add_argument("--json", action="store_true")
    _add_bench(sub)
    _add_latency(sub)
    _add_dtype(sub)
    _add_gpu_check(sub)
    pre = sub.add_parser("presets", help="list model pair presets")
    pre.add_argument("--json", action="store_true")
    return parser


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate text with a drafting policy")
    _run_arguments(gen)
    gen.add_argument("--policy", default="fixed_tree", help="drafting policy (see `policies`)")
    gen.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="policy parameter")
    gen.add_argument("--num-samples", type=int, default=1, help="independent samples (models loaded once)")
    add_flags(gen, ("order",))
    gen.add_argument("--json", action="store_true", help="print the RunResult as one JSON object")
    gen.add_argument("--trace", action="store_true", help="with --json: include per-iteration records")
    gen.add_argument("--export", type=output, default=None, help="write the run as the app imports it (a replay)")


def _add_compare(sub) -> None:
    cmp = sub.add_parser("compare", help="compare 1-6 policies on one prompt (ar and HF generate as references)")
    _run_arguments(cmp)
    cmp.add_argument(
        "--policy", action="append", default=[], metavar="NAME[:K=V,...]", help="repeatable; the same policy may repeat"
    )
    cmp.add_argument("--repetitions", type=int, default=3, help="measured runs per policy (after one warm-up)")
    cmp.add_argument("--no-hf", action="store_true", help="skip the HF generate references (eager and static cache)")
    cmp.add_argument("--json", action="store_true", help="print the comparison as JSON")
    cmp.add_argument("--csv", type=output, default=None, help="also write the table as CSV here")
    cmp.add_argument("--out", type=output, default=None, help="write the comparison as JSON here (the page imports it)")
    _ray_arguments(cmp)


def _add_lab(sub) -> None:
    lab = sub.add_parser(
        "lab", help="repeat one draft -> verify step: the first token's histogram against the target's law"
    )
    _run_arguments(lab)
    lab.set_defaults(temperature=0.8)
    lab.add_argument(
        "--policy",
        default="fixed_tree",
        metavar="NAME[:K=V,...]",
        help="the drafting policy (--verifier: its verifier)",
    )
    lab.add_argument("--trials", type=int, default=500, help="repetitions: each one draft tree and one target forward")
    lab.add_argument("--out", type=output, default=None, help="write the report as JSON here (the Lab page reads it)")
    lab.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_bench(sub) -> None:
    """`bench`: the prompts and policies of a run (DynaTree's protocol: T, L_max, R, W), then sweeps."""
    bench = sub.add_parser(
        "bench", help="policies over a prompt set (DynaTree protocol), ratios to the best AR reference in the same run"
    )
    bench.add_argument("--policies", default="", help="comma-separated policy names, e.g. ar,linear,fixed_tree")
    bench.add_argument(
        "--policy", action="append", default=[], metavar="NAME[:K=V,...][@VERIFIER]", help="repeatable, with parameters"
    )
    bench.add_argument(
        "--prompts",
        default="all",
        help="bundled set name ('ood': prompts from sources no draft trains on; 'ood:<category>'), 'all', "
        "several joined by commas, or a .jsonl / .txt path",
    )
    bench.add_argument("--limit", type=int, default=8, help="N: first N prompts, spread over the domains (0: all)")
    bench.add_argument(
        "--skip", type=int, default=0, help="leave out the first K prompts of that order (a split apart from --skip 0)"
    )
    bench.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="L_max: cut each prompt to its first L tokens"
    )
    add_flags(bench, ("max_new_tokens",))  # T: new tokens per run
    bench.add_argument("--repeats", type=int, default=1, help="R: measured rounds over all prompts")
    bench.add_argument("--warmup", type=int, default=1, help="W: discarded warm-up runs per policy")
    bench.add_argument("--no-hf", action="store_true", help="skip the HF generate references (eager and static cache)")
    add_flags(bench, ("temperature", "top_p", "top_k", "verifier"))  # sampled: round r uses seed r
    _model_arguments(bench)
    _engine_arguments(bench)
    _sweep_arguments(bench)
    _ray_arguments(bench)


def _ray_arguments(p: argparse.ArgumentParser) -> None:
    """Where the runs go: this process, or Ray workers (measure/cluster.py)."""
    p.add_argument(
        "--ray",
        action="store_true",
        help="run on Ray workers (a local runtime, or the cluster DYNATREE_RAY_ADDRESS names)",
    )
    p.add_argument("--ray-workers", type=int, default=0, help="with --ray: N workers (default: one per GPU or node)")


def _sweep_arguments(bench: argparse.ArgumentParser) -> None:
    """`bench`'s sweeps and where its report goes."""
    bench.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=A..B|NAME=V1,V2",
        help="vary one registry parameter of --sweep-policy at a time (repeatable), or the run setting T or L_max "
        "for every policy listed; figures go beside --out",
    )
    bench.add_argument("--sweep-policy", default="fixed_tree", help="the policy whose parameters --sweep varies")
    bench.add_argument(
        "--grid", action="store_true", help="run every combination of the parameter sweeps (a scatter for two)"
    )
    bench.add_argument("--png", action="store_true", help="figures as PNG too (needs kaleido and Chromium)")
    bench.add_argument("--out", type=output, default=None, help="write the report as JSON here (and CSV beside it)")
    bench.add_argument("--json", action="store_true", help="print the JSON report instead of a markdown table")


def _add_latency(sub) -> None:
    lat = sub.add_parser("latency", help="forward time vs new tokens and context, target and draft (this device)")
    lat.add_argument("--tokens", default=",".join(map(str, (1, 2, 4, 8, 16, 32, 64, 128, 256))))
    lat.add_argument("--contexts", default="128,512", help="cached context lengths")
    lat.add_argument("--repeats", type=int, default=5, help="timed forwards per point (median)")
    _model_arguments(lat)
    _engine_arguments(lat)
    lat.add_argument("--out", type=output, default=None, help="JSON points here, plot beside it (.html)")
    lat.add_argument("--json", action="store_true")


def _add_dtype(sub) -> None:
    dt = sub.add_parser(
        "dtype", help="measure which dtype is fastest and still exact on this device; `--dtype auto` then uses it"
    )
    _model_arguments(dt, dtype=False)
    dt.add_argument("--dtypes", default="", help="comma-separated candidates (default: this device's)")
    dt.add_argument("--policy", default="dynatree", help="the tree policy timed against AR")
    add_flags(dt, ("max_new_tokens",))
    dt.add_argument("--limit", type=int, default=4, help="bundled prompts, spread over the domains")
    dt.add_argument("--no-save", action="store_true", help="measure and print, keep auto as it was")
    dt.add_argument("--json", action="store_true")
    add_flags(dt, ["threads"])


def _add_gpu_check(sub) -> None:
    gpu = sub.add_parser(
        "gpu-check", help="check the captured-forward path on this GPU: exactness, fallback, timings (run it first)"
    )
    gpu.add_argument(
        "--device", default="auto", help="auto: the CUDA device, or say so and exit (cpu: the padded path)"
    )
    gpu.add_argument("--out", type=output, default=Path("gpu-check.json"), help="write the JSON report here")
    gpu.add_argument("--no-embedded", action="store_true", help="tiny models only (skip the embedded pair)")
