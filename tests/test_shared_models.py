"""The guard in conftest.py that keeps the cached tiny models unchanged between tests."""

from __future__ import annotations

import copy

import torch
from conftest import _fingerprint, tiny_model


def test_the_guard_sees_a_leaked_spy_a_weight_change_and_a_cast():
    model = copy.deepcopy(tiny_model("llama"))
    before = _fingerprint(model)
    assert _fingerprint(model) == before, "a fingerprint is stable"
    model.model.layers[0].forward = lambda *a, **k: None  # a spy patched onto a module and left there
    assert _fingerprint(model) != before
    del model.model.layers[0].forward
    assert _fingerprint(model) == before
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    assert _fingerprint(model) != before
    assert _fingerprint(copy.deepcopy(tiny_model("llama")).float()) != before
