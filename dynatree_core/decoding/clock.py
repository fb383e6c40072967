"""One iteration's timings in one object (`IterationClock`), so the loop body reads as its steps.

What is measured and how (no sync of its own: marks are queued behind the work and read after the
verification's read) is core/transfer.PhaseClock's; this module says which phase each mark closes
and takes graph captures, set-up and not work, out of the phase they fell in.
"""

from __future__ import annotations

import contextlib
import time

from dynatree_core.core.transfer import PhaseClock


class IterationClock:
    """One iteration's timings in one place. The phase boundaries (draft done, rows built, verify
    forward queued) are marked without waiting for the device (core/transfer.PhaseClock) and read
    after the verification's read; graph captures inside a phase are set-up, not its work, and are
    taken out of it; commit and record are host work, timed on the host. `fill` writes them into
    the record, with the draft's forwards and its time inside them."""

    def __init__(self, state):
        """`state`: the run's (engine.DecodeState)."""
        self.state = state
        self.captured_s = state.capture_s()
        self.draft_forwards, self.draft_forward_ms = state.draft_forwards(), state.draft_forward_ms()
        self.phases = PhaseClock(state.device)
        self.phases.mark()
        self.draft_capture_ms = self.verify_capture_ms = 0.0
        self.width = 0  # rows of the verify forward
        self.refresh_ms = 0.0  # host work after the verification that is the next draft's (refreshing)

    def _capture_ms(self) -> float:
        return (self.state.capture_s() - self.captured_s) * 1e3

    def draft_done(self) -> None:
        self.phases.mark()
        self.draft_capture_ms = self._capture_ms()

    def batch_built(self) -> None:
        self.phases.mark()

    def verify_done(self, width: int) -> None:
        """The verify forward is queued (on a GPU it may still run); `width`: its rows."""
        self.phases.mark()
        self.verify_capture_ms = self._capture_ms() - self.draft_capture_ms
        self.width = width

    def verified(self) -> None:
        """After the verification's read: the marks are done, reading them waits for nothing."""
        self.marks = self.phases.read()[1:]
        self.host_s = self.phases.host_start()

    @contextlib.contextmanager
    def refreshing(self):
        """Host work between the verification and the commit that belongs to drafting (a recycled
        matrix's refresh from the verify forward's rows): counted as draft time, not commit time."""
        start = time.perf_counter()
        yield
        self.refresh_ms += (time.perf_counter() - start) * 1e3

    def committed(self) -> None:
        self.committed_s = time.perf_counter()

    def fill(self, record) -> None:
        """Write the timings and counters into the iteration's record (runs/records.IterationRecord)."""
        state, (t1, t2, t3) = self.state, self.marks
        record.draft_forwards = state.draft_forwards() - self.draft_forwards
        record.capture_ms = self.draft_capture_ms + self.verify_capture_ms
        record.verify_rows = self.width
        record.draft_ms = t1 - self.draft_capture_ms + self.refresh_ms
        record.verify_ms = t3 - t2 - self.verify_capture_ms
        # with the verification on a CPU; host work on a GPU; less a refresh (drafting's)
        record.commit_ms = (self.committed_s - self.host_s) * 1e3 - self.refresh_ms
        record.overhead_ms = t2 - t1 + (time.perf_counter() - self.committed_s) * 1e3
        # the draft's forward time: its CUDA events are done by now, so reading them waits for nothing
        record.draft_forward_ms = state.draft_forward_ms() - self.draft_forward_ms
