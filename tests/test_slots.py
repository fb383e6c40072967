"""The static cache's buffers (forward/slots.py): every layer's keys and values views of one store,
grown for all layers at once, compacted in one copy; a layer that cannot share keeps its own."""

from __future__ import annotations

import torch
from conftest import tiny_model

from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows
from dynatree_core.forward.slots import SlotLayer, SlotStore, side_by_side, write_slots


def _entries(n: int, seed: int, heads: int = 2, dim: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, n, dim, generator=g), torch.randn(1, heads, n, dim, generator=g)


def test_layers_share_one_buffer_that_grows_for_all_of_them_at_once():
    store = SlotStore(3)
    layers = [SlotLayer(4, store=store, index=i) for i in range(3)]
    written = [_entries(3, i) for i in range(3)]
    for layer, (k, v) in zip(layers, written, strict=True):
        layer.update(k, v)
    assert all(
        layer.in_store and layer.key_buf.data_ptr() == store.buf[i, 0].data_ptr() for i, layer in enumerate(layers)
    )
    k, v = _entries(5, 9)
    layers[0].update(k, v)  # 8 slots > 4: the store grows, every layer moves with it
    assert store.capacity >= 8 and all(layer.capacity == store.capacity and layer.grows == 1 for layer in layers)
    assert all(layer.key_buf.data_ptr() == store.buf[i, 0].data_ptr() for i, layer in enumerate(layers))
    for layer, (k0, v0) in zip(layers[1:], written[1:], strict=True):  # kept through the growth
        assert torch.equal(layer.keys, k0) and torch.equal(layer.values, v0)
    assert torch.equal(layers[0].keys[..., 3:, :], k)


@torch.inference_mode()  # as the engine runs (a lean forward built under it is shared by tests)
def test_compaction_moves_every_layer_in_one_copy_as_the_per_layer_moves_would():
    target = tiny_model("llama")
    kv = KVState(target, list(range(1, 12)), static=True)
    kv.run(Rows.chain(list(range(1, 12)), 0))
    layers = kv.cache.layers
    store = layers[0].store
    assert store.holds(layers)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
    keep = [0, 1, 2, 3, 4, 7, 9]
    kv.keep(keep)
    for layer, (k, v) in zip(layers, before, strict=True):
        assert layer.length == len(keep) and torch.equal(layer.keys, k[..., keep, :])
        assert torch.equal(layer.values, v[..., keep, :])


def test_a_layer_of_other_shapes_keeps_buffers_of_its_own():
    store = SlotStore(2)
    a, b = SlotLayer(4, store=store, index=0), SlotLayer(4, store=store, index=1)
    a.update(*_entries(2, 0, heads=2))
    b.update(*_entries(2, 1, heads=3))  # other head count: not the store's shape
    assert a.in_store and not b.in_store and b.key_buf.shape == (1, 3, 4, 4)
    assert not store.holds([a, b]) and store.holds([a])


def test_keys_and_values_side_by_side_go_in_one_write_as_two_writes_would():
    """A store's layer and a fused q/k/v output (k beside v) take one write for both
    (side_by_side); what lands in the buffers is what the two writes put there, and tensors that
    are not side by side (other storage, v before k, other strides) take two."""
    store = SlotStore(2)
    layer, alone = SlotLayer(8, store=store, index=1), SlotLayer(8)
    for target in (layer, alone):
        target.update(*_entries(2, 0))
    qkv = torch.randn(1, 6, 3, 4)  # q heads 0-1, k heads 2-3, v heads 4-5
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    assert side_by_side(k, v) is not None and side_by_side(layer.key_buf, layer.value_buf) is not None
    assert side_by_side(v, k) is None and side_by_side(k, v.clone()) is None, "v before k; other storage"
    assert side_by_side(k, qkv[:, 3:5, :, :2]) is None, "other shapes"
    slots = torch.tensor([5, 2, 7])
    write_slots(layer, slots, k, v)
    write_slots(alone, slots, k.clone(), v.clone())  # two index_copy_
    assert torch.equal(layer.key_buf, alone.key_buf) and torch.equal(layer.value_buf, alone.value_buf)
    assert torch.equal(layer.key_buf[0, :, 5], k[0, :, 0]) and torch.equal(layer.value_buf[0, :, 7], v[0, :, 2])
    assert torch.equal(store.buf[0], torch.zeros_like(store.buf[0])), "the other layer untouched"
    layer.set_length(2)
    alone.set_length(2)
    layer.update(k, v)  # the eager write: one copy of both
    alone.update(k.clone(), v.clone())
    assert torch.equal(layer.keys, alone.keys) and torch.equal(layer.values, alone.values)
