"""`python -m dynatree_core.training COMMAND ...`: the training CLI. Each recipe's commands live
beside it (token/, feature/, answers/, packed/, gpu/ `commands.py`); this file is their table."""

from __future__ import annotations

import argparse

from dynatree_core.training.answers.commands import COMMANDS as ANSWERS
from dynatree_core.training.cli import Command
from dynatree_core.training.feature.commands import COMMANDS as FEATURE
from dynatree_core.training.gpu.commands import COMMANDS as GPU
from dynatree_core.training.packed.commands import COMMANDS as PACKED
from dynatree_core.training.parallel import join
from dynatree_core.training.token.commands import COMMANDS as TOKEN

# in the order the recipes run: the token draft's data and training, the answers, the feature draft,
# then the one-sitting GPU recipe that runs the feature draft's stages from a prompt pack
COMMANDS: dict[str, Command] = {**TOKEN, **ANSWERS, **FEATURE, **PACKED, **GPU}


def parser() -> argparse.ArgumentParser:
    """Every command's flags (defaults that name the cache are read now: DYNATREE_CACHE counts)."""
    top = argparse.ArgumentParser(prog="python -m dynatree_core.training")
    sub = top.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.flags(sub.add_parser(name, help=command.help))
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    join()  # under torchrun: one of its data-parallel workers (parallel.py)
    COMMANDS[args.command].run(args)


if __name__ == "__main__":
    main()
