"""measure/divergence.py: where a width-invariant tree run first leaves `ar`'s bits.

On this CPU the width-invariant forward is bitwise (tests/test_invariant.py), so the trace must
say so; with a kernel injected that breaks the promise (attention whose bits follow the batch
count, a head whose bits follow the row count), it must find the first differing position and
name the part of the forward where the bits parted, from the caches."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import noisy_copy, tiny_model

from dynatree_core.forward import capture, invariant
from dynatree_core.forward.fastpath import lean_forward_for
from dynatree_core.measure.divergence import divergence, trace_line

PROMPT = [5, 9, 13, 2, 7, 11, 3, 40, 22, 17]


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    draft = copy.deepcopy(noisy_copy("llama", 0.01)).to(torch.bfloat16)
    lean_forward_for(target).__dict__.pop("_width_verdicts", None)
    return target, draft


def _skip_unless_bitwise(target) -> None:
    verdict = invariant.width_verdict(lean_forward_for(target), torch.bfloat16, torch.device("cpu"))
    if verdict.reason is not None:
        pytest.skip(f"this CPU's kernels are not width-invariant in bfloat16 ({verdict.reason})")


@pytest.mark.parametrize("policy", ("fixed_tree", "eagle2"))
def test_a_bitwise_device_gets_a_bitwise_trace(policy):
    target, draft = _pair()
    _skip_unless_bitwise(target)
    trace = divergence(target, draft, PROMPT, policy, max_new=40)
    assert trace["bitwise"] and trace["token_identical"], trace
    assert trace["positions"] == 40 and trace["path"] == "lean+invariant"
    assert trace_line(trace).startswith("bitwise over 40 positions, token-identical")


@pytest.mark.parametrize("policy", ("fixed_tree", "eagle2"))
def test_the_trace_reads_the_logits_of_captured_steps(policy, monkeypatch):
    """Where the run's forwards and steps are captured (CUDA; stand-in graphs here), the verify
    forward runs as a captured step (forward/filled.py), not through KVState.run: the trace still
    reads each forward's logits (on an H100 it read the prefill's one row for a tree's, 2026-11-27)."""
    monkeypatch.setattr(capture, "STAND_IN_DEVICES", ("cpu",))
    target, draft = _pair()
    _skip_unless_bitwise(target)
    before = capture.REPLAYS["verify"]
    trace = divergence(target, draft, PROMPT, policy, max_new=40, graphs=True)
    assert capture.REPLAYS["verify"] > before, "the verify forwards ran as captured steps"
    assert trace["bitwise"] and trace["token_identical"] and trace["positions"] == 40, trace


def test_attention_that_follows_the_batch_count_is_found_after_layer_0(monkeypatch):
    """bmm whose bits change with its number of items, and no fixed-size calls: the first
    accepted node that shared its call with siblings differs, and the caches name layer 0's
    attention (layer 0's keys and values at that position are still equal)."""
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: (o := real(a, b)) + (o.abs() + 1e-3) * 2**-8 / a.shape[0])
    monkeypatch.setattr(invariant, "ATTENTION_ROWS", 1)
    target, draft = _pair()
    trace = divergence(target, draft, PROMPT, "fixed_tree", max_new=40)
    assert "not bitwise on this device: attention" in trace["path"]
    assert not trace["bitwise"] and trace["rows_in_forward"] > 1, trace
    assert trace["cache"]["layer"] == 1 and trace["cache"]["position"] == trace["position"], trace
    assert trace["where"].startswith("layer 0's attention")
    assert "first differing: layer 0's attention" in trace_line(trace)


def test_a_head_that_follows_the_rows_of_its_call_is_found_after_every_cache_entry():
    target, draft = _pair()
    lean = lean_forward_for(target)
    head = lean.head
    # a row's logits shift by a quarter per real (nonzero) row of its call: neither padding nor
    # calls of one shape help (padding rows are zeros)
    lean.head = lambda x: head(x) + (x.float().abs().sum(-1) > 0).sum() * 0.25
    try:
        trace = divergence(target, draft, PROMPT, "fixed_tree", max_new=40)
    finally:
        lean.head = head
        lean.__dict__.pop("_width_verdicts", None)
    assert "not bitwise on this device: head" in trace["path"]
    assert not trace["bitwise"] and trace["cache"] is None, trace
    assert trace["where"].startswith("final norm or head")
    assert trace["max_abs_diff"] >= 0.25, "the head's shift for the rows beside the node's"
    assert not trace["token_flipped"], "a shift of every logit keeps the argmax"
