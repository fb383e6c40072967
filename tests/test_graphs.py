"""Captured forwards (forward/graphs.py): the fixed-shape padded forward against the unpadded lean one.

On CUDA the padded forward is replayed as one CUDA graph per width bucket; on a CPU the same
arithmetic runs eagerly (KVState(graphs=True)), which is what these tests pin down: padded rows,
attention over the whole buffer and slot-indexed writes change nothing the engine can see. The
CUDA test runs only where a GPU exists.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from conftest import hf_greedy, noisy_copy, tiny_model
from test_fastpath import LEAN_ARCHS, _branching_tree, _prefill, _tree_forward

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting.policy import POLICIES
from dynatree_core.drafts.feature import FeatureDraft
from dynatree_core.forward import capture, graphs
from dynatree_core.forward.choice import forward_path
from dynatree_core.forward.graphs import bucket_for, buckets, graphs_enabled, span_for
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows

TOL = dict(rtol=1e-5, atol=1e-5)  # attention over more (masked) keys: same math, other summation blocks


def test_buckets_are_powers_of_two_up_to_the_widest():
    assert buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket_for(q, buckets(128)) for q in (1, 2, 3, 5, 64, 65, 128, 129)] == [1, 2, 4, 8, 64, 128, 128, None]


def test_graphs_are_on_for_cuda_only_unless_asked(monkeypatch):
    assert graphs_enabled(torch.device("cuda")) and not graphs_enabled(torch.device("cpu"))
    assert graphs_enabled(torch.device("cpu"), True) and not graphs_enabled(torch.device("cuda"), False)
    monkeypatch.setenv("DYNATREE_GRAPHS", "0")
    assert not graphs_enabled(torch.device("cuda"))
    model = tiny_model("llama")
    assert forward_path(model, graphs=True) == "lean+padded" and forward_path(model) == "lean"


@torch.inference_mode()
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_padded_forwards_equal_unpadded_ones_through_compaction(arch):
    """Prefill, a 6-node tree (padded to 8), compaction of an accepted path, then a 1-token step:
    logits, hidden states and the valid cache slots all equal the unpadded lean path's."""
    model, prompt = tiny_model(arch), [3, 1, 4, 1, 5, 9]
    ref, mine = KVState(model, prompt), KVState(model, prompt, graphs=True)
    assert mine.padded is not None and ref.padded is None
    torch.testing.assert_close(_prefill(mine, prompt[:-1]), _prefill(ref, prompt[:-1]), **TOL)
    tree = _branching_tree(prompt[-1])
    got, order = _tree_forward(mine, tree, len(prompt) - 1)
    want, _ = _tree_forward(ref, tree, len(prompt) - 1)
    torch.testing.assert_close(got, want, **TOL)
    keep = list(range(len(prompt))) + [len(prompt) - 1 + order.index(n) for n in (1, 3)]
    mine.keep(keep)
    ref.keep(keep)
    for a, b in zip(mine.cache.layers, ref.cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, **TOL)
        torch.testing.assert_close(a.values, b.values, **TOL)
    nxt = Rows.chain([17], len(keep), hidden=True)
    got, want = mine.run(nxt), ref.run(nxt)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    torch.testing.assert_close(got.states, want.states, **TOL)


@torch.inference_mode()
def test_wider_than_every_bucket_falls_back_and_a_full_cache_grows(monkeypatch):
    """A prefill wider than the largest bucket takes the unpadded path; a padded forward that does
    not fit the buffer grows it (dropping the buckets built for the old buffer)."""
    monkeypatch.setattr(graphs, "MAX_BUCKET", 4)
    monkeypatch.setattr(capture, "STAND_IN_DEVICES", ("cpu",))  # the forwards' steps kept (stand-in graphs)
    model, prompt = tiny_model("llama"), list(range(1, 11))
    ref, mine = KVState(model, prompt, capacity=10), KVState(model, prompt, capacity=10, graphs=True)
    torch.testing.assert_close(_prefill(mine, prompt), _prefill(ref, prompt), **TOL)
    assert not _forward_steps(mine), "10 rows > the widest bucket: the unpadded path"
    capacity = mine.cache.layers[0].capacity
    for step in range(capacity - len(prompt) + 2):  # past the capacity, one token at a time
        nxt = Rows.chain([1 + step % 50], mine.length)
        torch.testing.assert_close(mine.run(nxt).logits, ref.run(nxt).logits, **TOL)
    assert mine.grows >= 1 and _forward_steps(mine), "the buffer grew and the forwards were captured again"
    assert {key[-1] for key in _forward_steps(mine)} == {mine.padded._epoch}, "none over the old buffers is kept"


def _forward_steps(kv: KVState) -> list[tuple]:
    """The keys of a state's forwards captured at fixed shapes: ("forward", width, span, embeds, epoch)."""
    return [key[0] for key in kv.padded.graphs.steps]


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@pytest.mark.parametrize(
    "policy_name,params",
    [("linear", {"k": 4}), ("fixed_tree", {}), ("dynatree", {}), ("eagle2", {"total": 5, "topk": 2})],
)
def test_policies_stay_exact_on_the_padded_path(arch, policy_name, params):
    target, draft = tiny_model(arch), noisy_copy(arch, 0.01)
    config = DecodeConfig(max_new_tokens=30, forward=ForwardSettings(graphs=True))
    for prompt in ([1, 5, 7, 9, 11], [42, 17, 8, 8, 8, 8, 60, 2, 90, 33, 12, 4]):
        result = generate(target, prompt, make_method(policy_name, params), draft=draft, config=config)
        assert result.token_ids == hf_greedy(target, prompt, 30), f"{policy_name} diverged on the padded path"
        assert result.forward_path == "lean+padded"


def test_a_feature_draft_stays_exact_on_the_padded_path():
    target = tiny_model("llama")
    draft = FeatureDraft.from_target(target, seed=3)
    config = DecodeConfig(max_new_tokens=30, forward=ForwardSettings(graphs=True))
    result = generate(target, [1, 5, 7, 9, 11], make_method("dynatree", {}), draft=draft, config=config)
    assert result.token_ids == hf_greedy(target, [1, 5, 7, 9, 11], 30)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_on_cuda_are_exact_and_replayed():
    target = copy.deepcopy(tiny_model("llama")).to("cuda")  # the cached tiny models stay on the CPU
    draft = copy.deepcopy(noisy_copy("llama", 0.01)).to("cuda")
    prompt = [1, 5, 7, 9, 11]
    config = DecodeConfig(max_new_tokens=30)
    result = generate(target, prompt, make_method("fixed_tree", {}), draft=draft, config=config)
    eager = generate(
        target,
        prompt,
        make_method("fixed_tree", {}),
        draft=draft,
        config=DecodeConfig(max_new_tokens=30, forward=ForwardSettings(graphs=False)),
    )
    assert result.forward_path == "lean+graphs" and result.token_ids == eager.token_ids


def test_reduced_precision_reports_say_outputs_may_differ_at_near_ties():
    from dynatree_core.runs.metrics import exactness_note

    assert exactness_note("float32") is None and exactness_note("torch.float32") is None
    assert "near-ties" in exactness_note("bfloat16") and "float32 is token-identical" in exactness_note("float16")
    assert exactness_note("bfloat16", ["lean+invariant"]) is None, "width-invariant forwards are bitwise"
    assert exactness_note("bfloat16", ["lean+invariant+graphs"]) is None, "captured at fixed shapes too"
    assert exactness_note("bfloat16", ["hf", "lean+invariant"]) is None, "HF references are not tree runs"
    assert "near-ties" in exactness_note("bfloat16", ["lean+invariant", "lean"]), "one run not invariant"
    assert "near-ties" in exactness_note("bfloat16", "lean+invariant (not bitwise on this device: head: ...)")


@torch.inference_mode()
def test_a_buffer_grown_by_an_unpadded_forward_drops_the_buckets_built_over_the_old_one(monkeypatch):
    """A forward wider than every bucket takes the unpadded path, whose SlotLayer.update grows the
    buffers; the buckets (and on a GPU their graphs) built over the old buffers must not be used
    again (here: their masks have the old capacity; on a GPU: replays over freed memory)."""
    monkeypatch.setattr(graphs, "MAX_BUCKET", 4)
    monkeypatch.setattr(capture, "STAND_IN_DEVICES", ("cpu",))
    model, prompt = tiny_model("llama"), [3, 1, 4]
    ref, mine = KVState(model, prompt, capacity=3), KVState(model, prompt, capacity=3, graphs=True)
    torch.testing.assert_close(_prefill(mine, prompt), _prefill(ref, prompt), **TOL)
    assert _forward_steps(mine), "3 rows: a padded forward, captured"
    capacity = mine.cache.layers[0].capacity
    wide = [5 + i % 80 for i in range(capacity)]  # wider than the buffer's free slots and than every bucket
    rows = Rows.chain(wide, mine.length)
    torch.testing.assert_close(mine.run(rows).logits, ref.run(rows).logits, **TOL)
    assert mine.grows == 1, "the unpadded path grew the buffers"
    nxt = Rows.chain([7], mine.length)
    torch.testing.assert_close(mine.run(nxt).logits, ref.run(nxt).logits, **TOL)
    assert {key[-1] for key in _forward_steps(mine)} == {mine.padded._epoch}, "the old buffers' graphs are released"


def _widest(name: str) -> dict:
    """A policy's parameters at the widest trees its registry entry allows: sizes at their
    maximum, probability thresholds at 0."""
    out = {}
    for p in POLICIES[name].params:
        if p.type is int and p.max is not None:
            out[p.name] = int(p.max)
        elif p.type is float and p.min is not None and p.log_scale:
            out[p.name] = p.min
    return out


@pytest.mark.parametrize("policy_name", [n for n in POLICIES if n != "ar"])
def test_every_policy_at_its_widest_settings_is_exact_on_the_padded_path(policy_name):
    """Trees of up to 256 nodes (wider than the largest bucket): the unpadded path grows the cache
    between padded forwards, and the output still equals plain greedy decoding."""
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.01)
    prompt = [1, 5, 7, 9, 11]
    config = DecodeConfig(max_new_tokens=20, forward=ForwardSettings(graphs=True))
    result = generate(target, prompt, make_method(policy_name, _widest(policy_name)), draft=draft, config=config)
    assert result.token_ids == hf_greedy(target, prompt, 20), f"{policy_name} at its widest diverged"


def test_the_budget_256_tree_of_the_embedded_shape_is_exact_on_the_padded_path():
    """fixed_tree depth 16, branch 8, tau 0, budget 256: raised a size mismatch once the unpadded
    path had grown the cache under the padded forward's buckets."""
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.01)
    params = {"depth": 16, "branch": 8, "tau": 0.0, "budget": 256}
    config = DecodeConfig(max_new_tokens=40, forward=ForwardSettings(graphs=True))
    result = generate(target, [1, 5, 7, 9, 11], make_method("fixed_tree", params), draft=draft, config=config)
    assert result.token_ids == hf_greedy(target, [1, 5, 7, 9, 11], 40)


def _force_capture(monkeypatch, capture_by=None):
    """Forwards captured as on CUDA (stand-in graphs on the CPU), their captures by `capture_by`
    (self, fn, inputs, chained) where given."""
    monkeypatch.setattr(graphs, "capture_wanted", lambda device, model: True)
    if capture_by is not None:
        monkeypatch.setattr(capture.StepGraphs, "_capture", capture_by)


REAL_CAPTURE = capture.StepGraphs._capture


def test_a_failed_capture_warns_once_and_the_run_goes_on_eagerly(monkeypatch):
    def fail(self, fn, inputs, chained):
        if self.kind == "forward":
            raise RuntimeError("injected capture failure")
        return REAL_CAPTURE(self, fn, inputs, chained)

    _force_capture(monkeypatch, fail)
    capture._WARNED.clear()
    target, draft, prompt = tiny_model("llama"), noisy_copy("llama", 0.01), [1, 5, 7, 9, 11]
    config = DecodeConfig(max_new_tokens=20, forward=ForwardSettings(graphs=True))
    with pytest.warns(UserWarning, match="injected capture failure") as caught:
        result = generate(target, prompt, make_method("fixed_tree", {}), draft=draft, config=config)
    assert len([w for w in caught if "capture failed" in str(w.message)]) == 1, "one warning, not one per bucket"
    assert result.token_ids == hf_greedy(target, prompt, 20)
    assert result.forward_path == "lean+padded (graph capture failed: RuntimeError: injected capture failure)"


def test_capture_time_is_reported_apart_and_kept_out_of_forward_timings(monkeypatch):
    """Each (fake) capture moves the clock on by 1000 s: had any of it been counted in a forward,
    a phase or the cost model, the iteration timings would show it."""
    import time

    real, skipped = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skipped[0])

    def slow_capture(self, fn, inputs, chained):
        skipped[0] += 1000.0
        return REAL_CAPTURE(self, fn, inputs, chained)

    _force_capture(monkeypatch, slow_capture)
    target, draft, prompt = tiny_model("llama"), noisy_copy("llama", 0.01), [1, 5, 7, 9, 11]
    costs = []
    policy = make_method("fixed_tree", {})
    policy.observe_cost = lambda tokens, ms: costs.append(ms)
    config = DecodeConfig(max_new_tokens=20, forward=ForwardSettings(graphs=True))
    result = generate(target, prompt, policy, draft=draft, config=config)
    assert result.token_ids == hf_greedy(target, prompt, 20) and result.forward_path == "lean+graphs"
    captures = round(result.capture_s / 1000)
    assert captures >= 2 and abs(result.capture_s - 1000 * captures) < 60, "every capture's seconds are reported"
    timings = result.draft_ms + result.verify_ms + result.commit_ms + result.overhead_ms
    assert timings < 60_000 and max(costs) < 60_000, "capture time leaked into the iteration timings"
    assert sum(r.capture_ms for r in result.records) == pytest.approx(result.capture_s * 1000)


def test_graphs_of_all_runs_share_one_pool_per_device_and_a_released_pool_is_never_reused(monkeypatch):
    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    pools = capture._Pools()
    device = torch.device("cuda", 1)

    class Graph:
        pass

    a, b = Graph(), Graph()
    assert pools.acquire(device, a) == pools.acquire(device, b) == 0, "one pool per device, shared"
    del a
    assert pools.acquire(device, c := Graph()) == 0, "still in use by b"
    del b, c
    assert pools.acquire(device, Graph()) != 0, "every graph of the old pool is gone: a fresh pool"


def test_rope_types_with_data_dependent_updates_are_never_captured():
    model = copy.deepcopy(tiny_model("llama"))
    assert graphs.capture_safe(model)
    model.config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    assert not graphs.capture_safe(model)
    assert not graphs.capture_wanted(torch.device("cuda"), model)


@torch.inference_mode()
def test_compaction_uploads_its_indices_once_whatever_the_depth_of_the_model():
    from dynatree_core.core.transfer import counting

    for layers in (2, 6):
        model = copy.deepcopy(tiny_model("llama"))
        model.model.layers = torch.nn.ModuleList([copy.deepcopy(model.model.layers[0]) for _ in range(layers)])
        model.config.num_hidden_layers = layers
        kv = KVState(model, [3, 1, 4, 1, 5, 9])
        _prefill(kv, [3, 1, 4, 1, 5, 9])
        with counting() as moved:
            kv.keep([0, 1, 2, 4, 5])
        assert moved["to_device"] == 1, f"{layers} layers: {moved['to_device']} uploads for one compaction"


def test_an_iteration_reads_the_device_once_per_draft_forward_plus_once_for_verification():
    """Host round trips per iteration, counted through core/transfer.py (each is a sync on a GPU):
    one read per draft level (its top-k) on the host path, one for the target's choices; uploads:
    ids/positions and the mask per forward, one index upload per compaction; no timing sync (the
    phase boundaries are CUDA events, read after the verification's read: done by then)."""
    from dynatree_core.core.transfer import counting

    target, draft, prompt = tiny_model("llama"), noisy_copy("llama", 0.01), [1, 5, 7, 9, 11]
    for policy in ("fixed_tree", "dynatree", "dyspec_threshold", "eagle2", "salf"):
        with counting() as moved:
            result = generate(
                target,
                prompt,
                make_method(policy, {}),
                draft=draft,
                config=DecodeConfig(20, forward=ForwardSettings(device_draft=False)),
            )
        forwards = result.draft_forwards + result.iterations
        assert moved["to_host"] <= result.draft_forwards + result.iterations, f"{policy}: {dict(moved)}"
        assert moved["to_device"] <= 2 * forwards + 2 * result.iterations, f"{policy}: {dict(moved)}"
        assert moved["sync"] == 0, f"{policy}: {dict(moved)}"


def test_a_padded_forward_reads_a_span_of_the_buffer_not_all_of_it():
    assert [span_for(n, 1000) for n in (1, 256, 257, 600)] == [256, 256, 512, 1000]
    assert span_for(10, 100) == 100, "never past the capacity"


@torch.inference_mode()
def test_spans_shorter_than_the_buffer_give_the_unpadded_logits_and_greedy_tokens(monkeypatch):
    """A buffer of 900 slots: the forwards read 256 of them (then 512 as the context grows)."""
    monkeypatch.setattr(capture, "STAND_IN_DEVICES", ("cpu",))  # the forwards' steps kept (stand-in graphs)
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.01)
    prompt = [1 + i % 90 for i in range(240)]
    kv = KVState(target, prompt, capacity=900, graphs=True)
    plain = KVState(target, prompt, capacity=900, graphs=False)
    for state in (kv, plain):
        _prefill(state, prompt[:-1])
        state.pending = [prompt[-1]]
    tree = _branching_tree(prompt[-1])
    torch.testing.assert_close(_tree_forward(kv, tree, 239)[0], _tree_forward(plain, tree, 239)[0], **TOL)
    assert {key[2] for key in _forward_steps(kv)} == {256}, "the 240-slot context reads a 256-slot span"
    config = DecodeConfig(max_new_tokens=60, forward=ForwardSettings(graphs=True))
    result = generate(target, prompt, make_method("fixed_tree", {}), draft=draft, config=config)
    assert result.token_ids == hf_greedy(target, prompt, 60), "spans 256 then 512 keep greedy exact"


def test_each_bucket_runs_at_the_width_measured_fastest(monkeypatch):
    """With captures (stand-in graphs here) each bucket below 32 rows is timed against the wider
    ones: a width that replays slower is never used, and the output stays exact at any width."""
    _force_capture(monkeypatch)
    monkeypatch.setattr(graphs, "MEASURE_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(graphs, "_CHOSEN", weakref.WeakKeyDictionary())  # no earlier choice
    cost = {1: 1.0, 2: 3.0, 4: 3.0, 8: 5.0, 16: 4.0, 32: 2.0}  # 32 rows faster than 8 or 16 (the H200's GEMM tiles)
    monkeypatch.setattr(graphs.PaddedForward, "_replay_ms", lambda self, width: cost[width])
    target, draft, prompt = tiny_model("llama"), noisy_copy("llama", 0.01), [1, 5, 7, 9, 11]
    runs = []
    monkeypatch.setattr(graphs.PaddedForward, "__init__", _keeping(graphs.PaddedForward.__init__, runs))
    config = DecodeConfig(max_new_tokens=30, forward=ForwardSettings(graphs=True))
    result = generate(target, prompt, make_method("fixed_tree", {}), draft=draft, config=config)
    assert result.token_ids == hf_greedy(target, prompt, 30)
    target_padded = runs[0]
    assert target_padded.chosen.get(8) == 32 and target_padded.chosen.get(16, 32) == 32
    assert target_padded.chosen.get(1, 1) == 1, "one row is fastest as it is"
    assert 8 in target_padded.timings and set(target_padded.timings[8]) == {8, 16, 32}
    again = generate(target, prompt, make_method("fixed_tree", {}), draft=draft, config=config)
    assert again.token_ids == result.token_ids and not runs[-2].timings, "a later run reuses the measured widths"


def _keeping(init, into: list):
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        into.append(self)

    return wrapped
