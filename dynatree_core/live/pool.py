"""The resident model pairs of a server: one EngineProcess per pair (or `replicas` of them,
DYNATREE_REPLICAS), shared by every page and session, at most `limit` engines (DYNATREE_MAX_PAIRS;
the default fits the machine's memory).

With replicas, a pair's engines start together and each request gets the least loaded one (the
fewest unfinished runs and unanswered jobs), so two sessions on one pair decode side by side
instead of taking turns an iteration each; each replica takes its share of the cores.

A pair nobody uses (engine_process.EngineProcess.in_use: no live run that has not finished, no
queued or running job, not loading) may be closed to make room, least recently used first. A pair
in use is never closed: a session that needs one more pair than the limit allows, while every
resident pair is in use, gets PoolFull, a message naming the pairs and what to do.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Callable

from dynatree_core.core.log import log_info
from dynatree_core.core.settings import env
from dynatree_core.core.threads import available_cores
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.engine_process import EngineProcess, PairSpec

MAX_PAIRS_ENV = "DYNATREE_MAX_PAIRS"
REPLICAS_ENV = "DYNATREE_REPLICAS"
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


def replicas_wanted() -> int:
    """How many engines each pair gets: DYNATREE_REPLICAS, else 1."""
    raw = env(REPLICAS_ENV)
    try:
        value = int(raw or 1)
    except ValueError:
        raise DynaTreeError(f"{REPLICAS_ENV}={raw!r} is not a whole number") from None
    if value < 1:
        raise DynaTreeError(f"{REPLICAS_ENV} must be at least 1, not {value}")
    return value


class EnginePool:
    """Engines by pair (`replicas` each), at most `limit` resident, never closing one in use."""

    def __init__(
        self,
        limit: int | None = None,
        start: Callable[[PairSpec], EngineProcess] = EngineProcess,
        replicas: int | None = None,
    ):
        self.limit = max_pairs() if limit is None else limit
        self.replicas = replicas_wanted() if replicas is None else replicas
        self._start = start
        self._engines: collections.OrderedDict[PairSpec, list[EngineProcess]] = collections.OrderedDict()
        self._handed: dict[PairSpec, float] = {}  # when each pair's engine was last handed out
        self._lock = threading.Lock()

    def get(self, spec: PairSpec) -> EngineProcess:
        """The pair's least loaded engine, its replicas started if needed (each loads in its own
        process: wait_ready() waits). A dead engine is replaced. PoolFull when the limit is reached
        and every resident pair is in use."""
        closing = []
        with self._lock:
            engines = self._engines.pop(spec, [])
            closing += [e for e in engines if not e.alive]  # died (or failed to load): start again
            engines = [e for e in engines if e.alive]
            while len(engines) < self.replicas:
                if sum(map(len, self._engines.values())) + len(engines) >= self.limit:
                    victim = self._idle()
                    if victim is None:
                        if engines:  # serve with the replicas there are
                            break
                        raise PoolFull(self._full_text(spec))
                    closing += self._engines.pop(victim)
                    log_info("pool: %s closed to make room for %s", victim.title(), spec.title())
                    continue
                engines.append(self._start(self._replica(spec)))
                resident = sum(map(len, self._engines.values())) + len(engines)
                log_info("pool: started %s (%d of %d resident)", spec.title(), resident, self.limit)
            self._engines[spec] = engines  # the most recently used last
            self._handed[spec] = time.monotonic()
            engine = min(engines, key=lambda e: (not getattr(e, "ready", True), getattr(e, "load", 0)))
        for old in closing:  # outside the lock: a close waits for the child to quit
            old.close()
        return engine

    def _replica(self, spec: PairSpec) -> PairSpec:
        """A replica's spec: with several, each takes its share of the cores (unless threads are set)."""
        if self.replicas == 1 or spec.threads is not None:
            return spec
        return dataclasses.replace(spec, threads=max(1, available_cores() // self.replicas))

    def engines(self, spec: PairSpec) -> list[EngineProcess]:
        """The pair's resident engines (its replicas), none started."""
        with self._lock:
            return list(self._engines.get(spec, []))

    def close_all(self) -> None:
        """Close every engine (a benchmark's pool at its end; a server's lives as long as the server)."""
        with self._lock:
            engines = [e for pair in self._engines.values() for e in pair]
            self._engines.clear()
        for engine in engines:
            engine.close()

    def discard(self, spec: PairSpec, engine: EngineProcess) -> None:
        """Close `engine` (it failed to load) and forget it, unless another has replaced it."""
        with self._lock:
            engines = self._engines.get(spec, [])
            if engine in engines:
                engines.remove(engine)
                if not engines:
                    del self._engines[spec]
        engine.close()

    def resident(self) -> list[tuple[PairSpec, bool]]:
        """(pair, in use) for each resident pair, least recently used first."""
        with self._lock:
            return [(spec, self._busy(spec, engines)) for spec, engines in self._engines.items()]

    def _busy(self, spec: PairSpec, engines: list[EngineProcess]) -> bool:
        alive = any(e.alive for e in engines)
        return alive and (any(e.in_use for e in engines) or time.monotonic() - self._handed.get(spec, 0.0) < HANDOFF_S)

    def _idle(self) -> PairSpec | None:
        return next((spec for spec, engines in self._engines.items() if not self._busy(spec, engines)), None)

    def _full_text(self, spec: PairSpec) -> str:
        names = ", ".join(s.title() for s in self._engines)
        return (
            f"the server keeps at most {self.limit} model pair(s) loaded ({MAX_PAIRS_ENV}) and all are in use "
            f"by other sessions: {names}. Pick one of those pairs, or press Run again when one of them is free, "
            f"to load {spec.title()}."
        )
