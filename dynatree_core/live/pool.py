"""The resident model pairs of a server: one Engine per pair (or several replicas, DYNATREE_REPLICAS),
shared by every page and session, at most DYNATREE_MAX_PAIRS engines a node (the default fits
the machine's memory), placed by actor.place.

With replicas, a request gets the pair's least loaded engine (the fewest unfinished runs and
unanswered jobs), so two sessions on one pair decode side by side instead of taking turns an
iteration each. A number starts that many together, each with its share of its node's cores;
"auto" starts one and adds one on another node whenever a request finds every engine of the pair
busy (a replica a node at most: on one machine, set a number).

A pair nobody uses (engine.Engine.in_use: no live run that has not finished, no queued or running
job, not loading) may be closed to make room, least recently used first. A pair in use is never
closed: a session that needs one more pair than the limit allows, while every resident pair is in
use, gets PoolFull, a message naming the pairs and what to do.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

from dynatree_core.core.log import log_info
from dynatree_core.core.settings import env
from dynatree_core.core.threads import available_cores
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.actor import MAX_PAIRS_ENV, NodesFull, max_pairs
from dynatree_core.live.engine import Engine, PairSpec

REPLICAS_ENV = "DYNATREE_REPLICAS"
HANDOFF_S = 30.0  # an engine just handed out stays resident this long, until its user registers a run
AUTO = 0  # replicas_wanted() for "auto"


class PoolFull(DynaTreeError):
    """Every resident pair is in use and the limit allows no other."""


def replicas_wanted() -> int:
    """How many engines each pair gets: DYNATREE_REPLICAS, a number (default 1) or "auto" (AUTO)."""
    raw = env(REPLICAS_ENV)
    if raw.lower() == "auto":
        return AUTO
    try:
        value = int(raw or 1)
    except ValueError:
        raise DynaTreeError(f"{REPLICAS_ENV}={raw!r} is not a whole number or auto") from None
    if value < 1:
        raise DynaTreeError(f"{REPLICAS_ENV} must be at least 1 (or auto), not {value}")
    return value


class EnginePool:
    """Engines by pair (`replicas` each, AUTO: as needed), at most `limit` resident (default:
    DYNATREE_MAX_PAIRS a node, times the nodes), never closing one in use."""

    def __init__(
        self,
        limit: int | None = None,
        start: Callable[[PairSpec], Engine] = Engine,
        replicas: int | None = None,
    ):
        self._limit = limit
        self.replicas = replicas_wanted() if replicas is None else replicas
        self._start = start
        self._engines: collections.OrderedDict[PairSpec, list[Engine]] = collections.OrderedDict()
        self._handed: dict[PairSpec, float] = {}  # when each pair's engine was last handed out
        self._lock = threading.Lock()

    def _nodes(self) -> int:
        """The nodes engines may go to (an engine class without nodes: one machine)."""
        nodes = getattr(self._start, "nodes", None)
        return nodes() if nodes is not None else 1

    @property
    def limit(self) -> int:
        return self._capacity(self._nodes())

    def _capacity(self, nodes: int) -> int:
        return self._limit if self._limit is not None else max_pairs() * nodes

    def get(self, spec: PairSpec) -> Engine:
        """The pair's least loaded engine, its replicas started if needed (each loads in its own
        process: wait_ready() waits). A dead engine is replaced. PoolFull when the limit is reached
        and every resident pair is in use."""
        closing = []
        with self._lock:
            engines = self._engines.pop(spec, [])
            closing += [e for e in engines if not e.alive]  # died (or failed to load): start again
            engines = [e for e in engines if e.alive]
            nodes = self._nodes()  # asked once a request (on Ray: one call to the cluster)
            limit, wanted = self._capacity(nodes), self._wanted(engines, nodes)
            while len(engines) < wanted:
                victim = None
                if sum(map(len, self._engines.values())) + len(engines) < limit:
                    try:
                        engines.append(self._start(self._replica(spec, nodes)))
                        resident = sum(map(len, self._engines.values())) + len(engines)
                        log_info("pool: started %s (%d of %d resident)", spec.title(), resident, limit)
                        continue
                    except NodesFull:  # the nodes that could take it are full: make room as for the limit
                        victim = self._idle()
                        if victim is None and not engines:
                            raise
                else:
                    victim = self._idle()
                if victim is None:
                    if engines:  # serve with the replicas there are
                        break
                    raise PoolFull(self._full_text(spec))
                closing += self._engines.pop(victim)
                log_info("pool: %s closed to make room for %s", victim.title(), spec.title())
            self._engines[spec] = engines  # the most recently used last
            self._handed[spec] = time.monotonic()
            engine = min(engines, key=lambda e: (not getattr(e, "ready", True), getattr(e, "load", 0)))
        for old in closing:  # outside the lock: a close waits for the child to quit
            old.close()
        return engine

    def _wanted(self, engines: list[Engine], nodes: int) -> int:
        """How many engines the pair should have: the setting's number; with AUTO one, and one more
        (up to one a node) while every engine it has is loaded and busy."""
        if self.replicas != AUTO:
            return self.replicas
        busy = engines and all(getattr(e, "ready", True) and getattr(e, "load", 0) > 0 for e in engines)
        return min(len(engines) + 1, nodes) if busy else max(1, len(engines))

    def _replica(self, spec: PairSpec, nodes: int) -> PairSpec:
        """A replica's spec: where several share a node, each takes its share of the node's cores
        (unless threads are set); AUTO's replicas each have a node."""
        per_node = -(-self.replicas // nodes) if self.replicas != AUTO else 1
        if per_node == 1 or spec.threads is not None:
            return spec
        return dataclasses.replace(spec, threads=max(1, available_cores() // per_node))

    def engines(self, spec: PairSpec) -> list[Engine]:
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

    def discard(self, spec: PairSpec, engine: Engine) -> None:
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

    def _busy(self, spec: PairSpec, engines: list[Engine]) -> bool:
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
