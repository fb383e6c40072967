"""Copies between the host and a model's device, and the clocks around forwards, in one place.

On a GPU every copy the host waits for (a device->host read such as `.tolist()`, an upload from
pageable memory) and every `synchronize` stalls the queue of kernels; one per layer or per node
adds up to more than the arithmetic of a small model. Code on the decoding path moves data
through these functions, which count what they do on every device (on a CPU they cost nothing),
so a test can hold one iteration to a fixed number of host round trips on a machine without a GPU.

`Stopwatch` times a span without synchronising on CUDA: it records events and reads them when
asked, after the iteration's own sync (a verification's argmax read).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import torch

COUNTS: Counter = Counter()  # "to_device", "to_host", "sync", "late": process-wide, for tests and gpu-check


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One upload (nothing to do when `t` is already there)."""
    COUNTS["to_device"] += 1
    return t.to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into a buffer: one upload, straight into it, where `src` is on another device."""
    if src.device != dst.device:
        COUNTS["to_device"] += 1
    dst.copy_(src, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """One device->host read (the host waits for the device)."""
    COUNTS["to_host"] += 1
    return t.cpu()


def to_list(t: torch.Tensor) -> list:
    COUNTS["to_host"] += 1
    return t.tolist()


def sync(device: torch.device) -> None:
    COUNTS["sync"] += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LateRead:
    """A small device value read one step late: copied behind the work that makes it (into pinned
    memory, without waiting) and read once the host has queued the next step, so waiting for it
    never leaves the device idle. Counted as "late", apart from "to_host" reads, which drain the
    queue (drafting/device.py reads whether a level admitted anything this way)."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def item(self):
        return self._wait().item()

    def tolist(self) -> list:
        return self._wait().tolist()

    def _wait(self) -> torch.Tensor:
        COUNTS["late"] += 1
        if self.event is not None:
            self.event.synchronize()
        return self.host


@contextlib.contextmanager
def counting():
    """The copies and syncs made inside the block: `with counting() as c: ...; c["to_host"]`."""
    before = Counter(COUNTS)
    diff: Counter = Counter()
    try:
        yield diff
    finally:
        diff.update({k: COUNTS[k] - before.get(k, 0) for k in COUNTS})


class PhaseClock:
    """The phase boundaries of one iteration, marked without waiting for the device: perf_counter
    on a CPU, CUDA events on a GPU (a mark is queued behind the work before it). Read after the
    iteration's blocking read (the verification's), the marks before it are done: reading them
    waits for nothing, so an iteration's timing costs no sync of its own. What follows that read
    (the commit, the record) is host work and queued launches, timed on the host from `host_start`.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.reads_at_mark = 0  # COUNTS["to_host"] at the last mark

    def mark(self) -> None:
        self.reads_at_mark = COUNTS["to_host"]
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def read(self) -> list[float]:
        """Milliseconds from the first mark to each mark. Without a device->host read since the
        last mark it waits for the device: one sync, counted on every device (so CPU tests hold a
        GPU's count); after one, the events are done and nothing is counted."""
        waits = COUNTS["to_host"] == self.reads_at_mark
        COUNTS["sync"] += waits
        self._read_at = time.perf_counter()
        if not self.cuda:
            return [(t - self.marks[0]) * 1e3 for t in self.marks]
        self.marks[-1].synchronize()  # done already after a read: returns at once
        return [self.marks[0].elapsed_time(e) for e in self.marks]

    def host_start(self) -> float:
        """Where host-timed spans after `read` start (perf_counter seconds): the last mark on a CPU
        (its clock is the host's), the read itself on a GPU (what came before is the device's)."""
        return self._read_at if self.cuda else self.marks[-1]


class Stopwatch:
    """Sums spans of work on one device: perf_counter on a CPU, CUDA events (no sync) on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.done_ms = 0.0
        self.pending: list[tuple] = []  # (start event, end event) not read yet
        self._start = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self, minus_ms: float = 0.0) -> None:
        """End the span; `minus_ms` is time inside it that is not the work (a graph capture)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self._start, end))
        else:
            self.done_ms += (time.perf_counter() - self._start) * 1e3
        self.done_ms -= minus_ms

    @property
    def ms(self) -> float:
        """The total so far (on CUDA, waits for the recorded events: one sync, counted, unless they
        are all done already, as after an iteration's PhaseClock.read)."""
        if self.pending and not all(end.query() for _, end in self.pending):
            COUNTS["sync"] += 1
        for start, end in self.pending:
            end.synchronize()
            self.done_ms += start.elapsed_time(end)
        self.pending = []
        return self.done_ms
