"""`draft-gpu`'s settings: the stages in order, one run's settings (the CLI's flags: commands.py) and the
command line its card shows (gpu/recipe.py runs them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dynatree_core.runs.environment import portable

STAGES = ("answers", "follow", "relabel", "train", "quality", "export")


@dataclasses.dataclass(frozen=True)
class GpuRecipe:
    """One run's settings (the CLI's flags: commands.py)."""

    pack: Path
    out: Path
    budget_s: float = 1500.0
    until: str = "export"
    target: str = "embedded"
    device: str = "auto"
    dtype: str = "bfloat16"
    batch_rows: int = 0  # rows decoded together (0: 1024 on CUDA, 16 on the CPU)
    shard_jobs: int = 0  # jobs a shard (0: 8 x batch_rows on CUDA, 512 on the CPU)
    answer_tokens: int = 0  # > 0: the answers stop once this many answer tokens are stored
    train_s: float = 0.0  # > 0: seconds of training instead of the budget's training share
    pairs_per_step: int = 8192  # packed answer pairs a training step reads (PackedTrainConfig's default)
    init_from: Path | None = None
    prior_answers: Path | None = None  # an answer store's id shards to relabel and train on beside the pack's
    token_map: Path | None = None  # default: the shipped feature draft's map (embedded), else rebuilt
    ood_max_new: int = 256  # the OOD answers' token limit (a target without committed ones)
    stop_after_s: float = 0.0  # > 0: this call stops starting work after this many seconds
    seed: int = 0


def command_line(cfg: GpuRecipe, batch_rows: int) -> str:
    """The card's command line for a run of GpuRecipe `cfg` (no path of this machine)."""
    target = Path(cfg.target).name if Path(cfg.target).is_dir() else cfg.target  # a directory: its name only
    line = f"python -m dynatree_core.training draft-gpu --pack {cfg.pack.name} --target {target}"
    line += f" --budget-s {cfg.budget_s:.0f} --dtype {cfg.dtype} --batch-rows {batch_rows}"
    line += f" --answer-tokens {cfg.answer_tokens}" if cfg.answer_tokens else ""
    line += f" --pairs-per-step {cfg.pairs_per_step}" if cfg.pairs_per_step != 8192 else ""
    line += f" --prior-answers {_shown(cfg.prior_answers)}" if cfg.prior_answers else ""
    return line + (f" --init-from {_shown(cfg.init_from)}" if cfg.init_from else "")


def _shown(path: Path) -> str:
    """A path as a card shows it: relative to the repository or home, else its name alone."""
    text = portable(str(path))
    return path.name if Path(text).is_absolute() else text
