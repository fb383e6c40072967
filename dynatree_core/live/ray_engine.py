"""An engine whose child is a Ray actor (DYNATREE_LIVE_ENGINE=ray): the same engine, protocol and
rules as engine_process.py's, with Ray as the transport, so a pair's engine may run on any node of
a cluster (a GPU node for a CUDA pair).

The actor runs engine_child.serve unchanged (load, warm up, "ready", then the child's loop with
its reader thread) in one of its threads; `send` hands it a command through the inbox that serve
reads as its command pipe (numbered: a threaded actor may start two calls out of their order,
so the actor puts them back in it), and `poll` returns the messages serve wrote, waiting up to a timeout
for the first. The parent's side is EngineProcess with three calls swapped (`_launch`, `_put`,
`_get`): its dispatcher thread polls the actor, and everything else (listeners, the job queue,
in_use, wait_ready, the "busy" answer to a step while a job runs) is the one implementation. An
actor that dies (its node lost, killed) fails the poll: every run and job then gets the message,
as with a dead process. The actor belongs to the app's process (not detached): it ends with it.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from dynatree_core.core.settings import passed_on
from dynatree_core.live.engine_child import POLL_S, PairSpec, serve
from dynatree_core.live.engine_process import EngineProcess

ROOT = Path(__file__).resolve().parent.parent.parent
GATHER_S = 0.03  # how long a poll that has a message waits for more


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


class RayEngine(EngineProcess):
    """EngineProcess over a Ray actor (module docstring)."""

    def _launch(self) -> None:
        from dynatree_core.measure.cluster import connect

        ray = self._ray = connect()
        cuda = self.spec.device.startswith("cuda")
        options = dict(num_cpus=0, num_gpus=1 if cuda else 0, max_concurrency=4, max_restarts=0)
        actor = ray.remote(EngineActor).options(runtime_env={"env_vars": passed_on(str(ROOT))}, **options)
        self._actor = actor.remote()
        self._served = self._actor.serve.remote(self.spec)
        self._inbox: list = []  # messages polled and not yet dispatched
        self._gone: str | None = None  # why the actor ended, once it has
        self._sent = 0  # commands sent
        self._poll = None  # the poll in flight

    def _put(self, command: tuple) -> None:
        if not self.alive:
            raise OSError(self._gone)
        self._actor.send.remote(self._sent, command)  # numbered: the actor keeps their order
        self._sent += 1  # EngineProcess.send holds its lock around this call

    def _get(self, timeout_s: float) -> tuple:
        """The next message: from the last poll's, else from the poll in flight (one at a time; a
        poll the actor has not answered yet, while it starts or loads, stays in flight)."""
        if not self._inbox:
            if self._poll is None:
                self._poll = self._actor.poll.remote(timeout_s)
            ready, _ = self._ray.wait([self._poll], timeout=timeout_s + 1.0)
            if not ready:
                raise queue.Empty
            poll, self._poll = self._poll, None
            try:
                self._inbox = self._ray.get(poll)
            except Exception as exc:  # noqa: BLE001 - the actor died or its node went: the child is gone
                self._gone = f"the Ray actor ended: {type(exc).__name__}"
                raise EOFError(self._gone) from exc
            if not self._inbox:
                raise queue.Empty
        return self._inbox.pop(0)

    @property
    def alive(self) -> bool:
        if self._gone is not None:
            return False
        if not self._ray.is_initialized():  # Ray itself has shut down (this process is ending)
            self._gone = "Ray has shut down"
            return False
        ready, _ = self._ray.wait([self._served], timeout=0)
        if ready:  # serve returned: "quit", or the load failed
            self._gone = "the engine quit"
        return not ready

    def _end(self, timeout_s: float) -> None:
        self._ray.wait([self._served], timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        self._ray.kill(self._actor)

    def _exit_text(self) -> str:
        return self._gone or "still running"


__all__ = ["POLL_S", "RayEngine"]
