"""Captured forwards: the lean forward at fixed shapes, replayed as one CUDA graph per width.

On a GPU a 135M-parameter model is launch-bound: HF's eager forward issues hundreds of small
kernels per token, and a forward costs about the same whatever its width from 1 to 256 tokens
(BENCHMARKS.md, "GPU (lent H200 and H100) and captured forwards").
Engines that do this well capture the forward once per width and replay it (gpt-fast; SGLang's
CUDA-graph runner captures the EAGLE verify forward at a fixed number of draft tokens). A graph
replays fixed shapes over fixed addresses, so `PaddedForward` runs the lean forward (fastpath.py)
at fixed shapes over the static cache (kv.SlotLayer):

- width buckets: q new rows are padded to the next bucket (1, 2, 4, ... MAX_BUCKET); a padded
  row reads token 0 at position 0, sees only its own slot, and writes its keys/values into the
  free slots after the valid ones (never read: the next forward overwrites them);
- attention over a span of the buffer: the first `span` slots, span = the next power of two
  (at least MIN_SPAN) above the valid slots plus the bucket, capped at the capacity; the additive
  mask is (bucket, span), every slot past the valid ones masked out. A forward reads the keys in
  use, not the whole buffer, and a graph is captured per (bucket, span): a few spans per run;
- the bucket a width runs at is measured on CUDA (`measured_width`): at its first capture each
  bucket is timed against the wider ones up to MEASURE_UP_TO rows and the fastest kept (cuBLAS's
  float32 GEMM can pick slow tiles at narrow widths, where a wider bucket runs faster);
- new keys/values go to the slots named in a slot buffer (`index_copy_`), not to a Python slice;
- width-invariant runs (`static`): no mask; each row's slots and padding (static_rows.StaticRows,
  the run's span) are the static inputs instead, so the same rows replay bitwise at any bucket.

Capturing is forward/capture.py's one mechanism, `StepGraphs`: every forward at fixed shapes is a
pure step, `filled` (a fill that makes the rows, then the lean forward), captured once per key
and replayed. Rows the caller built (`__call__`) go into fixed input buffers per width and span
(ids and positions, the visibility, the cache's length, draft input vectors), filled in place
and read where they are by the step ("forward", width, span, vectors, the buffers' epoch), one
per width bucket and span; a forward whose inputs the device makes (a draft level's rows from
the committed length, the verify rows: KVState.level) is a step of the run's own whose fill makes
them. On CUDA the steps are CUDA graphs; on a stand-in device (capture.STAND_IN_DEVICES: tests,
measure/launches.py) stand-in graphs; elsewhere the same steps run eagerly, which is what the
CPU tests compare against the unpadded forward. Wider forwards than the largest bucket (a long
prompt's prefill) take the unpadded lean path. A cache that grows, by either path, reallocates
its buffers: the graphs captured over the old ones are released before the next call (checked
on every call, not only when this class grows them itself).

Safety: a capture that fails (out of memory, an op that cannot be captured, a library version)
warns once, and the model goes on with the same padded forward run eagerly (`path` says why); the
forwards' graphs of every run on one device share one memory pool (replays never overlap: one
stream), and a pool whose graphs are all gone is never reused for a new capture (torch asserts);
capture streams are made on the model's device (cuda:N); models whose rotary update has a
data-dependent branch (`capture_safe`) are never captured; capture seconds are counted apart
(`capture_s`), so forward timings and cost models see replays only.
"""

from __future__ import annotations

import dataclasses
import time
import weakref

import torch

from dynatree_core.core.settings import env_on
from dynatree_core.core.transfer import to_device, upload_into
from dynatree_core.forward import capture as step_graphs  # STAND_IN_DEVICES looked up at call time (tests)
from dynatree_core.forward.reference import Forward, additive
from dynatree_core.forward.rows import Rows
from dynatree_core.forward.slots import write_slots
from dynatree_core.forward.static_rows import StaticRows

MAX_BUCKET = 128
MIN_SPAN = 256  # the fewest key slots a padded forward reads (smaller spans would mean more graphs)
MEASURE_UP_TO = 32  # widths below this are timed against the wider buckets up to it (CUDA)
MEASURE_REPLAYS = 5
MEASURE_DEVICES = ("cuda",)  # where widths are measured (tests add "cpu", with stand-in graphs)
# rope types whose update has no data-dependent branch (longrope switches factors on the longest
# position, dynamic rescales per call): only these are captured
CAPTURE_SAFE_ROPE = ("default", "linear", "llama3", "yarn")


def capture_safe(model: torch.nn.Module) -> bool:
    """True when the model's forward can be captured as a CUDA graph (a static rotary update)."""
    config = model.config.get_text_config(decoder=True)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(rope.get("rope_type", rope.get("type", "default"))) in CAPTURE_SAFE_ROPE


def capture_wanted(device: torch.device, model: torch.nn.Module) -> bool:
    """Capture graphs (rather than run the padded forward eagerly): CUDA and a capture-safe model."""
    return device.type == "cuda" and capture_safe(model)


_CHOSEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lean forward -> {dtype: {bucket: width}}


def graphs_enabled(device: torch.device, graphs: bool | None = None) -> bool:
    """Captured forwards: an explicit choice wins; else on for CUDA unless DYNATREE_GRAPHS=0.
    On a CPU `True` runs the padded forward eagerly (the tests' reference for the GPU path)."""
    if graphs is not None:
        return graphs
    return device.type == "cuda" and env_on("DYNATREE_GRAPHS")


def buckets(max_width: int = MAX_BUCKET) -> list[int]:
    out, b = [], 1
    while b < max_width:
        out.append(b)
        b *= 2
    return [*out, max_width]


def bucket_for(q: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds q rows (None: wider than every bucket)."""
    return next((b for b in sizes if b >= q), None)


def span_for(needed: int, capacity: int) -> int:
    """The key slots a padded forward reads: the next power of two >= needed (at least MIN_SPAN),
    capped at the buffer's capacity."""
    span = MIN_SPAN
    while span < needed:
        span *= 2
    return min(span, capacity)


class _SlotWriter:
    """A cache layer as the lean forward sees it: `update` writes the rows' keys/values at the
    slots in `slots` and returns the first `span` slots of the buffers (fixed views, so a graph can
    replay them; the mask hides the slots not in use)."""

    def __init__(self, layer, slots: torch.Tensor, span: int):
        self.layer, self.slots, self.span = layer, slots, span

    def update(self, keys: torch.Tensor, values: torch.Tensor):
        write_slots(self.layer, self.slots, keys, values)
        return self.layer.key_buf[:, :, : self.span], self.layer.value_buf[:, :, : self.span]


class PaddedForward:
    """Fixed-shape forwards of one model over its KVState's SlotLayers (module docstring).

    Called with a forward's Rows and the cache length; returns a Forward (logits of the last
    `rows.keep` rows, hidden states of all q rows) and advances the layers' lengths."""

    def __init__(
        self, lean, layers: list, model: torch.nn.Module, *, capture: bool, max_width: int | None = None, static=None
    ):
        self.lean, self.layers = lean, layers
        # width-invariant forwards (static_rows.StaticRows): StaticRows(span, linear_rows) as a template
        self.static: StaticRows | None = static
        self.sizes = buckets(max_width or MAX_BUCKET)
        self.hidden_size = model.config.get_text_config(decoder=True).hidden_size
        block = lean.blocks[0]
        self.kv_heads, self.head_dim = block.qk_heads - block.heads, block.head_dim
        self.device = model.get_input_embeddings().weight.device
        # the forwards as captured steps, one per (width, span, input vectors) over fixed input buffers
        # (forward/capture.py's mechanism, on the device's shared pool); a stand-in device's too
        self.cuda = capture  # real graphs (the path says "graphs"), not stand-ins
        what, stand_in = "CUDA graph capture failed", self.device.type in step_graphs.STAND_IN_DEVICES
        self.graphs = step_graphs.StepGraphs(self.device, capture=capture or stand_in, kind="forward", what=what)
        self.measured_s = 0.0  # seconds spent timing widths (`_measure`), counted with the captures
        # bucket -> the width it runs at, measured on CUDA once per model and dtype (every run shares it)
        self.chosen: dict[int, int] = _CHOSEN.setdefault(lean, {}).setdefault(str(model.dtype), {})
        self.timings: dict[int, dict[int, float]] = {}  # bucket -> {width: replay ms} measured
        self._epoch: tuple | None = None  # the buffers the graphs were captured over

    @property
    def capture(self) -> bool:  # replaying graphs (else the same steps run eagerly)
        return self.graphs.capture

    @property
    def capture_s(self) -> float:  # seconds spent capturing and timing widths, kept out of forward timings
        return self.graphs.capture_s + self.measured_s

    @property
    def path(self) -> str:
        """How this model's forwards run now (choice.ForwardChoice.path's names, plus a fallback's reason)."""
        base = "lean+invariant+" if self.static is not None else "lean+"
        if self.capture and self.cuda:
            return base + "graphs"
        if self.graphs.fallback:  # why capture was given up; the run goes on eagerly
            return f"{base}padded (graph capture failed: {self.graphs.fallback})"
        return base + "padded"

    def _buffers_epoch(self) -> tuple:
        """Changes whenever a layer's buffers were reallocated (by this class or by an unpadded
        forward's SlotLayer.update): every bucket and graph over the old buffers is then stale."""
        return tuple((layer.capacity, layer.grows, id(layer.key_buf)) for layer in self.layers)

    def _drop_buckets(self) -> None:  # releases their graphs; the pool forgets one with none left
        self.graphs.forget(lambda key: True)

    def static_for(self, needed: int) -> StaticRows:
        """The width-invariant template, its span grown (every bucket dropped) to hold `needed` keys
        should a row see more keys than the span the run started with (its capacity: never in a
        decode run, whose rows see at most prompt + new tokens, however many slots a tree fills)."""
        if needed > self.static.positions_end:
            self.static = dataclasses.replace(self.static, positions_end=2 * needed)
            self._drop_buckets()
        return self.static

    def fits(self, q: int) -> bool:  # a bucket holds q rows
        return bucket_for(q, self.sizes) is not None

    def _ensure_buffers(self, length: int, width: int, dtype, device) -> None:
        """Initialise the layers' buffers, and grow them (dropping every graph) so that `width`
        rows fit after `length` slots."""
        for layer in self.layers:
            if not layer.is_initialized:
                example = torch.empty(1, self.kv_heads, 1, self.head_dim, dtype=dtype, device=device)
                layer.lazy_initialization(example, example)
        capacity = self.layers[0].capacity
        if length + width > capacity:
            for layer in self.layers:
                layer.grow(length + width)
        epoch = self._buffers_epoch()
        if epoch != self._epoch:
            self._drop_buckets()
            self._epoch = epoch

    def __call__(self, rows: Rows, length: int, *, dtype: torch.dtype, device: torch.device) -> Forward:
        """The rows (forward/rows.py; `seen` (q, length + q) bool, host or device) at the width that
        holds them, as the captured step of that width and span (`filled` over fixed input buffers:
        `_inputs`). Returns the logits of the last `rows.keep` rows and, where `rows.hidden` asks,
        the final states of all q rows (a feature draft reads them). `rows.most_keys`: a bound on
        the keys a row sees, not read from a device `seen`."""
        q, visible, most_keys = len(rows.ids), rows.seen, rows.most_keys
        if self.static is not None and most_keys is None:  # the span holds the most keys a row sees
            most_keys = int(visible.sum(1).max())
        width, span, epoch = self.plan(q, length, dtype, device, rows.embeds is not None, most_keys or 0)
        inputs = self._inputs(width, span, dtype, rows.embeds is not None)
        both, seen, at = inputs[:3]
        # fill the inputs in place; a padded row keeps the ids, positions and input vectors an
        # earlier forward left (the buffers start as zeros and only ever hold real, finite inputs):
        # it sees its own slot alone and nothing sees it, so what it holds never reaches a real row
        if isinstance(rows.ids, torch.Tensor):  # already on the device (a level drafted there, the verify rows)
            both[0, :q].copy_(rows.ids)
            both[1, :q].copy_(rows.positions)
        else:  # one upload, into the buffer
            pad = [0] * (width - q)
            upload_into(both, torch.tensor([[*rows.ids, *pad], [*rows.positions, *pad]]))
        at.fill_(length)
        seen.fill_(False)  # rows see what `visible` says, each padded row only its own slot
        seen[:q, : length + q] = to_device(visible, device)
        seen[q:, length + q : length + width].diagonal().fill_(True)
        if rows.embeds is not None:
            inputs[3][:q] = rows.embeds.to(device=device, dtype=dtype)
        step = self.filled(self._given(width), width, span, width, width, dtype)
        logits, states = self.graphs(("forward", width, span, rows.embeds is not None, epoch), step, *inputs)
        self.advance(length + q)
        # copies (the next replay overwrites the step's outputs); the states only where wanted
        return Forward(logits[q - rows.keep : q].clone(), states[:q].clone() if rows.hidden else None)

    def _inputs(self, width: int, span: int, dtype, embeds: bool) -> tuple[torch.Tensor, ...]:
        """The fixed input buffers of a (width, span) forward (capture.StepGraphs.buffer: read in
        place by its graph): ids and positions (2, width), the visibility (width, span), the cache's
        length, and with `embeds` the input vectors (width, hidden)."""
        device, make = self.device, self.graphs.buffer
        both = make(("ids", width), lambda: torch.zeros(2, width, dtype=torch.long, device=device))
        seen = make(("seen", width, span), lambda: torch.zeros(width, span, dtype=torch.bool, device=device))
        at = make(("length",), lambda: torch.zeros((), dtype=torch.long, device=device))
        if not embeds:
            return both, seen, at
        shape = (width, self.hidden_size)
        return both, seen, at, make(("embeds", width, dtype), lambda: torch.zeros(shape, dtype=dtype, device=device))

    def _given(self, width: int):
        """`filled`'s fill for rows given in the input buffers (`_inputs`): their slots follow the cache's length."""
        rows = self.graphs.constant(("rows", width), lambda: torch.arange(width, device=self.device))

        def fill(both, seen, length, *embeds):
            return (Rows(both[0], both[1], seen, embeds=embeds[0] if embeds else None, slots=length + rows),)

        return fill

    def plan(self, q: int, length: int, dtype, device, embeds: bool, most_keys: int = 0) -> tuple[int, int, tuple]:
        """For a forward whose inputs a captured step makes (`filled`; q fits a bucket): the width
        q rows run at, the span of slots its rows' visibility covers, and what else its graph
        captured (the buffers, whose graphs are stale once they move; width-invariant rows: their
        span, grown should a row see more than `most_keys` keys), the buffers made ready."""
        width = self.width_for(q, length, dtype, device, embeds)
        self._ensure_buffers(length, width, dtype, device)
        return width, *self._span(length + width, most_keys)

    def _span(self, needed: int, most_keys: int) -> tuple[int, tuple]:
        """`plan`'s span and epoch for `needed` slots (the buffers ready)."""
        capacity = self.layers[0].capacity
        if self.static is None:
            return span_for(needed, capacity), self._epoch
        return capacity, (self._epoch, self.static_for(most_keys).positions_end)  # rows name any slot

    def filled(self, fill, width: int, span: int, q: int, keep: int, dtype):
        """A pure step (forward/capture.py) that runs `fill` and then the lean forward on what it
        made, the forward's inputs never passing through the buckets: fill(*inputs) -> (Rows
        (forward/rows.py) of `width` rows: ids and positions (width,), `slots` (width,), `seen`
        (width, span) bool (row i may attend to slot j; a padding row to its own), embeds
        (width, hidden) or None; *extra), the first q rows real. `seen` becomes the additive mask,
        or for width-invariant forwards each row's slots in sequence order (static_rows.StaticRows),
        in the step. The step returns
        the float32 logits of the last `keep` real rows and the real rows' final states, then
        `extra`. Call `advance` after it."""
        static = self.static

        def step(*inputs):
            rows, *extra = fill(*inputs)
            if static is None:
                mask, groups = additive(rows.seen, dtype)[None, None], None
            else:
                built = StaticRows.build(rows.seen, static.positions_end, check=False)
                mask, groups = None, dataclasses.replace(static, slots=built[0], tail=built[1])
            writers = [_SlotWriter(layer, rows.slots, span) for layer in self.layers]
            embeds = None if rows.embeds is None else rows.embeds[None]
            out = self.lean(
                rows.ids[None], rows.positions[None], mask, writers, width, embeds=embeds, hidden=True, rows=groups
            )
            return (out.logits[q - keep : q].float(), out.states[:q], *extra)

        return step

    def advance(self, length: int) -> None:  # the valid length after a step (padded rows wrote past it)
        for layer in self.layers:
            layer.set_length(length)

    def width_for(self, q: int, length: int, dtype, device, embeds: bool) -> int:
        """The padded width q rows run at: their bucket, or on CUDA a wider one measured faster
        (module docstring). Measured once per bucket, model and dtype, at the first forward that
        needs it; later runs of the model reuse the choice."""
        bucket = bucket_for(q, self.sizes)
        if not self.capture or bucket >= MEASURE_UP_TO or self.device.type not in MEASURE_DEVICES:
            return bucket
        if bucket not in self.chosen:
            self.chosen[bucket] = self._measure(bucket, length, dtype, device, embeds)
        return self.chosen[bucket]

    def _measure(self, bucket: int, length: int, dtype, device, embeds: bool) -> int:
        """Replay each candidate width (the bucket and the wider ones up to MEASURE_UP_TO) over the
        slots after `length`, which the forward about to run overwrites; keep the fastest. Capture
        and timing count as capture seconds."""
        t0, captured = time.perf_counter(), self.graphs.capture_s
        candidates = [b for b in self.sizes if bucket <= b <= MEASURE_UP_TO]
        self._ensure_buffers(length, max(candidates), dtype, device)
        timings = {}
        for width in candidates:
            span, epoch = self._span(length + width, 0)
            inputs = self._inputs(width, span, dtype, embeds)
            inputs[1].fill_(True)  # any visibility (and the inputs as they are): only the time is wanted
            inputs[2].fill_(length)
            step = self.filled(self._given(width), width, span, width, width, dtype)
            self.graphs(("forward", width, span, embeds, epoch), step, *inputs)  # captures it
            if not self.capture:  # the capture failed: no measurement, the bucket as it is
                break
            timings[width] = self._replay_ms(width)
        if self.capture:
            self.timings[bucket] = timings
        self.measured_s += time.perf_counter() - t0 - (self.graphs.capture_s - captured)
        return min(timings, key=lambda w: (timings[w], w)) if self.capture else bucket

    def _replay_ms(self, width: int) -> float:
        """The mean time of a replay of the step called last (`width` rows: what tests stand in)."""
        graph = self.graphs.last.graph
        if self.device.type != "cuda":  # stand-in graphs (tests): the host clock
            t0 = time.perf_counter()
            for _ in range(MEASURE_REPLAYS):
                graph.replay()
            return (time.perf_counter() - t0) * 1e3 / MEASURE_REPLAYS
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(MEASURE_REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / MEASURE_REPLAYS
