"""The static cache: every layer's keys and values in buffers preallocated for the run.

`SlotLayer` is one layer as transformers' `DynamicLayer` code reads it (`keys` / `values`: views
of the valid slots); `update` writes, never concatenates. Its buffers are views of one `SlotStore`
tensor shared by every layer of the model, (layers, 2, 1, kv_heads, capacity, head_dim), so the
cache's compaction (KVState.keep: the accepted path joins the committed prefix) is one gather and
one write for the whole model, not four small ops per layer (120 on SmolLM2's 30 layers: on a GPU,
120 kernel launches an iteration; measure/launches.py counts them). A layer whose shapes, dtype or
device differ from the store's (a model split across devices) keeps buffers of its own.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

SLACK = 128  # slots beyond prompt + new tokens: room for one iteration's tree before the buffer grows


def side_by_side(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a and b as one (2, *a.shape) view where they are equally shaped and strided slices of one
    buffer, b after a (a layer's keys and values in the store; a fused q/k/v output's k and v), so
    one op reads or writes both; else None."""
    same = a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
    if not same or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    step = b.storage_offset() - a.storage_offset()
    return a.as_strided((2, *a.shape), (step, *a.stride()), a.storage_offset()) if step > 0 else None


def _joint(layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the layer's buffers, the new entries), each as one side_by_side view, where both sides lie
    side by side (a store's layer; the fused q/k/v output's k and v, fastpath): one op writes both."""
    dst = side_by_side(layer.key_buf, layer.value_buf)
    src = side_by_side(keys, values) if dst is not None else None
    return (dst, src) if src is not None else None


def write_slots(layer, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """keys / values (1, kv_heads, q, d) into a layer's buffers at `slots` (q indices): one
    index_copy_ where both sides lie side by side (_joint), else one for each."""
    if (joint := _joint(layer, keys, values)) is not None:
        joint[0].index_copy_(3, slots, joint[1])
    else:
        layer.key_buf.index_copy_(2, slots, keys)
        layer.value_buf.index_copy_(2, slots, values)


class SlotStore:
    """One buffer for every layer's keys and values, allocated at the first layer's first write
    and grown for all layers at once."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.buf: torch.Tensor | None = None
        self.layers: list[SlotLayer] = []  # the layers whose buffers are views of `buf`

    @property
    def capacity(self) -> int:
        return self.buf.shape[-2] if self.buf is not None else 0

    def fits(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether a layer with these entries can live in the store (same shape, dtype, device)."""
        if key_states.shape != value_states.shape or key_states.dtype != value_states.dtype:
            return False
        if self.buf is None:
            return True
        b = self.buf
        return (tuple(key_states.shape[:-2]), key_states.shape[-1]) == (tuple(b.shape[2:-2]), b.shape[-1]) and (
            key_states.dtype == b.dtype and key_states.device == b.device
        )

    def allocate(self, example: torch.Tensor, capacity: int) -> None:
        # zeros, not empty: the padded forward (graphs.py) attends over every slot, masked ones
        # included, and 0 x NaN from uninitialised memory would still be NaN
        shape = (self.n_layers, 2, *example.shape[:-2], capacity, example.shape[-1])
        self.buf = torch.zeros(shape, dtype=example.dtype, device=example.device)

    def grow(self, capacity: int) -> None:
        """Reallocate to `capacity` slots, keeping every slot of every layer, and point every
        layer at the new buffer at once (a layer left on the old one would write where no one reads)."""
        old = self.buf
        self.allocate(old[0, 0], capacity)
        self.buf[..., : old.shape[-2], :] = old
        for layer in self.layers:
            layer.bind()

    def holds(self, layers: list) -> bool:
        """Every layer's buffers are the store's (so one op moves them all)."""
        return self.buf is not None and all(
            getattr(layer, "store", None) is self and layer.in_store for layer in layers
        )

    def keep(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move entries `src` to slots `dst` in every layer (sources at or after their destinations;
        the right-hand side's gather copies before the write)."""
        if len(src):
            self.buf[..., dst, :] = self.buf[..., src, :]


class SlotLayer(DynamicLayer):
    """One layer's keys/values in a buffer preallocated for the run: (1, kv_heads, capacity, head_dim),
    views of the model's SlotStore where one is given (module docstring).

    `keys` / `values` are views of the first `length` slots, so code written for transformers'
    `DynamicLayer` (which reads `.keys`) sees the same thing. `update` writes, never concatenates.
    """

    def __init__(self, capacity: int, *, store: SlotStore | None = None, index: int = 0):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.grows = 0
        self.key_buf: torch.Tensor | None = None
        self.value_buf: torch.Tensor | None = None
        self.store, self.index = store, index
        self.in_store = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        store = self.store
        if store is not None and store.fits(key_states, value_states):
            if store.buf is None:
                store.allocate(key_states, self.capacity)
            self.in_store = True
            store.layers.append(self)
            self.bind()
        else:
            shape = lambda t: (*t.shape[:-2], self.capacity, t.shape[-1])  # noqa: E731
            self.key_buf = torch.zeros(shape(key_states), dtype=self.dtype, device=self.device)  # zeros: see SlotStore
            self.value_buf = torch.zeros(shape(value_states), dtype=self.dtype, device=self.device)
        self.is_initialized = True
        self._views()

    def bind(self) -> None:
        """Point this layer's buffers at the store's (after its allocation or growth)."""
        self.key_buf, self.value_buf = self.store.buf[self.index, 0], self.store.buf[self.index, 1]
        if self.capacity != self.store.capacity:
            self.capacity = self.store.capacity
            self.grows += 1
        self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write q new entries at slots length..length+q; return views of all valid slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self.grow(end)
        if (joint := _joint(self, key_states, value_states)) is not None:  # keys and values in one copy
            joint[0][..., self.length : end, :].copy_(joint[1])
        else:
            self.key_buf[..., self.length : end, :].copy_(key_states)
            self.value_buf[..., self.length : end, :].copy_(value_states)
        self.set_length(end)
        return self.keys, self.values

    def keep(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Move entries `src` to slots `dst` (index tensors on the buffers' device; sources at or
        after their destinations) and keep the first `length` slots: the accepted path joins the
        committed prefix in place."""
        if len(src) and self.is_initialized:  # RHS indexing gathers a copy before the write
            self.key_buf[..., dst, :] = self.key_buf[..., src, :]
            self.value_buf[..., dst, :] = self.value_buf[..., src, :]
        self.set_length(length)

    def get_seq_length(self) -> int:
        return self.length

    def set_length(self, length: int) -> None:
        """The first `length` slots are valid (a padded forward wrote more: graphs.py)."""
        self.length = length
        self._views()

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return (self.key_buf.numel() + self.value_buf.numel()) * self.key_buf.element_size()

    def grow(self, needed: int) -> None:
        """Reallocate the buffers to hold `needed` slots (plus slack), keeping the valid entries;
        in a store, every layer's at once."""
        if self.in_store:
            if self.store.capacity < needed:
                self.store.grow(max(needed + SLACK, self.store.capacity * 3 // 2))
            return
        capacity = max(needed + SLACK, self.capacity * 3 // 2)
        for name in ("key_buf", "value_buf"):
            old = getattr(self, name)
            new = torch.zeros((*old.shape[:-2], capacity, old.shape[-1]), dtype=old.dtype, device=old.device)
            new[..., : self.length, :] = old[..., : self.length, :]
            setattr(self, name, new)
        self.capacity = capacity
        self.grows += 1

    def _views(self) -> None:
        if self.key_buf is None:
            return
        self.keys = self.key_buf[..., : self.length, :]
        self.values = self.value_buf[..., : self.length, :]
