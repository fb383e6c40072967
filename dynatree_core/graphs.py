"""Captured forwards (issue 16): the lean forward at fixed shapes, replayed as one CUDA graph.

On a GPU a 135M-parameter model is launch-bound: HF's eager forward issues hundreds of small
kernels per token and a 1-token step costs 22-41 ms where the arithmetic takes ~3 (BENCHMARKS.md).
Engines that do this well capture the forward once per width and replay it (gpt-fast; SGLang's
CUDA-graph runner captures the EAGLE verify forward at a fixed number of draft tokens). A graph
replays fixed shapes over fixed addresses, so `PaddedForward` runs the lean forward (fastpath.py)
at fixed shapes over the static cache (kv.SlotLayer):

- width buckets: q new rows are padded to the next bucket (1, 2, 4, ... MAX_BUCKET); a padded
  row reads token 0 at position 0, sees only its own slot, and writes its keys/values into the
  free slots after the valid ones (never read: the next forward overwrites them);
- attention over the whole buffer: the additive mask is (bucket, capacity), every slot past
  the valid ones masked out, so the key length never changes;
- new keys/values go to the slots named in a slot buffer (`index_copy_`), not to a Python slice.

Every input (ids, positions, slots, mask, draft input vectors) is a static buffer per bucket,
filled in place before each call. On CUDA each bucket's step is captured in a
`torch.cuda.CUDAGraph` on first use and replayed after; elsewhere the same step runs eagerly,
which is what the CPU tests compare against the unpadded forward. Wider forwards than the
largest bucket (a long prompt's prefill) take the unpadded lean path. A cache that has to grow
reallocates its buffers, so every captured graph is dropped and recaptured.
"""

from __future__ import annotations

import os

import torch

MAX_BUCKET = 128


def graphs_enabled(device: torch.device, graphs: bool | None = None) -> bool:
    """Captured forwards: an explicit choice wins; else on for CUDA unless DYNATREE_GRAPHS=0.
    On a CPU `True` runs the padded forward eagerly (the tests' reference for the GPU path)."""
    if graphs is not None:
        return graphs
    return device.type == "cuda" and os.environ.get("DYNATREE_GRAPHS", "1") != "0"


def buckets(max_width: int = MAX_BUCKET) -> list[int]:
    out, b = [], 1
    while b < max_width:
        out.append(b)
        b *= 2
    return [*out, max_width]


def bucket_for(q: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds q rows (None: wider than every bucket)."""
    return next((b for b in sizes if b >= q), None)


class _SlotWriter:
    """A cache layer as the lean forward sees it: `update` writes the rows' keys/values at the
    slots in `slots` and returns the whole buffers (the mask hides the slots not in use)."""

    def __init__(self, layer, slots: torch.Tensor):
        self.layer, self.slots = layer, slots

    def update(self, keys: torch.Tensor, values: torch.Tensor):
        self.layer.key_buf.index_copy_(2, self.slots, keys)
        self.layer.value_buf.index_copy_(2, self.slots, values)
        return self.layer.key_buf, self.layer.value_buf


class _Bucket:
    """The static inputs and outputs of one width, and its captured graph (CUDA)."""

    def __init__(self, width: int, capacity: int, hidden_size: int, dtype, device, embeds: bool):
        self.width = width
        self.ids = torch.zeros(1, width, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, width, dtype=torch.long, device=device)
        self.slots = torch.zeros(width, dtype=torch.long, device=device)
        self.rows = torch.arange(width, device=device)  # slots = rows + cache length
        self.mask = torch.zeros(1, 1, width, capacity, dtype=dtype, device=device)
        self.embeds = torch.zeros(1, width, hidden_size, dtype=dtype, device=device) if embeds else None
        self.logits: torch.Tensor | None = None
        self.states: torch.Tensor | None = None
        self.graph = None


class PaddedForward:
    """Fixed-shape forwards of one model over its KVState's SlotLayers (module docstring).

    Called like the lean forward plus the cache length; returns (logits of the last
    `logits_to_keep` rows, hidden states of all q rows) and advances the layers' lengths."""

    def __init__(self, lean, layers: list, model: torch.nn.Module, *, capture: bool, max_width: int | None = None):
        self.lean, self.layers, self.capture = lean, layers, capture
        self.sizes = buckets(max_width or MAX_BUCKET)
        config = model.config.get_text_config(decoder=True)
        self.hidden_size = config.hidden_size
        block = lean.blocks[0]
        self.kv_heads = block.qk_heads - block.heads
        self.head_dim = block.head_dim
        self.buckets: dict[tuple[int, bool], _Bucket] = {}
        self.captures = 0  # graphs captured so far (a cache that grows forces recaptures)
        self.pool = None

    def fits(self, q: int) -> bool:
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
            self.buckets.clear()

    def __call__(
        self,
        ids: list[int],
        positions: list[int],
        visible: torch.Tensor,
        length: int,
        logits_to_keep: int,
        *,
        embeds: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = len(ids)
        width = bucket_for(q, self.sizes)
        self._ensure_buffers(length, width, dtype, device)
        capacity = self.layers[0].capacity
        key = (width, embeds is not None)
        buf = self.buckets.get(key)
        if buf is None:
            buf = self.buckets[key] = _Bucket(width, capacity, self.hidden_size, dtype, device, embeds is not None)
        # fill the static inputs in place (padded rows: token 0, position 0, their own slot only)
        buf.ids.zero_()
        buf.ids[0, :q] = torch.as_tensor(ids, device=device)
        buf.positions.zero_()
        buf.positions[0, :q] = torch.as_tensor(positions, device=device)
        torch.add(buf.rows, length, out=buf.slots)
        # the mask in place (no tensor allocated per forward): rows see what `visible` says, each
        # padded row only its own slot, every slot past the valid ones nothing
        mask = buf.mask[0, 0]
        mask.fill_(torch.finfo(dtype).min)
        mask[:q, : length + q].masked_fill_(visible.to(device, non_blocking=True), 0.0)
        mask[q:, length + q : length + width].diagonal().fill_(0.0)
        if buf.embeds is not None:
            buf.embeds.zero_()
            buf.embeds[0, :q] = embeds.to(device=device, dtype=dtype)
        self._run(buf)
        for layer in self.layers:
            layer.set_length(length + q)
        return buf.logits[q - logits_to_keep : q].clone(), buf.states[:q].clone()  # the graph reuses its outputs

    def _step(self, buf: _Bucket) -> None:
        writers = [_SlotWriter(layer, buf.slots) for layer in self.layers]
        logits, states = self.lean(buf.ids, buf.positions, buf.mask, writers, buf.width, embeds=buf.embeds, hidden=True)
        buf.logits, buf.states = logits, states

    def _run(self, buf: _Bucket) -> None:
        if not self.capture:
            self._step(buf)
            return
        if buf.graph is None:  # warm up on a side stream, then capture (torch.cuda.graphs docs)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # library handles and workspaces get created outside the capture
                    self._step(buf)
            torch.cuda.current_stream().wait_stream(stream)
            if self.pool is None:  # one memory pool for every bucket: they never run at once
                self.pool = torch.cuda.graph_pool_handle()
            buf.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(buf.graph, pool=self.pool):
                self._step(buf)
            self.captures += 1
        buf.graph.replay()
