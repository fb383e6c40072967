"""One iteration's timings in one object (`IterationClock`), so the loop body reads as its steps.

The device phases (draft, rows, verify) end at marks queued behind their work, never waited for:
perf_counter on a CPU, CUDA events on a GPU. They are read once, after the verification's read
(the iteration's one blocking read): by then every mark is done, so timing an iteration costs no
sync of its own. What follows that read (the commit, the record) is host work, timed on the host.
Graph captures inside a phase are set-up, not its work, and are taken out of it.
"""

from __future__ import annotations

import contextlib
import time

import torch

from dynatree_core.core.transfer import COUNTS

PHASES = ("draft", "rows", "verify")  # the device phases, in the order their marks close them


class IterationClock:
    """One iteration's timings: `mark` closes a phase, `verified` reads the marks after the
    verification's read, `mark("commit")` ends the commit on the host, and `fill` writes the
    timings and the draft's counters into the record."""

    def __init__(self, state):
        """`state`: the run's (engine.DecodeState)."""
        self.kvs = [state.target_kv] + ([state.drafter.kv] if state.drafter is not None else [])
        self.cuda = state.device.type == "cuda"
        draft = self.kvs[1] if len(self.kvs) > 1 else None
        self.draft_start = (draft.forwards, draft.watch.ms) if draft is not None else (0, 0.0)
        self.capture_start = self._capture_s()
        self.capture_ms = dict.fromkeys(PHASES, 0.0)  # capture time inside each phase
        self.marks = [self._now()]
        self.reads_at_mark = COUNTS["to_host"]  # whether a read since the last mark waited for the device
        self.width = 0  # rows of the verify forward
        self.refresh_ms = 0.0  # host work after the verification that is the next draft's (refreshing)

    def _capture_s(self) -> float:
        return sum(kv.capture_s for kv in self.kvs)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, phase: str, width: int = 0) -> None:
        """Close `phase`: "draft", "rows" (the verify batch built), "verify" (its forward queued,
        of `width` rows; on a GPU it may still run) on the device's clock; "commit" on the host's."""
        if phase == "commit":
            self.committed_s = time.perf_counter()
            return
        self.marks.append(self._now())
        self.reads_at_mark = COUNTS["to_host"]
        self.capture_ms[phase] = (self._capture_s() - self.capture_start) * 1e3 - sum(self.capture_ms.values())
        self.width = width or self.width

    def verified(self) -> None:
        """After the verification's read: read the marks (ms from the first). Without a device->host
        read since the last mark this waits for the device: one sync, counted on every device (so
        CPU tests hold a GPU's count); after one, the marks are done and nothing is counted."""
        COUNTS["sync"] += COUNTS["to_host"] == self.reads_at_mark
        self.host_s = time.perf_counter()
        if self.cuda:
            self.marks[-1].synchronize()  # done already after a read: returns at once
            self.ms = [self.marks[0].elapsed_time(e) for e in self.marks[1:]]
        else:
            self.ms = [(t - self.marks[0]) * 1e3 for t in self.marks[1:]]
            self.host_s = self.marks[-1]  # on a CPU the host's clock is the device's

    @contextlib.contextmanager
    def refreshing(self):
        """Host work between the verification and the commit that belongs to drafting (a recycled
        matrix's refresh from the verify forward's rows): counted as draft time, not commit time."""
        start = time.perf_counter()
        yield
        self.refresh_ms += (time.perf_counter() - start) * 1e3

    def fill(self, record) -> None:
        """Write the timings and the draft's counters into the iteration's record (runs/records.IterationRecord)."""
        (t1, t2, t3), capture = self.ms, self.capture_ms
        forwards, forward_ms = self.draft_start
        if len(self.kvs) > 1:  # the draft's CUDA events are done by now: reading them waits for nothing
            forwards, forward_ms = self.kvs[1].forwards - forwards, self.kvs[1].watch.ms - forward_ms
        record.draft_forwards, record.draft_forward_ms = forwards, forward_ms
        record.capture_ms = capture["draft"] + capture["rows"] + capture["verify"]
        record.verify_rows = self.width
        record.draft_ms = t1 - capture["draft"] + self.refresh_ms
        record.verify_ms = t3 - t2 - capture["verify"] - capture["rows"]
        # with the verification on a CPU; host work on a GPU; less a refresh (drafting's)
        record.commit_ms = (self.committed_s - self.host_s) * 1e3 - self.refresh_ms
        record.overhead_ms = t2 - t1 + (time.perf_counter() - self.committed_s) * 1e3
