"""The resident model pairs of a server: one EngineProcess per pair, shared by every page and
session, at most `limit` of them (DYNATREE_MAX_PAIRS; the default fits the machine's memory).

A pair nobody uses (engine_process.EngineProcess.in_use: no live run that has not finished, no
queued or running job, not loading) may be closed to make room, least recently used first. A pair
in use is never closed: a session that needs one more pair than the limit allows, while every
resident pair is in use, gets PoolFull, a message naming the pairs and what to do.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable

from dynatree_core.core.log import log_info
from dynatree_core.core.settings import env
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.engine_process import EngineProcess, PairSpec

MAX_PAIRS_ENV = "DYNATREE_MAX_PAIRS"
GIB_PER_PAIR = 6  # the default limit: one pair per 6 GiB of memory (what an engine holds: docs/app.md)
MAX_DEFAULT_PAIRS = 4
HANDOFF_S = 30.0  # an engine just handed out stays resident this long, until its user registers a run


class PoolFull(DynaTreeError):
    """Every resident pair is in use and the limit allows no other."""


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 8.0


def max_pairs() -> int:
    """How many pairs the server keeps loaded at once: DYNATREE_MAX_PAIRS, else one per
    GIB_PER_PAIR GiB of memory, between 1 and MAX_DEFAULT_PAIRS."""
    raw = env(MAX_PAIRS_ENV)
    if not raw:
        return max(1, min(MAX_DEFAULT_PAIRS, int(_memory_gib() // GIB_PER_PAIR)))
    try:
        value = int(raw)
    except ValueError:
        raise DynaTreeError(f"{MAX_PAIRS_ENV}={raw!r} is not a whole number") from None
    if value < 1:
        raise DynaTreeError(f"{MAX_PAIRS_ENV} must be at least 1, not {value}")
    return value


class EnginePool:
    """Engines by pair, at most `limit` resident, never closing one in use."""

    def __init__(self, limit: int | None = None, start: Callable[[PairSpec], EngineProcess] = EngineProcess):
        self.limit = max_pairs() if limit is None else limit
        self._start = start
        self._engines: collections.OrderedDict[PairSpec, EngineProcess] = collections.OrderedDict()
        self._handed: dict[PairSpec, float] = {}  # when each engine was last handed out
        self._lock = threading.Lock()

    def get(self, spec: PairSpec) -> EngineProcess:
        """The pair's engine, started if needed (it loads in its own process: wait_ready() waits).
        A dead engine is replaced. PoolFull when the limit is reached and every resident pair is
        in use."""
        closing = []
        with self._lock:
            engine = self._engines.get(spec)
            if engine is not None and not engine.alive:
                closing.append(self._engines.pop(spec))  # died (or failed to load): start it again
                engine = None
            if engine is None:
                while len(self._engines) >= self.limit:
                    victim = self._idle()
                    if victim is None:
                        raise PoolFull(self._full_text(spec))
                    closing.append(self._engines.pop(victim))
                    log_info("pool: %s closed to make room for %s", victim.title(), spec.title())
                engine = self._engines[spec] = self._start(spec)
                log_info("pool: started %s (%d of %d resident)", spec.title(), len(self._engines), self.limit)
            self._engines.move_to_end(spec)
            self._handed[spec] = time.monotonic()
        for old in closing:  # outside the lock: a close waits for the child to quit
            old.close()
        return engine

    def discard(self, spec: PairSpec, engine: EngineProcess) -> None:
        """Close `engine` (it failed to load) and forget it, unless another has replaced it."""
        with self._lock:
            if self._engines.get(spec) is engine:
                del self._engines[spec]
        engine.close()

    def resident(self) -> list[tuple[PairSpec, bool]]:
        """(pair, in use) for each resident engine, least recently used first."""
        with self._lock:
            return [(spec, self._busy(spec, e)) for spec, e in self._engines.items()]

    def _busy(self, spec: PairSpec, engine: EngineProcess) -> bool:
        return engine.alive and (engine.in_use or time.monotonic() - self._handed.get(spec, 0.0) < HANDOFF_S)

    def _idle(self) -> PairSpec | None:
        return next((spec for spec, e in self._engines.items() if not self._busy(spec, e)), None)

    def _full_text(self, spec: PairSpec) -> str:
        names = ", ".join(s.title() for s in self._engines)
        return (
            f"the server keeps at most {self.limit} model pair(s) loaded ({MAX_PAIRS_ENV}) and all are in use "
            f"by other sessions: {names}. Pick one of those pairs, or press Run again when one of them is free, "
            f"to load {spec.title()}."
        )
