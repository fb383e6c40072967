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

Every input (ids, positions, slots, mask, draft input vectors) is a static buffer per bucket,
filled in place before each call. On CUDA each bucket's step is captured in a
`torch.cuda.CUDAGraph` on first use and replayed after; elsewhere the same step runs eagerly,
which is what the CPU tests compare against the unpadded forward. Wider forwards than the
largest bucket (a long prompt's prefill) take the unpadded lean path. A cache that grows, by
either path, reallocates its buffers: the buckets and graphs built over the old ones are dropped
before the next call (checked on every call, not only when this class grows them itself).
A forward whose inputs the device makes (a draft level's mask, slots and positions from the
committed length) can skip the buckets: `filled` wraps the input-making and the forward in one
pure step that forward/capture.py captures whole (KVState.level).

Safety: a capture that fails (out of memory, an op that cannot be captured, a library version)
warns once, and the model goes on with the same padded forward run eagerly (`fallback` says why);
graphs of every run on one device share one memory pool (replays never overlap: one stream), and
a pool whose graphs are all gone is never reused for a new capture (torch asserts); capture
streams are made on the model's device (cuda:N); models whose rotary update has a data-dependent
branch (`capture_safe`) are never captured; capture seconds are counted apart (`capture_s`), so
forward timings and cost models see replays only.
"""

from __future__ import annotations

import dataclasses
import time
import weakref

import torch

from dynatree_core.core.settings import env_on
from dynatree_core.core.transfer import to_device, upload_into
from dynatree_core.forward.capture import POOLS, capture_failed, capture_graph
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


class _Bucket:
    """The static inputs and outputs of one width, and its captured graph (CUDA)."""

    def __init__(self, width: int, span: int, hidden_size: int, dtype, device, embeds: bool):
        self.width, self.span = width, span
        self.both = torch.zeros(2, width, dtype=torch.long, device=device)  # ids, positions: filled by one copy
        self.ids, self.positions = self.both[0:1], self.both[1:2]
        self.slots = torch.zeros(width, dtype=torch.long, device=device)
        self.rows = torch.arange(width, device=device)  # slots = rows + cache length
        self.mask = torch.zeros(1, 1, width, span, dtype=dtype, device=device)
        self.static: StaticRows | None = None  # width-invariant forwards: the rows' slots and tail
        self.embeds = torch.zeros(1, width, hidden_size, dtype=dtype, device=device) if embeds else None
        self.logits: torch.Tensor | None = None
        self.states: torch.Tensor | None = None
        self.graph = None


class PaddedForward:
    """Fixed-shape forwards of one model over its KVState's SlotLayers (module docstring).

    Called with a forward's Rows and the cache length; returns a Forward (logits of the last
    `rows.keep` rows, hidden states of all q rows) and advances the layers' lengths."""

    def __init__(
        self, lean, layers: list, model: torch.nn.Module, *, capture: bool, max_width: int | None = None, static=None
    ):
        self.lean, self.layers, self.capture = lean, layers, capture
        # width-invariant forwards (static_rows.StaticRows): StaticRows(span, linear_rows) as a template
        self.static: StaticRows | None = static
        self.sizes = buckets(max_width or MAX_BUCKET)
        self.hidden_size = model.config.get_text_config(decoder=True).hidden_size
        block = lean.blocks[0]
        self.kv_heads, self.head_dim = block.qk_heads - block.heads, block.head_dim
        self.buckets: dict[tuple[int, int, bool], _Bucket] = {}  # (width, span, embeds)
        self.captures = 0  # graphs captured so far (a cache that grows forces recaptures)
        self.capture_s = 0.0  # seconds spent capturing (warm-up included), kept out of forward timings
        self.fallback: str | None = None  # why capture was given up; the run goes on eagerly
        self.device = model.get_input_embeddings().weight.device
        # bucket -> the width it runs at, measured on CUDA once per model and dtype (every run shares it)
        self.chosen: dict[int, int] = _CHOSEN.setdefault(lean, {}).setdefault(str(model.dtype), {})
        self.timings: dict[int, dict[int, float]] = {}  # bucket -> {width: replay ms} measured
        self._epoch: tuple | None = None  # the buffers the buckets were built over

    @property
    def path(self) -> str:
        """How this model's forwards run now (choice.ForwardChoice.path's names, plus a fallback's reason)."""
        base = "lean+invariant+" if self.static is not None else "lean+"
        if self.capture:
            return base + "graphs"
        if self.fallback:
            return f"{base}padded (graph capture failed: {self.fallback})"
        return base + "padded"

    def _buffers_epoch(self) -> tuple:
        """Changes whenever a layer's buffers were reallocated (by this class or by an unpadded
        forward's SlotLayer.update): every bucket and graph over the old buffers is then stale."""
        return tuple((layer.capacity, layer.grows, id(layer.key_buf)) for layer in self.layers)

    def _drop_buckets(self) -> None:  # releases their graphs; the pool forgets one with none left
        self.buckets.clear()

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
        """The rows (forward/rows.py; `seen` (q, length + q) bool, host or device) at the bucket
        that holds them. Returns the logits of the last `rows.keep` rows and, where `rows.hidden`
        asks, the final states of all q rows (a feature draft reads them). `rows.most_keys`: a
        bound on the keys a row sees, not read from a device `seen`."""
        ids, positions, visible, embeds, most_keys = rows.ids, rows.positions, rows.seen, rows.embeds, rows.most_keys
        q = len(ids)
        width = self.width_for(q, length, dtype, device, embeds is not None)
        self._ensure_buffers(length, width, dtype, device)
        if self.static is not None:  # the span holds the most keys a row sees (not the slots in use)
            self.static_for(most_keys if most_keys is not None else int(visible.sum(1).max()))
        span = self.layers[0].capacity if self.static else span_for(length + width, self.layers[0].capacity)
        buf = self._bucket(width, span, dtype, device, embeds is not None)
        # fill the static inputs in place; a padded row keeps the ids, positions and input vectors an
        # earlier forward left (the buffers start as zeros and only ever hold real, finite inputs):
        # it sees its own slot alone and nothing sees it, so what it holds never reaches a real row
        if isinstance(ids, torch.Tensor):  # already on the device (a level drafted there, the verify rows)
            buf.both[0, :q].copy_(ids)
            buf.both[1, :q].copy_(positions)
        else:  # one upload, into the buffer
            upload_into(buf.both, torch.tensor([[*ids, *[0] * (width - q)], [*positions, *[0] * (width - q)]]))
        torch.add(buf.rows, length, out=buf.slots)
        # the mask in place (no tensor allocated per forward): rows see what `visible` says, each
        # padded row only its own slot, every slot past the valid ones nothing
        if self.static is not None:  # each row's slots in sequence order (padded rows: their own)
            full = torch.zeros(width, length + width, dtype=torch.bool, device=visible.device)
            full[:q, : length + q] = visible
            full[q:, length + q :] = torch.eye(width - q, dtype=torch.bool, device=visible.device)
            slots, tail = StaticRows.build(full, self.static.positions_end, check=most_keys is None)
            upload_into(buf.static.slots, slots)
            upload_into(buf.static.tail, tail)
        else:
            mask = buf.mask[0, 0]
            mask.fill_(torch.finfo(dtype).min)
            mask[:q, : length + q].masked_fill_(to_device(visible, device), 0.0)
            mask[q:, length + q : length + width].diagonal().fill_(0.0)
        if buf.embeds is not None:
            buf.embeds[0, :q] = embeds.to(device=device, dtype=dtype)
        self._run(buf)
        self.advance(length + q)
        # copies (the next replay overwrites the bucket's outputs); the states only where wanted
        return Forward(buf.logits[q - rows.keep : q].clone(), buf.states[:q].clone() if rows.hidden else None)

    def plan(self, q: int, length: int, dtype, device, embeds: bool, most_keys: int = 0) -> tuple[int, int, tuple]:
        """For a forward whose inputs a captured step makes (`filled`; q fits a bucket): the width
        q rows run at, the span of slots its rows' visibility covers, and what else its graph
        captured (the buffers, whose graphs are stale once they move; width-invariant rows: their
        span, grown should a row see more than `most_keys` keys), the buffers made ready."""
        width = self.width_for(q, length, dtype, device, embeds)
        self._ensure_buffers(length, width, dtype, device)
        capacity = self.layers[0].capacity
        if self.static is None:
            return width, span_for(length + width, capacity), self._epoch
        return width, capacity, (self._epoch, self.static_for(most_keys).positions_end)  # rows name any slot

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

    def _bucket(self, width: int, span: int, dtype, device, embeds: bool) -> _Bucket:
        """The static buffers of (width, span), made on first use (their graph on first run)."""
        key = (width, span, embeds)
        buf = self.buckets.get(key)
        if buf is None:
            buf = self.buckets[key] = _Bucket(width, span, self.hidden_size, dtype, device, embeds)
            if self.static is not None:
                eye = torch.eye(width, dtype=torch.bool, device=device)
                slots, tail = StaticRows.build(eye, self.static.positions_end)
                buf.static = dataclasses.replace(self.static, slots=slots, tail=tail)
        return buf

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
        t0, captured = time.perf_counter(), self.capture_s
        candidates = [b for b in self.sizes if bucket <= b <= MEASURE_UP_TO]
        self._ensure_buffers(length, max(candidates), dtype, device)
        timings = {}
        for width in candidates:
            span = self.layers[0].capacity if self.static else span_for(length + width, self.layers[0].capacity)
            buf = self._bucket(width, span, dtype, device, embeds)
            buf.mask.fill_(0.0)  # any finite mask (and the static rows as made): only the time is wanted
            torch.add(buf.rows, length, out=buf.slots)
            self._run(buf)  # captures it
            if not self.capture:  # the capture failed: no measurement, the bucket as it is
                self.capture_s = captured + time.perf_counter() - t0
                return bucket
            timings[width] = self._replay_ms(buf)
        self.timings[bucket] = timings
        self.capture_s = captured + time.perf_counter() - t0  # the captures' seconds are inside it
        return min(timings, key=lambda w: (timings[w], w))

    def _replay_ms(self, buf: _Bucket) -> float:
        if self.device.type != "cuda":  # stand-in graphs (tests): the host clock
            t0 = time.perf_counter()
            for _ in range(MEASURE_REPLAYS):
                buf.graph.replay()
            return (time.perf_counter() - t0) * 1e3 / MEASURE_REPLAYS
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(MEASURE_REPLAYS):
            buf.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / MEASURE_REPLAYS

    def _step(self, buf: _Bucket) -> None:
        writers = [_SlotWriter(layer, buf.slots, buf.span) for layer in self.layers]
        rows = buf.static  # width-invariant: attention over each row's own slots (mask unused)
        out = self.lean(buf.ids, buf.positions, buf.mask, writers, buf.width, embeds=buf.embeds, hidden=True, rows=rows)
        buf.logits, buf.states = out.logits, out.states

    def _run(self, buf: _Bucket) -> None:
        if self.capture and buf.graph is None:
            t0 = time.perf_counter()
            try:
                buf.graph = self._capture(buf)  # assigned only once capture succeeded
                self.captures += 1
            except Exception as exc:  # any capture failure: warn once, continue eagerly
                self._give_up(exc)
            finally:
                self.capture_s += time.perf_counter() - t0
        if buf.graph is not None:
            buf.graph.replay()
        else:
            self._step(buf)

    def _capture(self, buf: _Bucket):
        """One step captured (capture.capture_graph), the graph drawing on the device's shared pool."""
        return capture_graph(self.device, lambda: self._step(buf), lambda graph: POOLS.acquire(self.device, graph))[0]

    def _give_up(self, exc: Exception) -> None:
        self.capture, self.fallback = False, capture_failed(exc, "CUDA graph capture failed")
        self._drop_buckets()
