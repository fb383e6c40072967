"""How many CPU threads torch may use: one deliberate decision shared by the app, CLI and benchmarks.

torch runs each large op as an OpenMP parallel region over its intra-op threads. A region ends
only when its slowest thread does, so when another process (a browser drawing the page, the
Streamlit server, anything else on a teacher's laptop) takes one of the cores, every region
waits for the thread that lost its core, and the run slows to a fraction of the CLI's speed
(BENCHMARKS.md, "The live page against the CLI").
The engine therefore asks for the cores it can keep:

  - an explicit request (`--threads N`, the app's setting) wins;
  - else `DYNATREE_THREADS=N` from the environment;
  - else the role's default: every core for the CLI and benchmarks (nothing else is expected to
    run), and one core fewer for the app, whose browser and server share the machine.

`configure_threads` applies the choice once per process (torch's setting is process-wide) and
returns it, so reports can say what they ran with.
"""

from __future__ import annotations

import os

import torch

from dynatree_core.core import settings
from dynatree_core.errors import DynaTreeError

ENV = "DYNATREE_THREADS"
ROLES = ("cli", "app")


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def default_threads(role: str = "cli", cores: int | None = None) -> int:
    """The role's default thread count on a machine with `cores` cores."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of: {', '.join(ROLES)}")
    cores = cores or available_cores()
    return max(1, cores - 1) if role == "app" else cores


def resolve_threads(requested: int | str | None = None, role: str = "cli") -> tuple[int, str]:
    """(threads, source): source is "asked", "env" or "default". Invalid values raise DynaTreeError."""
    if requested not in (None, "", 0, "0", "auto"):
        return _positive(requested, "--threads"), "asked"
    env = settings.env(ENV)
    if env and env != "auto":
        return _positive(env, ENV), "env"
    return default_threads(role), "default"


_APPLIED: dict[str, int | str] = {}  # what configure_threads last set ("threads") and why ("source")


def configure_threads(requested: int | str | None = None, role: str = "cli") -> int:
    """Resolve the thread count and apply it to torch (process-wide); returns it."""
    threads, source = resolve_threads(requested, role)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    _APPLIED.update(threads=threads, source=f"{source} ({role})")
    return threads


def threads_source() -> str:
    """Why torch runs with its current thread count: "asked (cli)", "env (app)", "default (cli)", ...;
    "torch default" when nothing here set it, "external" when something else changed it since."""
    if not _APPLIED:
        return "torch default"
    return str(_APPLIED["source"]) if _APPLIED["threads"] == torch.get_num_threads() else "external"


def _positive(raw: int | str, what: str) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise DynaTreeError(f"{what}: {raw!r} is not a whole number of threads") from None
    if value < 1:
        raise DynaTreeError(f"{what}: {value} threads; at least 1 is needed")
    return value
