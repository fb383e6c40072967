"""Per-run KV state and tree-masked forwards over stock transformers models.

`KVState` owns one model's cache for one run, plus the committed tokens that are not in the
cache yet (`pending`). The invariant the engine keeps: cache + pending == committed tokens.

`KVState.run(rows)` is the one forward entry: ONE forward over a batch of new rows (rows.Rows:
ids, explicit positions, which slots each row sees as a boolean matrix) that returns a
`reference.Forward`. Which implementation runs it (reference, lean, padded and captured,
width-invariant) is `choice.choose_forward`'s decision, made once when the state is built. The
masked ones get an additive float 4D mask (transformers 5.x uses a ready 4D mask unchanged;
checked against sequential decoding, tests/test_kv.py): a boolean mask is right under sdpa but
silently wrong under eager, so we always pass the additive form.

`KVState.keep` compacts the cache on the sequence axis: accepted tree tokens keep the KV the
verification forward computed, nothing is recomputed.

Static cache (the default): each layer's keys and values live in one buffer allocated
for the whole run (`SlotLayer`, capacity = prompt + new tokens + a tree's worth of slack). A
forward writes its new entries at slots `length .. length + q` and attention reads a view of the
first `length + q` slots; compaction moves the accepted entries inside the buffer and resets the
length. Nothing is concatenated or reallocated per forward (a tree larger than the slack grows
the buffer once, counted in `KVState.grows`). `static=False` keeps transformers' `DynamicCache`
(concatenation per forward) as the reference path.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, DynamicCache

from dynatree_core.core.transfer import Stopwatch, to_device
from dynatree_core.errors import DynaTreeError
from dynatree_core.forward.capture import StepGraphs, capture_wanted
from dynatree_core.forward.choice import choose_forward
from dynatree_core.forward.filled import FilledForwards
from dynatree_core.forward.graphs import PaddedForward
from dynatree_core.forward.invariant import RowGroups
from dynatree_core.forward.reference import Forward, additive, reference_forward
from dynatree_core.forward.rows import Rows
from dynatree_core.forward.slots import SLACK, SlotLayer, SlotStore
from dynatree_core.forward.static_rows import StaticRows, static_span


class KVState(FilledForwards):
    """One model's cache for one run. Never shared between runs or sessions.

    Args:
        model: a stock transformers causal LM.
        prompt_ids: the committed tokens to start from (pending until the first forward).
        capacity: expected final length (prompt + new tokens) for the static cache; grown if exceeded.
        static, fast, graphs, invariant: the switches choice.choose_forward decides the forward
            from (static cache, lean forward, captured forwards, width-invariant forwards); the
            decision is `choice`, its name `path`. `steps`: the work between forwards captured
            as steps where the forwards are (capture.capture_wanted). None: auto (core/settings.py).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        prompt_ids: list[int],
        *,
        capacity: int | None = None,
        static: bool | None = None,
        fast: bool | None = None,
        graphs: bool | None = None,
        steps: bool | None = None,
        invariant: bool = False,
    ):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.choice = choose_forward(model, static=static, fast=fast, graphs=graphs, invariant=invariant)
        self.static = self.choice.static
        if self.static:
            n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
            slots = (capacity or len(prompt_ids)) + SLACK
            store = SlotStore(n_layers)  # every layer's buffers in one tensor: compaction is one copy
            self.cache = Cache(layers=[SlotLayer(slots, store=store, index=i) for i in range(n_layers)])
        else:
            self.cache = DynamicCache(config=model.config)
        self.lean = self.choice.lean  # the lean forward (or a draft's own) under lean/captured/invariant
        self.invariant = self.choice.kind == "invariant"
        self.verdict = self.choice.verdict  # invariant: whether this device's kernels are, and the linears' padding
        self.padded = None  # fixed-shape forwards, captured as CUDA graphs on a GPU (graphs.py)
        if self.choice.kind == "captured":
            self.padded = PaddedForward(self.lean, self.cache.layers, model, capture=self.choice.capture)
        elif self.choice.padded:  # width-invariant at fixed shapes: every row over the run's span
            span = static_span(capacity or len(prompt_ids))
            template = StaticRows(torch.empty(0), torch.empty(0), span, self.verdict.linear_rows)
            self.padded = PaddedForward(
                self.lean, self.cache.layers, model, capture=self.choice.capture, static=template
            )
        # the tensor work between this model's forwards, captured where its forwards are (capture.py)
        self.steps = StepGraphs(
            self.device, capture=capture_wanted(self.device, self.padded is not None, self.choice.capture, steps)
        )
        # whether forwards may make their inputs on the device, captured with them (filled.py): decided
        # here once, so a run that cannot (every CPU run but the tests' stand-ins) never asks
        self.filled = self.steps.capture and self.padded is not None
        self.length = 0  # tokens whose KV is in the cache
        self.pending: list[int] = list(prompt_ids)  # committed, not yet in the cache
        self.forwards = 0
        # time inside model forwards (what "outside the forwards" is measured against); graph
        # captures are not forwards and are counted in `capture_s` instead
        self.watch = Stopwatch(self.device)
        self.peak_bytes = 0  # the cache's largest size so far (right after a forward, before compaction)
        # the implementation, picked once: the reference, the lean forward, the padded one (captured
        # where graphs are) or the width-invariant one; rows too wide for a bucket run unpadded
        kind = "padded" if self.padded is not None else self.choice.kind
        self._run = {"reference": self._reference, "lean": self._lean, "padded": self._padded}.get(kind, self._grouped)
        self._wide = self._grouped if self.invariant else self._lean

    @property
    def capture_s(self) -> float:
        return self.steps.capture_s + (self.padded.capture_s if self.padded is not None else 0.0)

    @property
    def path(self) -> str:
        """How this run's forwards go now: the choice's path, or the captured forward's own (it
        says when a capture failed and the run went on eagerly), "kernels" where the lean forward
        takes Triton's (forward/kernels.py), and a captured step's failure
        (the forwards then fill their inputs op by op)."""
        path = self.padded.path if self.padded is not None else self.choice.path
        blocks = getattr(self.lean, "blocks", None)  # None: no lean forward, or a draft's own (drafts/fused.py)
        if blocks and blocks[0].kernels:  # forward/kernels.py (Triton's)
            path = path.replace("lean+", "lean+kernels+", 1)
        if self.steps.fallback:
            path += f" (inputs op by op: step capture failed: {self.steps.fallback})"
        return path

    @property
    def grows(self) -> int:
        """How often a static buffer had to grow (0 when the capacity was right)."""
        return max((getattr(layer, "grows", 0) for layer in self.cache.layers), default=0)

    def run(self, rows: Rows) -> Forward:
        """ONE forward over `rows` (forward/rows.py), appended to the cache, by the implementation
        `choice` picked for the run (`_run`, set once). Returns a Forward: the last `rows.keep`
        rows' float32 logits; with `rows.hidden` every row's states (or taps), else None."""
        q = len(rows.ids)
        if rows.seen.shape != (q, self.length + q):
            raise ValueError(f"mask shape {tuple(rows.seen.shape)} != {(q, self.length + q)}")
        return self._run(rows)

    def _reference(self, rows: Rows) -> Forward:
        ids, positions, inputs = self._inputs(rows)
        mask = self._additive(rows.seen)
        self.watch.start()
        out = reference_forward(
            self.model, self.cache, ids, positions, mask, rows.keep, embeds=inputs, hidden=rows.hidden
        )
        return self._done(len(rows.ids), out, rows.hidden)

    def _lean(self, rows: Rows) -> Forward:
        ids, positions, inputs = self._inputs(rows)
        mask = self._additive(rows.seen)
        self.watch.start()
        out = self.lean(ids, positions, mask, self.cache.layers, rows.keep, embeds=inputs, hidden=rows.hidden)
        return self._done(len(rows.ids), out, rows.hidden)

    def _padded(self, rows: Rows) -> Forward:
        """The padded forward (graphs.py) when the rows fit a bucket; else, and for taps (captured
        forwards hand out final states only), the same rows unpadded (`_wide`)."""
        if not self.padded.fits(len(rows.ids)) or (isinstance(rows.hidden, tuple) and rows.hidden):
            return self._wide(rows)
        captured = self.padded.capture_s
        self.watch.start()
        out = self.padded(rows, self.length, dtype=self.model.dtype, device=self.device)
        return self._done(len(rows.ids), out, rows.hidden, (self.padded.capture_s - captured) * 1e3)

    def _grouped(self, rows: Rows) -> Forward:
        """Width-invariant rows, eagerly (invariant.py): no mask, each row over its own keys; at
        fixed shapes (StaticRows, where the choice is padded and the rows do not fit a bucket:
        a long prefill, taps), else grouped by key count (RowGroups)."""
        ids, positions, inputs = self._inputs(rows)
        seen, verdict = rows.seen, self.verdict
        if self.padded is not None:
            needed = rows.most_keys if rows.most_keys is not None else int(seen.sum(1).max())  # most keys a row sees
            static = self.padded.static_for(needed)
            built = StaticRows.build(seen, static.positions_end, check=rows.most_keys is None)
            slots, tail = (t if t.device == self.device else to_device(t, self.device) for t in built)
            groups = dataclasses.replace(static, slots=slots, tail=tail)
        else:
            top = (max(rows.positions) if isinstance(rows.positions, list) else int(rows.positions.max())) + 1
            groups = RowGroups.of(seen, self.device, top, verdict.linear_rows, verdict.attention_rows)
        self.watch.start()
        out = self.lean(
            ids, positions, None, self.cache.layers, rows.keep, embeds=inputs, hidden=rows.hidden, rows=groups
        )
        return self._done(len(rows.ids), out, rows.hidden)

    def _inputs(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """ids (1, q) and positions (1, q) on the device in one upload (none when they are device
        tensors already: a level drafted on the device); embeds as (1, q, hidden)."""
        if isinstance(rows.ids, torch.Tensor):
            ids, positions = rows.ids[None], rows.positions[None]
        else:
            ids, positions = to_device(torch.tensor([rows.ids, rows.positions]), self.device)[:, None]
        embeds = rows.embeds
        inputs = None if embeds is None else embeds.to(device=self.device, dtype=self.model.dtype)[None]
        return ids, positions, inputs

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        return additive(to_device(visible, self.device), self.model.dtype)[None, None]  # (1, 1, q, kv)

    def _done(self, q: int, out: Forward, hidden, capture_ms: float = 0.0) -> Forward:
        """Account for a forward of q rows (its span on the stopwatch, less any capture in it)."""
        logits = out.logits.float()
        self.watch.stop(minus_ms=capture_ms)
        self.length += q
        self.forwards += 1
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        return Forward(logits, out.states if hidden else None)

    def nbytes(self) -> int:
        """Bytes the cache holds: the allocated buffers (static) or the concatenated tensors."""
        if self.static:
            return sum(layer.nbytes() for layer in self.cache.layers)
        return sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values))

    def keep(self, index: list[int]) -> None:
        """Keep only the cache entries at `index` (ascending): compaction, no recompute.

        `index` is a kept prefix followed by a few scattered slots (the accepted path). The
        scattered entries are gathered in place right after the prefix, then the tail is cut
        (static: the length is reset), so the cache is never copied as a whole.
        """
        prefix = 0
        while prefix < len(index) and index[prefix] == prefix:
            prefix += 1
        moves = torch.tensor([index[prefix:], list(range(prefix, len(index)))], dtype=torch.long)
        layers = self.cache.layers
        store = getattr(layers[0], "store", None)
        if store is not None and store.holds(layers):  # every layer in one buffer: one gather, one write
            src, dst = to_device(moves, store.buf.device) if len(index) > prefix else moves
            store.keep(src, dst)
            for layer in layers:
                layer.set_length(len(index))
            self.length = len(index)
            return
        on: dict[torch.device, torch.Tensor] = {}  # one upload per device (one device unless the model is split)
        for layer in layers:
            _check_layer(layer)
            buf = layer.key_buf if isinstance(layer, SlotLayer) else layer.keys
            device = buf.device if buf is not None else self.device
            if len(index) > prefix and device not in on:
                on[device] = to_device(moves, device)
            src, dst = on.get(device, moves)
            if isinstance(layer, SlotLayer):
                layer.keep(src, dst, len(index))
                continue
            if len(src):  # sources lie at or after their destinations; RHS indexing copies first
                layer.keys[..., dst, :] = layer.keys[..., src, :]
                layer.values[..., dst, :] = layer.values[..., src, :]
            layer.keys = layer.keys[..., : len(index), :]
            layer.values = layer.values[..., : len(index), :]
        self.length = len(index)


def _check_layer(layer) -> None:
    if getattr(layer, "is_sliding", False):
        raise DynaTreeError("models with sliding-window attention caches are not supported yet")
