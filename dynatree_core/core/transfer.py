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
        are all done already, as after an iteration's marks are read: decoding/clock.py)."""
        if self.pending and not all(end.query() for _, end in self.pending):
            COUNTS["sync"] += 1
        for start, end in self.pending:
            end.synchronize()
            self.done_ms += start.elapsed_time(end)
        self.pending = []
        return self.done_ms
