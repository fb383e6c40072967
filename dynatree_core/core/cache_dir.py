"""Where this project keeps files it makes on a user's machine (converted checkpoints, dtype
probes, training ledgers): one root, $DYNATREE_CACHE or ~/.cache/dynatree. Nothing here
writes; callers make their own subfolders.
"""

from __future__ import annotations

from pathlib import Path

from dynatree_core.core.settings import env


def cache_dir() -> Path:
    """Where converted checkpoints live: $DYNATREE_CACHE or ~/.cache/dynatree."""
    return Path(env("DYNATREE_CACHE") or Path.home() / ".cache" / "dynatree")
