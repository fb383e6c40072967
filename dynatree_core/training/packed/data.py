"""`train-packed`'s batches (`make draft-feature-long`): packed answer windows, no padding, no target head.

`AnswerCorpus` (answers/windows.py) cuts every stored sequence into windows of at most WINDOW
positions. A padded batch of such windows is about half padding (most answers are far shorter
than a window). Here the windows of a step are packed first-fit-decreasing into rows of ROW
positions; attention stays inside each window (a block-diagonal causal mask, or its tree-level
generalisation `level_mask`), and each window's pairs restart at position 1, exactly as if it
were alone in its row.

What a step reads per pair j of a window (the target's state at position j, the token x_{j+1}):
its input (the final feature f_j, or the target's taps at j for the fused kind, as stored by
`answers-relabel`), the regression goal f_{j+1} (feature kind only), and the compact teacher at
position j + 1 (answers.compact_teacher: top-k ids, logits, log-sum-exp) mapped onto the draft's
token map and renormalised over the entries the map holds. A pair counts toward the loss when
its next token is part of the answer and the teacher's argmax is a token the map can propose
(EAGLE-3 masks the others out: the draft could never propose them).

Batches are assembled on background threads (`prefetch`), so reading the memory-mapped shards
overlaps the previous steps' arithmetic.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from dynatree_core.core.vocab import OTHER, TokenMap
from dynatree_core.forward.reference import additive
from dynatree_core.forward.rows import visibility
from dynatree_core.training.answers.store import STAGES, AnswerStore
from dynatree_core.training.answers.windows import AnswerCorpus

ROW = 512


@dataclasses.dataclass
class PackedBatch:
    """One step's rows. R rows of T = ROW pair slots; empty slots have seg -1.

    tokens (R, T) int64 x_{j+1}; inputs (R, T, H) or (R, T, n_taps, H) float16 target states;
    goal (R, T, H) float16 f_{j+1} or None; positions (R, T) int64 (1-based within a window);
    seg (R, T) int64 window index within the row (-1: empty); answer (R, T) bool: the pair's next
    token is an answer token; counted (R, T) bool: an answer pair the map can learn (the loss's);
    teacher_slots (R, T, K) int64 draft slots (OTHER where the map lacks the token);
    teacher_p (R, T, K) float32, summing to 1 over a counted pair's slots; pairs: real pair slots;
    answer_pairs: the answer pairs among them (what a pass counts); plan: the step's choices made on
    the host (packed/step.py's StepPlan), or None."""

    tokens: torch.Tensor
    inputs: torch.Tensor
    goal: torch.Tensor | None
    positions: torch.Tensor
    seg: torch.Tensor
    answer: torch.Tensor
    counted: torch.Tensor
    teacher_slots: torch.Tensor
    teacher_p: torch.Tensor
    pairs: int
    answer_pairs: int = 0
    plan: object = None

    def to(self, device: torch.device) -> PackedBatch:
        return self._mapped(lambda t: t.to(device, non_blocking=True))

    def pinned(self) -> PackedBatch:
        """In page-locked memory: its upload to a GPU runs behind the queued kernels, not before them."""
        return self._mapped(torch.Tensor.pin_memory)

    def _mapped(self, fn) -> PackedBatch:
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = fn(value)
            elif name == "plan" and value is not None:
                moved[name] = value.to_all(fn)
        return PackedBatch(**moved)


def pack_rows(lengths: list[int], row: int = ROW) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` (each <= row) grouped into as few rows as it finds."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(row - lengths[i])
    return rows


def level_mask(seg: torch.Tensor, level: int) -> torch.Tensor:
    """(R, 1, T, level * T) additive mask for the rows of tree level `level` (1-based) of packed
    windows, against the keys of levels 1..level stacked in order (feature/depth.depth_mask's
    rule, per window, through the one visibility rule, forward/rows.visibility): row j of level k
    is a depth-k node whose root is pair r = j - k + 1 of the same window; it sees that window's
    level-1 pairs from its start to r (committed: true inputs), its ancestors (level m at pair
    r + m - 1, m = 2..k-1) and itself. A row whose root would lie outside its window sees only
    itself (it is never counted). Level 1 is the plain causal mask per window.
    Built on `seg`'s device: on the host it cost a training step ~24 ms (20 rows of 512) and a
    copy of the (R, 1, T, T) mask to the GPU."""
    rows, width = seg.shape
    j = torch.arange(width, device=seg.device)
    k = level - 1
    root = j - k  # (T,)
    root_ok = (root >= 0) & (seg.gather(1, root.clamp(min=0)[None].expand(rows, -1)) == seg) & (seg >= 0)  # (R, T)
    # where each key's window starts: the window's level-1 keys are those from its start to the root
    starts = torch.cat([torch.ones_like(seg[:, :1], dtype=torch.bool), seg[:, 1:] != seg[:, :-1]], dim=1)
    start = torch.where(starts, j, 0).cummax(dim=1).values
    own, hops = (k * width + j)[:, None], torch.arange(1, level, device=seg.device)  # levels 2 .. level
    lines = torch.cat([(hops * width + root[:, None] + hops).expand(width, -1), own], dim=1)  # ancestors, itself
    lines = torch.where(root_ok[:, :, None], lines, own)  # a row with no root in its window: itself alone
    see = visibility(root + 1, lines, level * width, real=root_ok, start=start)
    return additive(see, torch.float32)[:, None]


class PackedAnswers:
    """The answer shards as packed batches for one draft kind (module docstring).

    `taps`: the tapped layers the inputs come from (the fused kind), or None for the final
    features (the feature kind, which also reads the regression goal)."""

    def __init__(
        self,
        store: AnswerStore,
        token_map: TokenMap,
        *,
        taps: tuple[int, ...] | None = None,
        stages: tuple[str, ...] = STAGES,
        heldout=None,
        row: int = ROW,
    ):
        self.windows = AnswerCorpus(store, stages=stages, heldout=heldout, window=row)
        self.taps, self.row = taps, row
        self.to_draft = token_map.target_to_draft.numpy()
        self.inputs: list[np.ndarray] = []
        self.teacher: list[dict[str, np.ndarray]] = []
        keep = []
        parts = [(s, k) for s in stages for k in store.shards(s) if store.has_features(s, k)]
        for stage, k in parts:
            ok = store.has_teacher(stage, k) and (taps is None or store.has_taps(stage, k, taps))
            keep.append(ok)
            self.inputs.append(np.load(store.taps_path(stage, k, taps), mmap_mode="r") if ok and taps else None)
            self.teacher.append(dict(np.load(store.teacher_path(stage, k))) if ok else None)
        usable = np.asarray(keep, dtype=bool)[self.windows.rows[:, 0]] if len(self.windows.rows) else np.zeros(0, bool)
        self.train_rows = self.windows.train_rows[usable[self.windows.train_rows]]
        self.eval_rows = self.windows.eval_rows[usable[self.windows.eval_rows]]

    def answer_pairs(self, rows: np.ndarray | None = None) -> int:
        """Answer pairs (loss positions) of `rows` (default: the training windows): what a pass counts."""
        return self.windows.answer_tokens(self.train_rows if rows is None else rows)

    def batch(self, rows: np.ndarray, *, with_goal: bool = False) -> PackedBatch:
        """The windows `rows` (indices into the window table) packed into one PackedBatch; the
        feature kind always reads the goal (its regression target), the fused kind `with_goal`."""
        table = self.windows.rows[rows]
        pairs = [int(n) - 1 for n in table[:, 4]]  # a window of n positions holds n - 1 pairs
        packing = pack_rows(pairs, self.row)
        n_rows, width = len(packing), self.row
        hidden = self.windows.features[0].shape[-1]
        shape = (n_rows, width, len(self.taps), hidden) if self.taps else (n_rows, width, hidden)
        inputs = np.zeros(shape, dtype=np.float16)
        goal = np.zeros((n_rows, width, hidden), dtype=np.float16) if with_goal or not self.taps else None
        tokens = np.zeros((n_rows, width), dtype=np.int64)
        positions = np.zeros((n_rows, width), dtype=np.int64)
        seg = np.full((n_rows, width), -1, dtype=np.int64)
        counted = np.zeros((n_rows, width), dtype=bool)
        answers = np.zeros((n_rows, width), dtype=bool)
        k = self.teacher[int(table[0, 0])]["ids"].shape[1]
        slots = np.zeros((n_rows, width, k), dtype=np.int64)
        probs = np.zeros((n_rows, width, k), dtype=np.float32)
        for r, members in enumerate(packing):
            at = 0
            for s, i in enumerate(members):
                part, id_off, f_off, start, length, plen, _ = (int(v) for v in table[i])
                n = length - 1
                span = slice(at, at + n)
                ids = self.windows.ids[part][id_off + start : id_off + start + length]
                tokens[r, span] = ids[1:]
                positions[r, span] = np.arange(1, n + 1)
                seg[r, span] = s
                feats = self.windows.features[part]
                source = self.inputs[part] if self.taps else feats
                inputs[r, span] = source[f_off + start : f_off + start + n]
                if goal is not None:
                    goal[r, span] = feats[f_off + start + 1 : f_off + start + length]
                teach = self.teacher[part]
                nxt = slice(f_off + start + 1, f_off + start + length)  # the teacher at position j + 1
                answer = np.arange(start + 1, start + length) + 1 >= plen  # the token after j + 1 is an answer token
                top = self.to_draft[teach["ids"][nxt].astype(np.int64)]  # (n, K) draft slots
                p = np.exp(teach["logits"][nxt].astype(np.float32) - teach["lse"][nxt, None])
                p = np.where(top != OTHER, p, 0.0)
                total = p.sum(-1, keepdims=True)
                ok = answer & np.isfinite(teach["lse"][nxt]) & (top[:, 0] != OTHER) & (total[:, 0] > 0)
                counted[r, span] = ok
                answers[r, span] = answer
                slots[r, span] = top
                probs[r, span] = np.where(ok[:, None], p / np.maximum(total, 1e-30), 0.0)
                at += n
        as_t = torch.from_numpy
        return PackedBatch(
            tokens=as_t(tokens),
            inputs=as_t(inputs),
            goal=None if goal is None else as_t(goal),
            positions=as_t(positions),
            seg=as_t(seg),
            answer=as_t(answers),
            counted=as_t(counted),
            teacher_slots=as_t(slots),
            teacher_p=as_t(probs),
            pairs=int(sum(pairs)),
            answer_pairs=int(answers.sum()),
        )

    def step_rows(self, order: np.ndarray, cursor: int, pairs: int) -> tuple[np.ndarray, int]:
        """Windows from `order` starting at `cursor` until they hold about `pairs` pairs; the new cursor."""
        lengths = self.windows.rows[order, 4] - 1
        end = cursor
        total = 0
        while end < len(order) and (total < pairs or end == cursor):
            total += int(lengths[end])
            end += 1
        return order[cursor:end], end


PREFETCH_WAIT_S = 600.0  # a batch not ready after this long: the building is stuck, said as such


def prefetch(make, build=None, *, depth: int = 2, workers: int = 1, wait_s: float = PREFETCH_WAIT_S):
    """Iterate `build(item)` for `make()`'s items, in their order, built by `workers` background
    threads (reading the shards and numpy's copies release the GIL: a GPU's step outruns one
    thread), up to `depth` finished ahead. A failure of `make` or `build` is raised here, and a
    batch that takes over `wait_s` seconds is a TimeoutError naming the wait."""
    build = build or (lambda item: item)
    ahead: queue.Queue = queue.Queue(maxsize=depth + workers - 1)
    stop = threading.Event()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="prefetch")

    def put(value) -> None:
        while not stop.is_set():
            try:
                return ahead.put(value, timeout=0.1)
            except queue.Full:
                continue

    def produce() -> None:
        try:
            for item in make():
                if stop.is_set():
                    return
                put(pool.submit(build, item))
        except BaseException as error:  # noqa: BLE001  (handed to the reader, raised there)
            put(error)
            return
        put(None)

    threading.Thread(target=produce, daemon=True, name="prefetch-order").start()
    stuck = f"prefetch: no batch built in {wait_s:.0f} s (reading the answer shards is stuck)"
    try:
        while True:
            try:
                got = ahead.get(timeout=wait_s)
            except queue.Empty:
                raise TimeoutError(stuck) from None
            if got is None:
                return
            if isinstance(got, BaseException):  # `make`'s own failure, as it came
                raise got
            if not wait([got], timeout=wait_s).done:  # waited apart: `build`'s own TimeoutError stays its own
                raise TimeoutError(stuck)
            yield got.result()
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
