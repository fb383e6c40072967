"""Where a pair's engine runs: a Ray actor (`EngineActor`) on the node `place` picks, and the app's
side of talking to it (`ActorTransport`, what engine.Engine sends and polls through).

The actor runs engine_child.serve unchanged (load, warm up, "ready", then the child's loop with
its reader thread) in one of its threads; `send` hands it a command through the inbox that serve
reads as its command pipe (numbered: a threaded actor may start two calls out of their order, so
the actor puts them back in it), and `poll` returns the messages serve wrote, waiting up to a
timeout for the first. The parent's side is engine.Engine.

Placement (`place`): each engine goes to a live node with room, at most DYNATREE_MAX_PAIRS engines
a node (replicas count; a CUDA pair's only on nodes with a GPU, where it takes one), the node with
the fewest engines of the same pair first (a replica goes where its pair is not), then the fewest
engines. The counts are this process's: the engines it started and has not seen end.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import threading
import time
from pathlib import Path

from dynatree_core.core.log import log_exception
from dynatree_core.core.settings import env, passed_on
from dynatree_core.errors import DynaTreeError
from dynatree_core.live.engine_child import PairSpec, serve
from dynatree_core.measure.cluster import connect

GATHER_S = 0.03  # how long a poll that has a message waits for more
ROOT = Path(__file__).resolve().parent.parent.parent  # first on an actor's import path
MAX_PAIRS_ENV = "DYNATREE_MAX_PAIRS"
GIB_PER_PAIR = 6  # the default limit: one engine per 6 GiB of memory (what an engine holds: docs/app.md)
MAX_DEFAULT_PAIRS = 4


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 8.0


def max_pairs() -> int:
    """How many engines a node holds at once: DYNATREE_MAX_PAIRS, else one per GIB_PER_PAIR GiB of
    this machine's memory, between 1 and MAX_DEFAULT_PAIRS (a cluster's nodes taken to be alike)."""
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


class _Inbox:
    """The commands `send` delivers, read by serve's reader thread as its pipe (`poll`, `recv`)."""

    def __init__(self):
        self.items: queue.Queue = queue.Queue()
        self.head = None

    def poll(self, timeout_s: float) -> bool:
        if self.head is None:
            try:
                self.head = self.items.get(timeout=timeout_s)
            except queue.Empty:
                return False
        return True

    def recv(self):
        self.poll(None)
        head, self.head = self.head, None
        if head is None:
            raise EOFError
        return head


class EngineActor:
    """The child's side in a Ray actor (threaded: `serve` runs while `send` and `poll` answer)."""

    def __init__(self):
        self.inbox, self.out = _Inbox(), queue.Queue()
        # a threaded actor may start two calls out of their order: commands carry their number
        self.lock, self.next, self.early = threading.Lock(), 0, {}

    def serve(self, spec: PairSpec) -> None:
        """engine_child.serve until "quit": this call returns when the child's loop ends."""
        serve(self.inbox, self.out, spec)

    def node(self) -> str:
        """The Ray node this actor runs on (where actor.place sent it)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def send(self, number: int, command: tuple) -> None:
        """Command `number` (counted from 0) into the inbox, after every one numbered before it."""
        with self.lock:
            self.early[number] = command
            while self.next in self.early:
                self.inbox.items.put(self.early.pop(self.next))
                self.next += 1

    def poll(self, timeout_s: float) -> list:
        """Every message the child wrote, waiting up to `timeout_s` for the first (none: []), then
        up to GATHER_S for more: one call carries a few records, not one each (every call costs
        both processes a round trip; the page draws every RENDER_INTERVAL_S, 0.6 s, anyway)."""
        try:
            messages = [self.out.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + GATHER_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                messages.append(self.out.get(timeout=left))
            except queue.Empty:
                break
        return messages


class NodesFull(DynaTreeError):
    """Every node that could take the engine holds as many engines as it may."""


_PLACED: collections.Counter = collections.Counter()  # (node id, spec) -> engines started there, not yet ended
_PLACING = threading.Lock()


def live_nodes(ray, cuda: bool = False) -> list[dict]:
    """The cluster's live nodes (with a GPU, for a CUDA pair), the head's first, then by node id."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and (not cuda or n["Resources"].get("GPU", 0) >= 1)]
    return sorted(nodes, key=lambda n: (not n["Resources"].get("node:__internal_head__"), n["NodeID"]))


def place(ray, spec: PairSpec) -> str:
    """The node id the engine of `spec` goes to (module docstring); NodesFull when none has room."""
    cuda, spec = spec.device.startswith("cuda"), dataclasses.replace(spec, threads=None)  # replicas: one pair
    per_node = max_pairs()
    with _PLACING:
        nodes = [n["NodeID"] for n in live_nodes(ray, cuda)]
        engines = collections.Counter()
        for (node, _), count in _PLACED.items():
            engines[node] += count
        room = [n for n in nodes if engines[n] < per_node]
        if not room:
            kind = "with a GPU " if cuda else ""
            raise NodesFull(
                f"every node {kind}holds {per_node} engine(s) (DYNATREE_MAX_PAIRS a node; {len(nodes)} node(s)): "
                f"press Run again when a pair is free, or add a node"
            )
        node = min(room, key=lambda n: (_PLACED[n, spec], engines[n]))  # stable: the head first on ties
        _PLACED[node, spec] += 1
    return node


def unplace(node: str, spec: PairSpec) -> None:
    """An engine placed on `node` has ended: its room is free again."""
    spec = dataclasses.replace(spec, threads=None)
    with _PLACING:
        if _PLACED[node, spec] > 0:
            _PLACED[node, spec] -= 1
        if _PLACED[node, spec] == 0:
            del _PLACED[node, spec]


class ActorTransport:
    """The app's side of an engine's actor: `_launch` places and starts it, `_put` sends a command
    (numbered: the actor keeps their order), `_get` returns its next message (a poll in flight at a
    time), `alive`, `_end` and `kill` end it. Every call first checks that the Ray session the actor
    was started in still runs here: Ray initialises itself on use, and an engine of an ended session
    would start a new runtime."""

    spec: PairSpec

    @staticmethod
    def nodes() -> int:
        """The cluster's live nodes (the pool's limit is DYNATREE_MAX_PAIRS a node)."""
        return len(live_nodes(connect()))

    # -- the transport: a Ray actor (actor.py), commands numbered, its messages polled --
    def _launch(self) -> None:
        ray = self._ray = connect()
        self._session = ray.get_runtime_context().get_node_id()  # the driver's node: one a Ray session
        self.node = place(ray, self.spec)
        cuda = self.spec.device.startswith("cuda")
        options = dict(num_cpus=0, num_gpus=1 if cuda else 0, max_concurrency=4, max_restarts=0)
        strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(self.node, soft=False)
        env_vars = passed_on(str(ROOT))
        actor = ray.remote(EngineActor).options(
            runtime_env={"env_vars": env_vars}, scheduling_strategy=strategy, **options
        )
        self._actor = actor.remote()
        self._served = self._actor.serve.remote(self.spec)
        self._inbox: list = []  # messages polled and not yet dispatched
        self._gone: str | None = None  # why the actor ended, once it has
        self._sent = 0  # commands sent
        self._poll = None  # the poll in flight
        self._drained = False  # whether the messages left after serve returned were fetched (_last_messages)

    def _put(self, command: tuple) -> None:
        """One command to the actor (numbered: it keeps their order); OSError when it is gone."""
        if not self.alive:
            raise OSError(self._gone)
        self._actor.send.remote(self._sent, command)
        self._sent += 1  # send() holds its lock around this call

    def _get(self, timeout_s: float) -> tuple:
        """The next message: from the last poll's, else from the poll in flight (one at a time; a
        poll the actor has not answered yet, while it starts or loads, stays in flight).
        queue.Empty after `timeout_s`; EOFError when the actor is gone."""
        if not self._inbox:
            if not self._in_session():
                raise EOFError(self._gone)
            if self._poll is None:
                self._poll = self._actor.poll.remote(timeout_s)
            try:
                ready, _ = self._ray.wait([self._poll], timeout=timeout_s + 1.0)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - Ray shut down meanwhile (it raises SystemExit)
                self._ended(f"Ray ended: {type(exc).__name__}")
                raise EOFError(self._gone) from exc
            if not ready:
                raise queue.Empty
            poll, self._poll = self._poll, None
            try:
                self._inbox = self._ray.get(poll)
            except Exception as exc:  # noqa: BLE001 - the actor died or its node went: the child is gone
                self._ended(f"the Ray actor ended: {type(exc).__name__}")
                raise EOFError(self._gone) from exc
            if not self._inbox:
                raise queue.Empty
        return self._inbox.pop(0)

    def _last_messages(self, timeout_s: float = 10.0) -> bool:
        """Once serve has returned: what it wrote that no poll fetched yet (the poll in flight's, then
        one more poll's) into the inbox, once; whether there was any. A failed load writes "failed" just
        before serve returns, while the first poll may still wait behind the actor's start: without this,
        the parent would see the child gone and report "the engine quit" instead of why."""
        if self._drained or not self._in_session():
            return False
        self._drained = True
        try:
            if self._poll is not None:
                poll, self._poll = self._poll, None
                self._inbox += self._ray.get(poll, timeout=timeout_s)
            self._inbox += self._ray.get(self._actor.poll.remote(0.0), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - the actor went meanwhile, its last messages with it
            log_exception(f"engine {self.spec.title()}: its last messages were lost", exc)
        return bool(self._inbox)

    @property
    def alive(self) -> bool:
        if self._gone is not None or not self._in_session():
            return False
        try:
            ready, _ = self._ray.wait([self._served], timeout=0)
        except Exception as exc:  # noqa: BLE001 - Ray no longer knows the actor: it is gone
            log_exception(f"engine {self.spec.title()}: Ray lost its actor", exc)
            self._ended(f"Ray lost the engine: {type(exc).__name__}")
            return False
        if ready:  # serve returned: "quit", or the load failed
            self._ended("the engine quit")
        return not ready

    def _in_session(self) -> bool:
        """Whether the Ray session the actor was started in still runs here (a Ray call after it
        ended would start a new runtime: Ray initialises itself on use). Marks the end once."""
        ray = self._ray
        try:
            if ray.is_initialized() and ray.get_runtime_context().get_node_id() == self._session:
                return True
        except Exception as exc:  # noqa: BLE001 - Ray shut down between the two calls
            log_exception(f"engine {self.spec.title()}: Ray's session ended", exc)
        self._ended("Ray has shut down")
        return False

    def _ended(self, why: str) -> None:
        """The actor is gone (`why`): its node's room is free again (once)."""
        if self._gone is None:
            self._gone = why
            unplace(self.node, self.spec)

    def _end(self, timeout_s: float) -> None:
        """Wait for the actor's serve to return after "quit", then end the actor."""
        if self._gone is None and self._in_session():
            self._ray.wait([self._served], timeout=timeout_s)
            self._ray.kill(self._actor)
        self._ended("closed")

    def kill(self) -> None:
        """End the actor at once, as a crash would (tests)."""
        if self._gone is None and self._in_session():
            self._ray.kill(self._actor)
        self._ended("killed")

    def _exit_text(self) -> str:
        return self._gone or "still running"
