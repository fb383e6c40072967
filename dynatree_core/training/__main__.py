"""`python -m dynatree_core.training ...`: draft-model training pipeline (data generation first)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynatree_core.models import cache_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dynatree_core.training")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("gen-data", help="sample on-policy training text from the embedded target")
    gen.add_argument("--out", type=Path, default=cache_dir() / "draft-data" / "onpolicy")
    gen.add_argument("--chunks", type=int, default=100)
    gen.add_argument("--batch", type=int, default=48)
    gen.add_argument("--new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--dtype", default="bfloat16")
    gen.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
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
        )


if __name__ == "__main__":
    main()
