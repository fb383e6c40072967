"""`python -m dynatree_core ...`: generate text with a policy, compare policies, check a verifier's
law (lab), benchmark, list policies, verifiers and presets, check a GPU (gpu-check). parser.py
builds the arguments, commands.py and experiments.py (compare, lab) run them.

Errors caused by input exit with status 2 and print one line, `error: <message>`, on stderr.

May import: errors, core, forward, runs, verify, drafts, drafting, decoding, measure, live, viz, training.
"""

from __future__ import annotations

import os
import sys
import warnings

from dynatree_core.cli import commands as C
from dynatree_core.cli import experiments as X
from dynatree_core.cli.parser import build_parser
from dynatree_core.errors import DynaTreeError

__all__ = ["build_parser", "main"]


def _gpu_check(args) -> None:
    from dynatree_core.measure.gpu_check import gpu_check

    gpu_check(args.device, embedded=not args.no_embedded, out=args.out)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.formatwarning = lambda msg, *a, **k: f"warning: {msg}\n"
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in reports
        if hasattr(args, "threads"):  # a command that runs models: decide torch's threads first
            from dynatree_core.core.threads import configure_threads

            configure_threads(args.threads)
        commands = {
            "generate": C.cmd_generate,
            "compare": X.cmd_compare,
            "lab": X.cmd_lab,
            "latency": C.cmd_latency,
            "policies": C.cmd_policies,
            "presets": C.cmd_presets,
            "bench": C.cmd_bench,
            "verifiers": C.cmd_verifiers,
            "dtype": C.cmd_dtype,
            "gpu-check": _gpu_check,
        }
        commands[args.command](args)
    except DynaTreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0
