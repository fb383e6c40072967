"""The compute ledger of every recipe (`make draft`, `make draft-feature`): each stage appends what it measured.

One JSON object per line in `$DYNATREE_CACHE/draft-runs/compute.jsonl`:
`{"stage": "label", "seconds": 97.4, "tokens": 81616, "item": "shard 22", "threads": 2}`.
The model card (card.py) sums it per stage, so the total CPU time of the shipped draft is a
measured number, not an estimate. Stages that were skipped because their output existed add
nothing; a stage repeated after its output went stale is counted again (it did cost the time).
A recipe that must write only under its run directory (`draft-gpu`) keeps its own ledger there
(`kept_in`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import time
from pathlib import Path

import torch

_KEPT_IN: contextvars.ContextVar[Path | None] = contextvars.ContextVar("ledger", default=None)


def ledger_path() -> Path:
    from dynatree_core.core.cache_dir import cache_dir

    return cache_dir() / "draft-runs" / "compute.jsonl"


@contextlib.contextmanager
def kept_in(path: Path):
    """Inside the block, every entry is written to (and read from) the ledger at `path`."""
    token = _KEPT_IN.set(path)
    try:
        yield path
    finally:
        _KEPT_IN.reset(token)


def record(stage: str, seconds: float, path: Path | None = None, **info) -> None:
    path = path or _KEPT_IN.get() or ledger_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"stage": stage, "seconds": round(float(seconds), 2), "threads": torch.get_num_threads()}
    entry.update(info)
    entry["at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def totals(path: Path | None = None, run: Path | list[Path] | None = None) -> dict[str, dict[str, float]]:
    """{stage: {"seconds": s, "items": n, "tokens": t}} summed over the ledger (empty if none).

    With `run` (a run folder, or the stages of one draft), training entries of other runs
    (experiments, ablations) are left out.
    """
    path = path or _KEPT_IN.get() or ledger_path()
    runs = None if run is None else {Path(r) for r in (run if isinstance(run, list) else [run])}
    out: dict[str, dict[str, float]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        if runs is not None and "run" in entry and Path(entry["run"]) not in runs:
            continue
        row = out.setdefault(entry["stage"], {"seconds": 0.0, "items": 0, "tokens": 0})
        row["seconds"] += entry["seconds"]
        row["items"] += 1
        row["tokens"] += entry.get("tokens", 0)
    return out
