"""Per-run KV state and tree-masked forwards over stock transformers models.

`KVState` owns one model's cache for one run, plus the committed tokens that are not in the
cache yet (`pending`). The invariant the engine keeps: cache + pending == committed tokens.

`KVState.forward` runs ONE forward over new tokens whose visibility is given as a boolean
matrix, with explicit position ids, and returns a `forward.Forward`. Which implementation runs it
(reference, lean, captured, invariant) is `choice.choose_forward`'s decision, made once when the
state is built. The masked ones get an additive float 4D mask (transformers 5.x uses a ready 4D
mask unchanged; checked against sequential decoding, tests/test_kv.py): a boolean mask is right
under sdpa but silently wrong under eager, so we always pass the additive form.

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
        self.watch = Stopwatch(self.device)  # time inside model forwards, graph captures excluded
        self.peak_bytes = 0  # the cache's largest size so far (right after a forward, before compaction)
        self.after: tuple[torch.Tensor, ...] = ()  # what the last chain's step ran after its forward (`then`)

    @property
    def forward_ms(self) -> float:
        """Time inside model forwards (what "outside the forwards" is measured against); graph
        captures are not forwards and are counted in `capture_s` instead."""
        return self.watch.ms

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

    def forward(
        self,
        token_ids: list[int],
        position_ids: list[int],
        visible: torch.Tensor,
        logits_to_keep: int,
        *,
        embeds: torch.Tensor | None = None,
        hidden: bool | tuple[int, ...] = False,
        most_keys: int | None = None,
    ) -> Forward:
        """One forward over `token_ids`, appended to the cache, by the implementation `choice` picked.

        Args:
            token_ids: q new tokens (a list, or a (q,) tensor on the device).
            position_ids: q positions (prefix length + depth for tree nodes), as the tokens.
            visible: (q, length + q) bool, True where query i may attend to key j.
            logits_to_keep: return logits of the last this-many queries.
            embeds: (q, hidden) input vectors to use instead of the tokens' embeddings (a feature
                draft builds its own inputs from a token and a target feature).
            hidden: also return the final hidden states of all q rows: the model's output after
                its final norm, i.e. what its LM head reads (the features a feature draft learns);
                a tuple of taps (core/taps.py) returns (q, len(taps), hidden) states instead.
            most_keys: a bound on the keys any row sees, for a `visible` on a GPU (width-invariant
                forwards at fixed shapes size their span by it; reading it there would wait).
        Returns:
            Forward: (logits_to_keep, vocab) float32 logits; with `hidden` the states, else None.
        """
        q = len(token_ids)
        if visible.shape != (q, self.length + q):
            raise ValueError(f"mask shape {tuple(visible.shape)} != {(q, self.length + q)}")
        run = getattr(self, "_" + self.choice.kind)  # _reference, _lean, _captured or _invariant
        return run(token_ids, position_ids, visible, logits_to_keep, embeds, hidden, most_keys=most_keys)

    def _reference(self, token_ids, position_ids, visible, logits_to_keep, embeds, hidden, **_) -> Forward:
        ids, positions, inputs = self._inputs(token_ids, position_ids, embeds)
        mask = self._additive(visible)
        self.watch.start()
        out = reference_forward(
            self.model, self.cache, ids, positions, mask, logits_to_keep, embeds=inputs, hidden=hidden
        )
        return self._done(len(token_ids), out, hidden)

    def _lean(self, token_ids, position_ids, visible, logits_to_keep, embeds, hidden, **_) -> Forward:
        ids, positions, inputs = self._inputs(token_ids, position_ids, embeds)
        mask = self._additive(visible)
        self.watch.start()
        out = self.lean(ids, positions, mask, self.cache.layers, logits_to_keep, embeds=inputs, hidden=hidden)
        return self._done(len(token_ids), out, hidden)

    def _captured(self, token_ids, position_ids, visible, logits_to_keep, embeds, hidden, most_keys=None) -> Forward:
        """The padded forward (graphs.py) when q fits a bucket; else, and for taps (captured
        forwards hand out final states only), the unpadded lean forward."""
        if not self.padded.fits(len(token_ids)) or (isinstance(hidden, tuple) and hidden):
            run = self._invariant if self.padded.static is not None else self._lean
            args = (token_ids, position_ids, visible, logits_to_keep, embeds, hidden)
            return run(*args, unpadded=True, most_keys=most_keys)
        captured = self.padded.capture_s
        self.watch.start()
        out = self.padded(
            token_ids,
            position_ids,
            visible,
            self.length,
            logits_to_keep,
            embeds=embeds,
            dtype=self.model.dtype,
            device=self.device,
            most_keys=most_keys,
            states=bool(hidden),
        )
        return self._done(len(token_ids), out, hidden, (self.padded.capture_s - captured) * 1e3)

    def _invariant(
        self, token_ids, position_ids, visible, logits_to_keep, embeds, hidden, unpadded=False, most_keys=None
    ) -> Forward:
        """Each row over its own keys (invariant.py): no mask. At fixed shapes (StaticRows) where
        the choice is padded: through the padded forward when the rows fit a bucket, else (a long
        prefill, taps) the same rows eagerly; else grouped by key count (RowGroups)."""
        if self.padded is not None and not unpadded:
            return self._captured(token_ids, position_ids, visible, logits_to_keep, embeds, hidden, most_keys)
        ids, positions, inputs = self._inputs(token_ids, position_ids, embeds)
        verdict = self.verdict
        if self.padded is not None:
            needed = most_keys if most_keys is not None else int(visible.sum(1).max())  # the most keys a row sees
            static = self.padded.static_for(needed)
            built = StaticRows.build(visible, static.positions_end, check=most_keys is None)
            slots, tail = (t if t.device == self.device else to_device(t, self.device) for t in built)
            rows = dataclasses.replace(static, slots=slots, tail=tail)
        else:
            rows = RowGroups.of(
                visible, self.device, max(position_ids) + 1, verdict.linear_rows, verdict.attention_rows
            )
        self.watch.start()
        out = self.lean(
            ids, positions, None, self.cache.layers, logits_to_keep, embeds=inputs, hidden=hidden, rows=rows
        )
        return self._done(len(token_ids), out, hidden)

    def _inputs(self, token_ids, position_ids, embeds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """ids (1, q) and positions (1, q) on the device in one upload (none when they are device
        tensors already: a level drafted on the device); embeds as (1, q, hidden)."""
        if isinstance(token_ids, torch.Tensor):
            ids, positions = token_ids[None], position_ids[None]
        else:
            ids, positions = to_device(torch.tensor([token_ids, position_ids]), self.device)[:, None]
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


def chain_then_tree_visibility(past: int, n_chain: int, tree_ancestors: torch.Tensor) -> torch.Tensor:
    """Visibility for [chain tokens (causal)] + [tree nodes whose root is the last chain token].

    Args:
        past: tokens already in the cache (all visible to everyone).
        n_chain: pending committed tokens, causal among themselves; the last one is the root.
        tree_ancestors: (n, n) bool ancestor closure over the drafted nodes (root excluded).
    Returns:
        (n_chain + n, past + n_chain + n) bool, on the ancestors' device.
    """
    n, device = tree_ancestors.shape[0], tree_ancestors.device
    q = n_chain + n
    # three ops: everyone sees the past; the new rows causal (the chain's rows see the chain up
    # to themselves, the tree's rows all of it), then the tree's rows see their ancestors only
    visible = torch.ones(q, past + q, dtype=torch.bool, device=device)
    visible[:, past:].tril_()
    if n:
        visible[n_chain:, past + n_chain :] = tree_ancestors
    return visible
