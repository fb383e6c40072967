"""Captured device steps (forward/capture.py): a draft level's decision and the verify rows replayed as
one graph each where forwards are captured. CI has no GPU: stand-in graphs replay the captured
function over the step's own buffers, so what a graph changes for the engine (static buffers
overwritten by the next replay, inputs copied in, Python values frozen at capture) is what these
tests see; `gpu-check` runs the same runs on a GPU with real graphs."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHS, examples, hf_greedy, noisy_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from test_device_draft import PathDrafter, RowsProbe, check_rows, signature, verified
from test_feature_draft import feature_draft

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.engine import DecodeConfig, decode, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting import DraftRequest, make_policy
from dynatree_core.forward import capture
from dynatree_core.forward.capture import StepGraphs
from dynatree_core.forward.kv import KVState

CPU = torch.device("cpu")
STEPPED = [  # policies whose levels are decided by captured steps (device.admitted_levels, grow_all_levels)
    ("fixed_tree", {}),
    ("fixed_tree", {"budget": 5, "tau": 0.0, "branch": 4}),
    ("dynatree", {}),
    ("dynatree", {"budget": 6, "d0": 2, "rho_deep": 0.5, "tau_h": 0.5, "tau_l": 0.2}),
    ("dyspec_threshold", {"threshold": 0.005, "budget": 7, "max_children": 3}),
    ("eagle2", {"depth": 5, "topk": 2, "total": 6}),  # device.grow_all_levels: a beam, reranked on the device
    ("delayed", {}),
]


def records(target, draft, prompt, policy, params, *, stand_in: bool, monkeypatch, n: int = 24):
    monkeypatch.setattr(capture, "STAND_IN_DEVICES", ("cpu",) if stand_in else ())
    config = DecodeConfig(n, forward=ForwardSettings(graphs=True, device_draft=True, device_verify=True))
    return list(decode(target, prompt, make_method(policy, params), draft=draft, config=config))


@pytest.mark.parametrize("arch", ARCHS)
def test_captured_steps_replay_what_the_eager_steps_compute(arch, monkeypatch):
    """Every iteration's record (nodes, mask, positions, the target's choices, committed tokens)
    is the same with the levels (their forwards and inputs), the levels' decisions and the verify
    rows replayed from captured steps as computed eagerly, for a token draft and a feature draft,
    the trees' log-probabilities bit for bit; the steps were captured once per shape and replayed
    after (dynatree's tau_h, which drifts, goes in as a tensor, not a capture)."""
    target, prompt = tiny_model(arch), [1, 5, 7, 9, 11]
    for draft in (noisy_copy(arch, 0.3), feature_draft(arch)):
        for policy, params in STEPPED:
            before = capture.REPLAYS.copy()
            stepped = records(target, draft, prompt, policy, params, stand_in=True, monkeypatch=monkeypatch)
            replays, levels, verifies = (capture.REPLAYS[k] - before[k] for k in ("step", "level", "verify"))
            eager = records(target, draft, prompt, policy, params, stand_in=False, monkeypatch=monkeypatch)
            assert [t for r in stepped for t in r.committed] == hf_greedy(target, prompt, 24), f"{policy} {params}"
            assert [verified(r) for r in stepped] == [verified(r) for r in eager], f"{policy} {params}"
            # the drafts' log-probabilities too, bit for bit: a captured level sees what the eager one does
            assert [signature(r.tree) for r in stepped] == [signature(r.tree) for r in eager], f"{policy} {params}"
            drafting = sum(1 for r in stepped if r.draft_forwards)
            forwards = sum(r.draft_forwards for r in stepped)
            # steps are captured where the draft's forwards run at fixed shapes (not HF's static cache):
            # every draft forward but the prefill is one step with its inputs (KVState.level), each
            # forward's decision one more, plus the verify rows and the verify forward with its inputs
            captured = fixed_shapes(draft, monkeypatch)
            most = 3 * forwards + len(stepped)  # and at most one chain's verify an iteration
            assert (replays >= drafting) == captured and replays in (0, *range(drafting, most + 1))
            assert levels == (forwards - 1 if captured else 0), f"{policy} {params}: {levels} level steps"
            # every iteration's verify forward is one step (forward/filled.py): queued from the rows,
            # or from a batch built on the host (an iteration that drafted nothing) but for a
            # prefill (the target's cache empty)
            expected = captured_verifies(stepped) if fixed_shapes(target, monkeypatch) else 0
            assert verifies == expected, f"{policy} {params}: {verifies} verify steps"
            assert capture.REPLAYS["step"] - before["step"] == replays, "the eager run replays nothing"


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_width_invariant_verify_forwards_capture_their_inputs_and_keep_ars_tokens(arch, monkeypatch):
    """bfloat16 (width-invariant forwards by default, at fixed shapes): every verify forward after
    the prefill is one captured step with its inputs (queued from the rows, or from a batch built
    on the host where nothing was drafted), each row's slots in sequence order built inside it
    (static_rows.StaticRows.build); the tokens are bfloat16 `ar`'s, and every record and tree the
    eager run's, bit for bit."""
    from test_invariant import _model, _skip_unless_bitwise

    target, prompt = _model(arch, torch.bfloat16), [1, 5, 7, 9, 11]
    _skip_unless_bitwise(target)
    draft = copy.deepcopy(noisy_copy(arch, 0.01)).to(torch.bfloat16)
    ar = generate(target, prompt, make_method("ar"), config=DecodeConfig(24, forward=ForwardSettings(graphs=True)))
    for policy, params in STEPPED:
        before = capture.REPLAYS.copy()
        stepped = records(target, draft, prompt, policy, params, stand_in=True, monkeypatch=monkeypatch)
        verifies = capture.REPLAYS["verify"] - before["verify"]
        eager = records(target, draft, prompt, policy, params, stand_in=False, monkeypatch=monkeypatch)
        assert {r.forward_path for r in stepped} == {"lean+invariant+padded"}
        assert [t for r in stepped for t in r.committed] == ar.token_ids, f"{policy} {params}"
        assert [verified(r) for r in stepped] == [verified(r) for r in eager], f"{policy} {params}"
        assert [signature(r.tree) for r in stepped] == [signature(r.tree) for r in eager], f"{policy} {params}"
        assert verifies == captured_verifies(stepped), f"{policy} {params}: {verifies} verify steps"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_ars_forward_after_the_prefill_is_one_captured_step_with_its_inputs(dtype, monkeypatch):
    """`ar`'s loop with the target's steps captured: after the prefill every token's forward is
    one replay of the chain's step (KVState.chain: its inputs built inside it from one upload), and
    the tokens are those of the same run with nothing captured (float32: HF's greedy; bfloat16, at
    fixed width-invariant shapes: the eager run's)."""
    from test_invariant import _model

    target, prompt = _model("llama", dtype), [1, 5, 7, 9, 11]
    config = DecodeConfig(24, forward=ForwardSettings(graphs=True))
    monkeypatch.setattr(capture, "STAND_IN_DEVICES", ("cpu",))
    before = capture.REPLAYS.copy()
    stepped = generate(target, prompt, make_method("ar"), config=config)
    assert capture.REPLAYS["verify"] - before["verify"] == len(stepped.token_ids) - 1
    monkeypatch.setattr(capture, "STAND_IN_DEVICES", ())
    eager = generate(target, prompt, make_method("ar"), config=config)
    assert stepped.token_ids == eager.token_ids and stepped.forward_path == eager.forward_path
    if dtype == torch.float32:
        assert stepped.token_ids == hf_greedy(target, prompt, 24)


HOST_BUILT = [  # verify batches built on the host: levels read on the host, or sampled verification
    ("dyspec", {}, "greedy"),
    ("salf", {}, "greedy"),
    ("fixed_tree", {"depth": 2, "branch": 3, "tau": 0.0}, "specinfer"),
]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_batches_built_on_the_host_verify_as_one_captured_step_a_width(dtype, monkeypatch):
    """A verify batch built on the host (dyspec and salf read their levels; sampled verification)
    goes up in one upload, its ids, positions and block of the mask padded to the width it runs at,
    and runs as one captured step (KVState.rows), one graph a width whatever the tree's size in it:
    every record and tree is the eager run's, bit for bit, and greedy tokens are `ar`'s."""
    from test_invariant import _model

    from dynatree_core.core.sampling_config import SamplingConfig
    from dynatree_core.decoding.engine import iterate, start_run

    target, prompt = _model("llama", dtype), [1, 5, 7, 9, 11]
    draft = copy.deepcopy(noisy_copy("llama", 0.3)).to(dtype)
    ar = generate(target, prompt, make_method("ar"), config=DecodeConfig(24, forward=ForwardSettings(graphs=True)))
    for policy, params, verifier in HOST_BUILT:
        sampling = SamplingConfig(temperature=0.9, top_k=20) if verifier != "greedy" else None
        config = DecodeConfig(
            24,
            forward=ForwardSettings(graphs=True),
            verifier=verifier,
            seed=3,
            **{"sampling": sampling} if sampling else {},
        )
        runs = {}
        for stand_in in (True, False):
            monkeypatch.setattr(capture, "STAND_IN_DEVICES", ("cpu",) if stand_in else ())
            before = capture.REPLAYS["verify"]
            state = start_run(target, prompt, make_method(policy, params), draft=draft, config=config)
            runs[stand_in] = (list(iterate(state)), capture.REPLAYS["verify"] - before, state.target_kv.steps)
        (stepped, verifies, steps), (eager, _, _) = runs[True], runs[False]
        assert [verified(r) for r in stepped] == [verified(r) for r in eager], f"{policy} {verifier}"
        assert [signature(r.tree) for r in stepped] == [signature(r.tree) for r in eager], f"{policy} {verifier}"
        if verifier == "greedy":
            assert [t for r in stepped for t in r.committed] == ar.token_ids, f"{policy} {params}"
        assert verifies == captured_verifies(stepped), f"{policy} {verifier}: {verifies} verify steps"
        widths = [key[0][2] for key in steps.steps if key[0][:2] == ("verify", "rows")]
        sizes = {r.verify_rows for r in stepped[1:] if len(r.order) > 1}
        assert len(widths) == len(set(widths)) < max(len(sizes), 2), (
            f"{policy}: a graph per width, {widths} for {sizes}"
        )


def test_a_fused_drafts_captured_forwards_are_its_eager_ones(monkeypatch):
    """A fused draft (EAGLE-3's layout) runs its own forward, never at fixed shapes, and reads the
    target's taps, so the verify forward runs uncaptured too: with the target's steps captured it
    drafts the same trees, bit for bit, and no forward went through a captured step."""
    from dynatree_core.core.vocab import TokenMap
    from dynatree_core.drafts.fused import FusedDraft

    target, prompt = tiny_model("llama"), [1, 5, 7, 9, 11]
    draft = FusedDraft.from_target(target, TokenMap([-1, *range(1, 96, 3)], 96), taps=(1, 1, 1))
    for policy, params in STEPPED[:3]:
        before = capture.REPLAYS.copy()
        stepped = records(target, draft, prompt, policy, params, stand_in=True, monkeypatch=monkeypatch)
        levels, verifies = (capture.REPLAYS[k] - before[k] for k in ("level", "verify"))
        eager = records(target, draft, prompt, policy, params, stand_in=False, monkeypatch=monkeypatch)
        assert [t for r in stepped for t in r.committed] == hf_greedy(target, prompt, 24), f"{policy} {params}"
        assert [signature(r.tree) for r in stepped] == [signature(r.tree) for r in eager], f"{policy} {params}"
        assert levels == 0 and verifies == 0 and sum(r.draft_forwards for r in stepped) > 0


def test_captured_forwards_stay_exact_where_the_span_they_read_doubles(monkeypatch):
    """A prompt just short of the smallest span (graphs.MIN_SPAN): the iterations cross into the
    next span, their forwards' steps are captured again over it, and the trees stay the eager ones."""
    from dynatree_core.forward.graphs import MIN_SPAN

    target, draft = tiny_model("llama"), noisy_copy("llama", 0.3)
    prompt = [1 + i % 90 for i in range(MIN_SPAN - 20)]
    stepped = records(target, draft, prompt, "fixed_tree", {}, stand_in=True, monkeypatch=monkeypatch, n=32)
    eager = records(target, draft, prompt, "fixed_tree", {}, stand_in=False, monkeypatch=monkeypatch, n=32)
    assert [t for r in stepped for t in r.committed] == hf_greedy(target, prompt, 32)
    assert [signature(r.tree) for r in stepped] == [signature(r.tree) for r in eager]
    assert [verified(r) for r in stepped] == [verified(r) for r in eager]


def test_forgotten_steps_release_their_outputs_place_among_the_fixed():
    steps = StepGraphs(CPU, capture=True)
    (a,) = steps(("level", 256), lambda t: (t + 1,), torch.zeros(2))
    (b,) = steps(("level", 512), lambda t: (t + 2,), torch.zeros(2))
    steps.forget(lambda key: key[-1] == 256)
    assert [key[0] for key in steps.steps] == [("level", 512)]
    assert capture._memory(b) in steps.fixed and capture._memory(a) not in steps.fixed


def captured_verifies(records) -> int:
    """Iterations whose verify forward is a captured step where the target's steps are: every one
    over a non-empty cache (past = root - chain + 1 > 0), queued from the rows or built on the
    host; the prefill runs eagerly (its width is the prompt's)."""
    return sum(1 for r in records if r.prefix_len + 1 - r.chain_len > 0)


def fixed_shapes(draft, monkeypatch) -> bool:
    monkeypatch.setattr(capture, "STAND_IN_DEVICES", ("cpu",))
    model = draft.lm if hasattr(draft, "lm") else draft
    return KVState(model, [1], graphs=True).steps.capture


_SHARED = StepGraphs(CPU, capture=True)  # on a CPU: stand-in graphs, kept across examples (replays)


@examples(60)
@given(
    seed=st.integers(0, 10**6),
    policy=st.sampled_from(["fixed_tree", "dynatree", "dyspec_threshold"]),
    budget=st.integers(1, 12),
    tau=st.sampled_from([0.0, 0.01, 0.1]),
    max_depth=st.integers(1, 5),
)
def test_replayed_steps_decide_as_the_host_does(seed, policy, budget, tau, max_depth):
    """Trees drafted with one set of captured steps, replayed across examples with other draft
    distributions, are the host path's trees, and their verify rows are the tree's."""
    values = {"budget": budget, "tau" if policy != "dyspec_threshold" else "threshold": tau}
    host = make_policy(policy, values).draft(DraftRequest(root_token=7, max_depth=max_depth, drafter=PathDrafter(seed)))
    probe = RowsProbe()
    request = DraftRequest(
        root_token=7, max_depth=max_depth, drafter=PathDrafter(seed, _SHARED), on_device=True, early=probe
    )
    tree = make_policy(policy, values).draft(request)
    assert signature(tree) == signature(host)
    check_rows(tree, probe)
    # each level's count read at once (a GPU with --device-draft off): the same steps capture and replay
    request = DraftRequest(root_token=7, max_depth=max_depth, drafter=PathDrafter(seed, _SHARED))
    assert signature(make_policy(policy, values).draft(request)) == signature(host)
    assert not _SHARED.fallback, _SHARED.fallback


def test_a_step_replays_the_values_it_was_captured_with():
    """The contract the keys keep: a second call with the same key replays the first capture (its
    Python values), copies new inputs into the step's buffers, and returns the same buffers."""
    steps = StepGraphs(CPU, capture=True)
    x = torch.arange(4.0)
    (first,) = steps(("k",), lambda t: (t * 2,), x)
    (second,) = steps(("k",), lambda t: (t * 3,), x + 1)  # a value left out of the key: replayed stale
    assert second is first and second.tolist() == [2.0, 4.0, 6.0, 8.0]
    (other,) = steps(("k", 3), lambda t: (t * 3,), x)
    assert other.tolist() == [0.0, 3.0, 6.0, 9.0] and steps.captures == 2


def test_constants_are_captured_over_not_copied():
    steps = StepGraphs(CPU, capture=True)
    zero = steps.constant(("zero",), lambda: torch.zeros(3))
    assert steps.constant(("zero",), lambda: torch.ones(3)) is zero
    steps(("k",), lambda t, c: (t + c,), torch.ones(3), zero)
    (step,) = steps.steps.values()
    assert step.inputs[1] is zero and step.inputs[0] is not zero


def test_a_step_reads_another_steps_outputs_where_they_are():
    """Chained steps: an input that is another step's output is read in place (no copy); the
    same key over other buffers is another graph, so no step's outputs are written by another."""
    steps = StepGraphs(CPU, capture=True)
    (a,) = steps(("a",), lambda t: (t + 1,), torch.zeros(2))
    (b,) = steps(("b",), lambda t: (t * 10,), a)
    assert [s.inputs[0] is a for s in steps.steps.values()] == [False, True]
    (a2,) = steps(("a2",), lambda t: (t + 2,), torch.zeros(2))
    (b2,) = steps(("b",), lambda t: (t * 10,), a2)
    assert b2 is not b and b2.tolist() == [20.0, 20.0] and b.tolist() == [10.0, 10.0] and a.tolist() == [1.0, 1.0]
    (a,) = steps(("a",), lambda t: (t + 1,), torch.full((2,), 4.0))
    (b3,) = steps(("b",), lambda t: (t * 10,), a)
    assert b3 is b and b.tolist() == [50.0, 50.0] and steps.captures == 4


def test_without_capture_a_step_is_the_function(monkeypatch):
    steps = StepGraphs(CPU, capture=False)
    (out,) = steps(("k",), lambda t: (t + 1,), torch.zeros(2))
    assert out.tolist() == [1.0, 1.0] and not steps.steps and steps.captures == 0


def test_a_failed_capture_warns_once_says_so_and_the_run_goes_on_eagerly(monkeypatch):
    real = capture.StepGraphs._capture

    def fail(self, fn, inputs, chained):  # the steps between forwards (the forwards' own: test_graphs)
        if self.kind == "step":
            raise RuntimeError("injected step capture failure")
        return real(self, fn, inputs, chained)

    monkeypatch.setattr(capture.StepGraphs, "_capture", fail)
    monkeypatch.setattr(capture, "_WARNED", set())
    target, draft, prompt = tiny_model("llama"), noisy_copy("llama", 0.3), [1, 5, 7, 9, 11]
    with pytest.warns(UserWarning, match="injected step capture failure") as caught:
        stepped = records(target, draft, prompt, "fixed_tree", {}, stand_in=True, monkeypatch=monkeypatch)
    assert len([w for w in caught if "device step failed" in str(w.message)]) == 1
    assert [t for r in stepped for t in r.committed] == hf_greedy(target, prompt, 24)
    # the run says so where a user reads how its forwards went (gpu-check's fallback row reads it)
    assert "step capture failed: RuntimeError: injected step capture failure" in stepped[-1].forward_path
