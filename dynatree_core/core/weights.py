"""Weights loaded whole or not at all, checkpoints written whole or not at all.

`load_weights` loads a state dict into a module only when every tensor has its place and its
shape: a missing, extra or mis-shaped tensor is one DynaTreeError that names them (a few names
of each, and how many), never a tensor left at its random initialisation. The names a caller
means to leave as they are (the target's head rows, an unused embedding) are said explicitly in
`allow_missing`. `save_whole` writes a checkpoint to a temporary file beside its place, flushed
to disk, then renamed over it: a run killed while saving keeps the previous one.
`check_same_run` refuses to resume a checkpoint recorded for other settings.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from dynatree_core.errors import DynaTreeError

SHOWN = 3  # names shown per kind of mismatch


def _some(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{len(names)} ({', '.join(names[:SHOWN])}{more})"


def _covered(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def weight_mismatch(
    own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], *, allow_missing: Iterable[str] = ()
) -> str | None:
    """What keeps `state` from loading into a module whose state dict is `own` (None: it loads).
    `allow_missing`: names, or module paths ("lm_head" covers "lm_head.weight"), that may be absent."""
    allowed = tuple(allow_missing)
    missing = [k for k in own if k not in state and not _covered(k, allowed)]
    extra = [k for k in state if k not in own]
    shaped = [
        f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and tuple(v.shape) != tuple(own[k].shape)
    ]
    parts = [
        f"{label} {_some(names)}"
        for label, names in (("missing", missing), ("unexpected", extra), ("mis-shaped (file vs model)", shaped))
        if names
    ]
    return "; ".join(parts) or None


def load_weights(
    module: torch.nn.Module, state: Mapping[str, torch.Tensor], *, what: str, allow_missing: Iterable[str] = ()
) -> None:
    """Load `state` (names relative to `module`) over the module's own tensors, all of them or none:
    DynaTreeError naming the missing, unexpected and mis-shaped tensors of `what` otherwise. The
    names in `allow_missing` (or under those module paths) keep the module's values when absent."""
    own = module.state_dict()
    problem = weight_mismatch(own, state, allow_missing=allow_missing)
    if problem:
        raise DynaTreeError(f"{what}: the weights do not match the model: {problem}")
    module.load_state_dict({**{k: v for k, v in own.items() if k not in state}, **state}, strict=True)


def save_whole(obj, path: str | Path) -> None:
    """torch.save `obj` to `path` atomically: a temporary file in the same directory, flushed and
    fsynced, then renamed over `path`. Interrupted, it leaves the previous file and no partial one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # the rename itself survives a crash once the directory entry is on disk
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def check_same_run(saved: Mapping | None, run: Mapping, *, where: str) -> None:
    """DynaTreeError naming every setting whose value in the checkpoint at `where` (`saved`)
    differs from this run's (`run`): resuming would continue another run. A checkpoint that
    recorded no settings (written before they were recorded) is checked by its weights alone."""
    if saved is None:
        return
    differ = [k for k in sorted(set(saved) | set(run)) if saved.get(k) != run.get(k)]
    if differ:
        shown = ", ".join(f"{k} {saved.get(k)!r} there, {run.get(k)!r} now" for k in differ[:4])
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise DynaTreeError(
            f"{where} was written by a run with other settings ({shown}{more}): "
            "resume with the same settings, or use another output directory"
        )
