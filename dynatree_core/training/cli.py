"""What every recipe's commands share: a command's shape, flags from a config dataclass, the
export flags, where the data lives (committed ids, the cache), where a target's answers live."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

from dynatree_core.core.cache_dir import cache_dir
from dynatree_core.core.presets import REPO_ROOT

# Token ids (uint16) are small and committed, so training can continue on a fresh machine;
# labels, features and checkpoints are recomputed into the cache.
COMMITTED = REPO_ROOT / "assets" / "draft-data"
CORPUS = COMMITTED / "corpus.npz"
SHIPPED = REPO_ROOT / "assets" / "models"


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand of `python -m dynatree_core.training`: its help, its flags, what it runs."""

    help: str
    flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


def data_root() -> Path:
    """Where labels, features and target trees are recomputed (read when the parser is built)."""
    return cache_dir() / "draft-data"


def runs_root() -> Path:
    return cache_dir() / "draft-runs"


def answer_dirs(
    target: str, ids_dir: Path | None = None, features_dir: Path | None = None, *, ood: bool = False
) -> tuple[Path, Path]:
    """Where a target's answer shards live (`ood`: its answers to the OOD set, kept apart): the
    embedded target's ids are committed, any other target's stay in the cache (under a directory
    named after its spec); features always live in the cache."""
    slug = "embedded" if target == "embedded" else "".join(c if c.isalnum() else "-" for c in target).strip("-")
    name = "ood-answers" if ood else "answers"
    ids = COMMITTED / name if target == "embedded" else data_root() / slug / name
    feats = data_root() / slug / ("ood-answer-features" if ood else "answer-features")
    return ids_dir or ids, features_dir or feats


def config_flags(parser: argparse.ArgumentParser, config_class) -> None:
    """One --flag per field of a training config dataclass, with its default."""
    for field in config_class.__dataclass_fields__.values():
        kind = flag_bool if isinstance(field.default, bool) else type(field.default)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default)


def config_from(args: argparse.Namespace, config_class):
    return config_class(**{k: getattr(args, k) for k in config_class.__dataclass_fields__})


def flag_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")


def export_flags(parser: argparse.ArgumentParser, *, run: Path, quality: str, recipe: str) -> None:
    parser.add_argument("--run", type=Path, default=run)
    parser.add_argument("--dest", type=Path, default=None)
    parser.add_argument("--quality", type=Path, default=None, help=f"JSON written by `{quality} --out`")
    parser.add_argument("--recipe", default=recipe, help="the command that produced it (for the card)")
    parser.add_argument("--note", default="", help="extra text for the card (e.g. caveats about the compute ledger)")


def write_json(result: dict, out: Path | None) -> None:
    """Print a measurement; with `out`, also write it there."""
    import json

    print(json.dumps(result, indent=1))
    if out:
        out.write_text(json.dumps(result, indent=1))


def print_now(message: str) -> None:
    print(message, flush=True)
