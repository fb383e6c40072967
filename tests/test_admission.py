"""A level's admission (drafting/admission.py): the one Triton kernel, run here in Triton's
interpreter, decides every output exactly as the torch form does, on made-up levels full of ties,
padding (NaN) and -inf, and on whole trees and runs; a level's decision is then a handful of
launches."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import examples, hf_greedy, noisy_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from test_device_draft import decided, signature
from test_feature_draft import feature_draft

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.engine import DecodeConfig, decode, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting import admission
from dynatree_core.drafting.admission import LeafGate, admit_kernel_on, admit_level, admit_torch
from dynatree_core.drafting.tensor_tree import AT_DEPTH, AT_LENGTH
from dynatree_core.measure.launches import per_iteration

pytest.importorskip("triton")


@examples(150)
@given(
    data=st.data(),
    m=st.integers(1, 140),
    budget=st.integers(1, 48),
    log_tau=st.sampled_from([-math.inf, -3.0, -1.0, 0.0]),
    at_cap=st.booleans(),
    rho_stop=st.sampled_from([-math.inf, -2.5]),
    rho_deep=st.sampled_from([-math.inf, -1.0]),
    record=st.booleans(),
)
def test_the_kernel_admits_a_level_exactly_as_the_torch_form(
    data, m, budget, log_tau, at_cap, rho_stop, rho_deep, record
):
    """Every output (order, tokens, log-probs, rows, fates, leaf codes, cumulative log-probs, the
    next rows, the counts and the record) equal, NaN where NaN: coarse values tie often, some
    candidates are padding (NaN) and some cannot be proposed (-inf)."""
    values = data.draw(
        st.lists(st.sampled_from([0.0, -0.5, -1.0, -1.5, -3.0, -math.inf, math.nan]), min_size=m, max_size=m)
    )
    cum = torch.tensor(values, dtype=torch.float64)
    tokens = torch.tensor(data.draw(st.lists(st.integers(0, 500), min_size=m, max_size=m)))
    lp = torch.linspace(-4.0, 0.0, m)
    rows = torch.arange(m) // 4
    drafted = torch.tensor(data.draw(st.integers(0, budget)))
    gate = LeafGate(2 if at_cap else 9, AT_LENGTH, budget, log_rho_stop=rho_stop, log_rho_deep=rho_deep, deep_from=2)
    level, index = 2, torch.arange(m)
    want = admit_torch(tokens, lp, cum, rows, drafted, index, index.double(), log_tau, gate, level, record)
    got = admit_level(tokens, lp, cum, rows, drafted, log_tau, budget, *gate.codes(level), record)
    names = ("tokens", "lp", "rows", "fate", "leaf", "cum", "following", "total", "count", "record")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), name


def test_the_check_passes_in_the_interpreter_and_the_kernel_is_off_unless_asked():
    assert admission.check(torch.device("cpu"))
    assert not admission.enabled("cpu")  # the CPU keeps the torch form; tests ask for the kernel
    with admit_kernel_on("cpu"):
        assert admission.enabled("cpu")
    assert not admission.enabled("cpu")


def test_a_level_with_more_candidates_than_one_program_ranks_takes_the_torch_form(monkeypatch):
    monkeypatch.setattr(admission, "admit_level", lambda *args: 1 / 0)  # the kernel, were it called
    m = admission.MOST_CANDIDATES + 1
    cum, index = torch.zeros(m, dtype=torch.float64), torch.arange(m)
    args = (index, cum.float(), cum, index, torch.tensor(0), index, index.double())
    out = admission.admit(*args, log_tau=-1.0, gate=LeafGate(9, AT_DEPTH, 4), level=1, record=True, kernel=True)
    assert out[3].tolist()[:5] == [0, 0, 0, 0, 1]  # four admitted, then BUDGET


def test_the_gate_is_one_rule_as_data_and_as_tensor_ops():
    """LeafGate's tensor form and the codes the kernel reads agree: the cap's code at the cap, the
    budget spent, dynatree's early stop (below rho_stop) over its depth gate (below rho_deep from D0)."""
    gate = LeafGate(4, AT_DEPTH, 5, log_rho_stop=-2.0, log_rho_deep=-1.0, deep_from=2)
    cum = torch.tensor([0.0, -1.5, -2.5, math.nan], dtype=torch.float64)
    assert gate(4, cum, torch.tensor(0)).tolist() == [AT_DEPTH] * 4 and gate.codes(4)[0] == AT_DEPTH
    assert gate(1, cum, torch.tensor(5)).tolist() == [3, 3, 4, 3]  # the budget spent; below rho_stop
    assert gate(2, cum, torch.tensor(1)).tolist() == [0, 5, 4, 0]  # from D0: below rho_deep
    assert gate.codes(1) == (0, -2.0, -math.inf) and gate.codes(3) == (0, -2.0, -1.0)


POLICIES = [
    ("fixed_tree", {}),
    ("fixed_tree", {"budget": 5, "tau": 0.0, "branch": 4}),
    ("fixed_tree", {"tau": 0.02, "depth": 4, "budget": 9}),
    ("dynatree", {}),
    ("dynatree", {"budget": 6, "d0": 2, "rho_deep": 0.5, "tau_h": 0.5, "tau_l": 0.2}),
    ("dyspec_threshold", {"threshold": 0.005, "budget": 7, "max_children": 3}),
]


@pytest.mark.parametrize("policy,values", POLICIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trees_admitted_by_the_kernel_are_the_papers_loops_trees(policy, values, seed):
    """On made-up draft distributions (many exact ties, some -inf), the levels decided by the
    kernel, with their counts read at once and at fixed widths, give the papers' loops' trees, and
    the verify rows built from them are the trees' nodes in bfs order (decided checks them)."""
    with admit_kernel_on("cpu"):
        trees = decided(policy, values, 5, seed)
    assert signature(trees[0]) == signature(trees[1]) == signature(trees[2]), f"{policy} {values}"


@pytest.mark.parametrize("policy,values", [POLICIES[0], POLICIES[3]])
def test_runs_with_the_kernel_keep_the_torch_forms_records_and_a_level_launches_fewer_ops(policy, values):
    """A whole run (a token draft and a feature draft, levels at fixed widths, padded forwards)
    with the kernel keeps the torch form's records and the target's greedy tokens; counted op by
    op, an iteration launches fewer ops outside its forwards."""
    target, prompt = tiny_model("llama"), [1, 5, 7, 9, 11]
    forward = ForwardSettings(graphs=True, step_graphs=False, device_draft=True, device_verify=True)
    config = DecodeConfig(16, forward=forward)
    for draft in (noisy_copy("llama", 0.3), feature_draft("llama")):
        torch_form = list(decode(target, prompt, make_method(policy, values), draft=draft, config=config))
        with admit_kernel_on("cpu"):
            kernel = list(decode(target, prompt, make_method(policy, values), draft=draft, config=config))
        assert [r.committed for r in kernel] == [r.committed for r in torch_form]
        assert [t for r in kernel for t in r.committed] == hf_greedy(target, prompt, 16)
        for a, b in zip(kernel, torch_form, strict=True):
            assert signature(a.tree) == signature(b.tree) and a.order == b.order and a.mask == b.mask

    def run():
        return generate(target, prompt, make_method(policy, values), draft=noisy_copy("llama", 0.3), config=config)

    eager = per_iteration(run, torch.device("cpu"))
    with admit_kernel_on("cpu"):
        fused = per_iteration(run, torch.device("cpu"))
    assert fused["ops"] < eager["ops"], (fused, eager)
