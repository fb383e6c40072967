"""Width-invariant forwards (forward/invariant.py): a tree's path nodes get the bits `ar` computes.

The promise: with `invariant=True`, the target's logits for a node verified inside a tree equal,
bit for bit, the logits of the same sequence decoded one token at a time, in float32 and in
bfloat16, for every lean architecture; so greedy tree decoding in bfloat16 reproduces bfloat16
`ar` token for token for every policy. These tests hold on a device whose kernels pass
`width_verdict` (this CPU: oneDNN-packed float32 linears, bfloat16 linears); where a kernel does
not, the run must say so (the last tests).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import noisy_copy, tiny_model, tree_batch
from test_fastpath import POLICIES
from transformers import LlamaConfig, LlamaForCausalLM

from dynatree_core.core.packing import pack_linears, packing_enabled
from dynatree_core.core.settings import ForwardSettings
from dynatree_core.core.tree import DraftTree
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.forward import invariant
from dynatree_core.forward.fastpath import lean_forward_for
from dynatree_core.forward.invariant import RopeTable, RowGroups, invariant_wanted, sequence_attention, width_verdict
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows
from dynatree_core.forward.static_rows import StaticRows, static_sequence_attention
from dynatree_core.measure import gpu_check

DTYPES = (torch.float32, torch.bfloat16)
PROMPT = [5, 9, 13, 2, 7, 11, 3]


def _tiny_mistral() -> torch.nn.Module:
    """gpu-check's tiny mistral (no sliding window, one key/value head per two query heads)."""
    return gpu_check.tiny_pair("mistral", torch.device("cpu"))[0]


def _wide_llama() -> torch.nn.Module:
    """Llama with SmolLM2's head size (64) and 8 times the tiny width: wide enough that the shared
    kernels give a tree's rows other bits than a row alone in bfloat16 too."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _model(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    """The tiny model in `dtype`, packed as the model pairs pack a CPU target (pairs.load_pair)."""
    builders = {"mistral": _tiny_mistral, "llama-wide": _wide_llama}
    model = builders[arch]() if arch in builders else copy.deepcopy(tiny_model(arch))
    model = model.to(dtype)
    if dtype == torch.float32 and packing_enabled(torch.device("cpu"), dtype):
        pack_linears(model)
    return model


def _tree(root: int) -> tuple[DraftTree, list[int]]:
    """A tree whose path 0 -> a -> c -> e sits at scattered rows among siblings; returns the path."""
    tree = DraftTree.with_root(root)
    a, b = tree.add(0, 26, -0.1), tree.add(0, 53, -0.3)
    c = tree.add(a, 58, -0.2)
    tree.add(b, 95, -0.2)
    tree.add(a, 93, -0.9)
    e = tree.add(c, 40, -0.1)
    tree.add(b, 7, -0.5)
    tree.add(e, 3, -0.5)
    for i in range(8):  # more siblings: a verify forward of 17 rows
        tree.add(b, 60 + i, -1.0)
    return tree, [0, a, c, e]


def _prefill(kv: KVState) -> None:
    kv.run(Rows.chain(PROMPT, 0))
    kv.pending = []


def _skip_unless_bitwise(model: torch.nn.Module) -> None:
    """Skip (after checking that the run says so) where this CPU's kernels fail width_verdict."""
    kv = KVState(model, PROMPT, invariant=True)
    if kv.verdict.reason is not None:
        assert kv.path.startswith("lean+invariant (not bitwise on this device: "), kv.path
        pytest.skip(f"this CPU's kernels are not width-invariant ({kv.verdict.reason}); the run says so")


def _assert_path_bits_match_ar(model: torch.nn.Module, label: str) -> None:
    """Each node of a path inside a 17-row tree gets the logits `ar` computes for it alone."""
    _skip_unless_bitwise(model)
    tree, path = _tree(17)
    ar = KVState(model, PROMPT, invariant=True)
    _prefill(ar)
    alone = []
    for depth, node in enumerate(path):  # one token per forward, as `ar` decodes
        alone.append(ar.run(Rows.chain([tree.tokens[node]], len(PROMPT) + depth)).logits[0])
    kv = KVState(model, PROMPT, invariant=True)
    _prefill(kv)
    order = tree.order("bfs")
    logits = kv.run(tree_batch(tree, order, kv.length, [tree.tokens[0]], len(PROMPT))).logits
    for depth, node in enumerate(path):  # without invariance: differs at depth 0 already (llama-wide, both dtypes)
        row = logits[order.index(node)]
        assert torch.equal(row, alone[depth]), (
            f"{label}: depth {depth} differs from ar by {(row - alone[depth]).abs().max().item():.3g}"
        )
    assert kv.path == "lean+invariant"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ("llama", "qwen2", "mistral", "llama-wide"))
@torch.inference_mode()
def test_a_path_node_verified_in_a_tree_has_the_bits_ar_computes_alone(arch, dtype):
    _assert_path_bits_match_ar(_model(arch, dtype), f"{arch} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.inference_mode()
def test_dfs_order_and_a_pending_chain_keep_the_bits(dtype):
    """The same node, sent in DFS order behind a two-token chain, still gets ar's bits."""
    model = _model("llama", dtype)
    _skip_unless_bitwise(model)
    tree, path = _tree(17)
    ar = KVState(model, PROMPT[:-1], invariant=True)
    ar.run(Rows.chain(PROMPT[:-1], 0))
    ar.pending = []
    last = None
    for i, token in enumerate([PROMPT[-1], 17, *[tree.tokens[n] for n in path[1:]]]):
        last = ar.run(Rows.chain([token], len(PROMPT) - 1 + i)).logits[0]
    kv = KVState(model, PROMPT[:-1], invariant=True)
    kv.run(Rows.chain(PROMPT[:-1], 0))
    kv.pending = []
    order = tree.order("dfs")
    logits = kv.run(tree_batch(tree, order, kv.length, [PROMPT[-1], tree.tokens[0]], len(PROMPT))).logits
    assert torch.equal(logits[order.index(path[-1])], last)


@pytest.mark.parametrize("graphs", (None, True), ids=("grouped", "fixed-shapes"))
@pytest.mark.parametrize("policy_name,params", POLICIES)
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_every_policy_in_bfloat16_reproduces_bfloat16_ar(arch, policy_name, params, graphs):
    """Grouped by key count (the CPU's default) and at fixed shapes (StaticRows: the padded,
    capturable forward a GPU runs; on this CPU `graphs=True` runs it eagerly)."""
    target = _model(arch, torch.bfloat16)
    _skip_unless_bitwise(target)
    draft = copy.deepcopy(noisy_copy(arch, 0.01)).to(torch.bfloat16)
    config = DecodeConfig(
        max_new_tokens=30, forward=ForwardSettings(graphs=graphs)
    )  # bfloat16: width-invariant by default
    for prompt in ([1, 5, 7, 9, 11], [42, 17, 8, 8, 8, 8, 60, 2, 90, 33, 12, 4]):
        ar = generate(target, prompt, make_method("ar"), config=config)
        result = generate(target, prompt, make_method(policy_name, params), draft=draft, config=config)
        assert result.forward_path == ("lean+invariant+padded" if graphs else "lean+invariant")
        assert result.token_ids == ar.token_ids, f"{policy_name} in bfloat16 left bfloat16 ar's tokens"


def test_row_groups_hold_each_rows_slots_in_sequence_order():
    visible = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 1, 0, 0], [1, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    groups = RowGroups.of(visible, torch.device("cpu"), positions_end=9)
    got = {tuple(rows.tolist()): slots.tolist() for rows, slots in groups.groups}
    assert got == {(0, 1, 2): [[0, 1, 4], [0, 1, 2], [0, 3, 4]], (3,): [[0, 1, 2, 3, 4]]}
    assert groups.positions_end == 9


@pytest.mark.parametrize("form", ("grouped", "fixed-shapes"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sequence_attention_equals_masked_attention_up_to_rounding(dtype, form):
    """Both forms (rows grouped by key count; StaticRows over a span of 16) against masked attention."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 5, 8, generator=gen).to(dtype)
    keys, values = (torch.randn(1, 2, 12, 8, generator=gen).to(dtype) for _ in "kv")
    visible = torch.rand(5, 12, generator=gen) > 0.4
    visible[:, 0] = True
    if form == "grouped":
        out = sequence_attention(q, keys, values, RowGroups.of(visible, q.device), 0.3)
    else:
        out = static_sequence_attention(q, keys, values, StaticRows(*StaticRows.build(visible, 16)), 0.3)
    mask = torch.zeros(5, 12).masked_fill(~visible, float("-inf"))
    rep = lambda t: t.repeat_interleave(3, dim=1).float()  # noqa: E731  key head j serves query heads 3j..3j+2
    ref = torch.softmax(q.float() @ rep(keys).transpose(-1, -2) * 0.3 + mask, -1) @ rep(values)
    torch.testing.assert_close(out.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fixed_shape_attention_over_keys_and_values_side_by_side_is_bitwise_the_same(dtype):
    """The static cache keeps a layer's keys and values side by side (slots.SlotStore): one
    gather reads both. Bit for bit the two gathers of separate tensors, at widths 1 to 33."""
    gen = torch.Generator().manual_seed(2)
    store = torch.randn(3, 2, 1, 2, 64, 8, generator=gen).to(dtype)  # (layers, k/v, 1, kv_heads, slots, d)
    keys, values = store[1, 0, :, :, :40], store[1, 1, :, :, :40]
    for width in (1, 7, 16, 33):
        q = torch.randn(1, 6, width, 8, generator=gen).to(dtype)
        visible = torch.rand(width, 40, generator=gen) > 0.5
        visible[:, 0] = True
        rows = StaticRows(*StaticRows.build(visible, 32))
        joint = static_sequence_attention(q, keys, values, rows, 0.3)
        apart = static_sequence_attention(q, keys.clone(), values.clone(), rows, 0.3)
        assert torch.equal(joint, apart), width


def test_rope_table_gives_the_rotary_values_whatever_its_length():
    model = _model("llama", torch.float32)
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1, 32)
    short, grown = RopeTable(rotary), RopeTable(rotary)
    grown(x, torch.tensor([[0]]), 9000)  # three chunks
    positions = torch.tensor([[0, 5, 4095, 4096, 700]])
    for table in (short, grown):
        cos, sin = table(x, positions, 4097)
        ref_cos, ref_sin = rotary(x.expand(1, 5, 32), positions)
        torch.testing.assert_close((cos, sin), (ref_cos, ref_sin))
    assert torch.equal(short(x, positions, 4097)[0], grown(x, positions, 4097)[0])


def test_invariance_is_on_by_default_for_reduced_precision_only(monkeypatch):
    monkeypatch.delenv("DYNATREE_INVARIANT", raising=False)
    assert invariant_wanted(_model("llama", torch.bfloat16))
    assert not invariant_wanted(_model("llama", torch.float32))
    assert invariant_wanted(_model("llama", torch.float32), True)
    monkeypatch.setenv("DYNATREE_INVARIANT", "1")
    assert invariant_wanted(_model("llama", torch.float32))
    assert not invariant_wanted(_model("llama", torch.bfloat16), False)


def _with_head(model, shaky) -> tuple:
    """The model's lean forward with its head replaced by shaky(head); returns (lean, head)."""
    lean = lean_forward_for(model)
    head = lean.head
    lean.head = shaky(head)
    lean.__dict__.pop("_width_verdicts", None)
    return lean, head


@torch.inference_mode()
def test_a_kernel_whose_row_reads_the_other_rows_is_named_and_the_run_says_so():
    model = _model("llama", torch.bfloat16)
    lean, head = _with_head(model, lambda head: lambda x: head(x) + x.float().sum() * 1e-3)
    try:
        verdict = width_verdict(lean, torch.bfloat16, torch.device("cpu")).reason
        calls = f"in calls of {invariant.LINEAR_CALL_ROWS} rows or not"
        assert verdict == f"head: a row's bits change with the row count, padded or not, {calls}"
        kv = KVState(model, PROMPT, invariant=True)
        assert kv.path.startswith("lean+invariant (not bitwise on this device: head")
    finally:
        lean.head = head
        lean.__dict__.pop("_width_verdicts", None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.inference_mode()
def test_a_kernel_that_changes_with_every_row_count_runs_every_call_at_one_shape(dtype):
    """A head whose bits change with every row count, padded or not (cuBLAS's float32 GEMM at
    SmolLM2's o projection on the H200): every linear call runs exactly LINEAR_CALL_ROWS rows,
    wider inputs in chunks, and a path node inside a 17-row tree gets `ar`'s bits again."""
    model = _model("llama-wide", dtype)
    lean, head = _with_head(model, lambda head: lambda x: head(x) + len(x) * 1e-2)
    try:
        verdict = width_verdict(lean, dtype, torch.device("cpu"))
        calls = -invariant.LINEAR_CALL_ROWS  # the head alone: the block's linears run as they come
        assert verdict.reason is None and verdict.linear_rows == invariant.LinearRows(head=calls), verdict
        assert invariant.linears_note(verdict.linear_rows) == f"head in calls of {invariant.LINEAR_CALL_ROWS} rows"
        _assert_path_bits_match_ar(model, f"linears in calls of one shape, {dtype}")
        long = [(7 * i) % 90 + 1 for i in range(300)]  # at fixed shapes too, a prefill past every bucket
        assert gpu_check.path_bits_match(model, [*PROMPT, 17], graphs=True)
        assert gpu_check.path_bits_match(model, long, graphs=True)
    finally:
        lean.head = head
        lean.__dict__.pop("_width_verdicts", None)


def test_linears_in_calls_of_one_shape_give_the_plain_result():
    """min_rows(-R): chunks of R rows, the last padded, joined back: the same values as one call."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    seen = []
    fn = lambda x: seen.append(x.shape[-2]) or x @ w.T  # noqa: E731
    for n in (1, 3, 4, 9):
        x = torch.randn(1, n, 5, generator=gen, dtype=torch.float64)
        seen.clear()
        assert torch.allclose(invariant.min_rows(fn, x, -4), x @ w.T)
        assert seen == [4] * -(-n // 4), (n, seen)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.inference_mode()
def test_a_one_row_kernel_of_its_own_is_padded_away(dtype):
    """A head whose one-row call takes another kernel (a GEMV beside the GEMM: cuBLAS float32,
    MKL float32 below 12 rows): every linear gets at least 2 rows and the path's bits match again."""
    model = _model("llama-wide", dtype)
    lean, head = _with_head(model, lambda head: lambda x: head(x) + (len(x) == 1) * 1e-2)
    try:
        verdict = width_verdict(lean, dtype, torch.device("cpu"))
        assert verdict.reason is None and verdict.linear_rows == invariant.LinearRows(head=2), verdict
        assert invariant.linears_note(verdict.linear_rows) == "head padded to 2 rows"
        _assert_path_bits_match_ar(model, f"padded head, {dtype}")
    finally:
        lean.head = head
        lean.__dict__.pop("_width_verdicts", None)


def test_a_one_row_kernel_that_differs_only_for_some_rows_is_found():
    """A one-row kernel whose rounding departs from the GEMM's only for some rows' values (oneDNN's
    bfloat16 GEMV on a Zen host: the down projection, 3 of 65 random rows): the probe calls every
    row alone, not only the first, and pads to 2 rows."""
    x = torch.zeros(65, 4)
    x[37, 0] = 3.0  # the only row the one-row form rounds differently

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t * 2 + (t.shape[-2] == 1) * (t[..., :1] > 2) * 1e-2

    assert invariant._fewest_rows(fn, x) == 2


@torch.inference_mode()
def test_the_gpus_residual_gemm_is_probed_as_the_forward_takes_it(gpu_forms):
    """On a GPU the o projection adds the residual inside its GEMM (fastpath._residual): the probe
    runs that form. One whose row reads the other rows puts the linears in calls of one shape and
    one whose one-row call differs pads them; either way the forward then takes the separate add,
    and the bits match again."""
    model = _model("llama-wide", torch.bfloat16)
    lean = lean_forward_for(model)
    block = lean.blocks[0]
    fused = block.add_o
    assert fused is not None
    for shaky, reason, rows in (
        (lambda x, a: fused(x, a) + a.float().sum() * 1e-3, None, invariant.LinearRows(o=-invariant.LINEAR_CALL_ROWS)),
        (lambda x, a: fused(x, a) + (len(a) == 1) * 1e-2, None, invariant.LinearRows(o=2)),
    ):
        block.add_o = shaky
        lean.__dict__.pop("_width_verdicts", None)
        try:
            verdict = width_verdict(lean, torch.bfloat16, torch.device("cpu"))
            assert (verdict.reason, verdict.linear_rows) == (reason, rows), verdict
            if reason is None:
                _assert_path_bits_match_ar(model, "a one-row residual GEMM of its own, padded")
        finally:
            block.add_o = fused
            lean.__dict__.pop("_width_verdicts", None)


@torch.inference_mode()
def test_unpacked_float32_linears_are_padded_to_the_rows_from_which_they_agree():
    """float32 F.linear on this CPU (MKL, no oneDNN packing) gives a row other bits at 1-3, 5-7 and
    9-11 rows than at 12 and more: the probe pads every linear to 16 rows and stays bitwise."""
    model = copy.deepcopy(tiny_model("llama")).float()
    _skip_unless_bitwise(model)
    rows = KVState(model, PROMPT, invariant=True).verdict.linear_rows
    assert rows != invariant.LinearRows(), "padded, not invariant as it is"


def test_architectures_without_the_lean_forward_are_not_claimed_invariant():
    model = copy.deepcopy(tiny_model("gpt2")).to(torch.bfloat16)
    kv = KVState(model, PROMPT, invariant=True)
    assert not kv.invariant and kv.path.endswith("(not width-invariant: needs the lean forward)")
    result = generate(
        model,
        PROMPT,
        make_method("ar"),
        config=DecodeConfig(max_new_tokens=3, forward=ForwardSettings(width_invariant=True)),
    )
    assert "not width-invariant" in result.forward_path


def _bmm_split_when_batch_is_small(monkeypatch, real=torch.bmm):
    """torch.bmm as a batched GEMM that splits a long reduction by the batch count: over more than
    500 keys a call's bits change with its number of items (what a GPU library may do; a probe at
    96 keys would not see it)."""

    def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = real(a, b)
        if a.shape[-1] > 500:
            out = out + (out.abs() + 1e-3) * 2**-12 / a.shape[0]
        return out

    monkeypatch.setattr(torch, "bmm", bmm)


def test_row_groups_in_calls_of_fixed_size_repeat_the_last_row_and_drop_it():
    visible = torch.ones(5, 4, dtype=torch.bool)
    visible[3:, 3] = False  # rows 0-2: 4 keys, rows 3-4: 3 keys
    groups = RowGroups.of(visible, torch.device("cpu"), attention_rows=2)
    got = [(rows.tolist(), slots.shape[1]) for rows, slots in groups.groups]
    assert got == [([3, 4], 3), ([0, 1], 4), ([2, 2], 4)] and groups.real == (2, 2, 1)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 5, 8, generator=gen)
    keys, values = (torch.randn(1, 2, 4, 8, generator=gen) for _ in "kv")
    plain = sequence_attention(q, keys, values, RowGroups.of(visible, q.device), 0.3)
    assert torch.equal(sequence_attention(q, keys, values, groups, 0.3), plain)


@torch.inference_mode()
def test_attention_whose_kernel_changes_with_the_batch_at_long_contexts_runs_calls_of_fixed_size(monkeypatch):
    """The probe sees a kernel that changes with the batch count only over long key spans (not at
    96 keys), and the forward then runs every attention call at ATTENTION_ROWS rows: a path node
    inside a tree gets ar's bits again, 600 tokens into the context."""

    _bmm_split_when_batch_is_small(monkeypatch)
    model = _model("llama-wide", torch.bfloat16)
    lean = lean_forward_for(model)
    lean.__dict__.pop("_width_verdicts", None)
    try:
        verdict = width_verdict(lean, torch.bfloat16, torch.device("cpu"))
        assert verdict.reason is None and verdict.attention_rows == invariant.ATTENTION_ROWS, verdict
        prompt = [(7 * i) % 120 + 1 for i in range(600)]
        assert KVState(model, prompt, invariant=True).verdict.attention_rows == invariant.ATTENTION_ROWS
        assert gpu_check.path_bits_match(model, prompt), "a path node 600 tokens in has ar's bits"
        # without the fixed-size calls the same kernel changes a path node's bits (the test can fail)
        monkeypatch.setattr(invariant, "ATTENTION_ROWS", 1)
        lean.__dict__.pop("_width_verdicts", None)
        assert width_verdict(lean, torch.bfloat16, torch.device("cpu")).reason.startswith("attention:")
    finally:
        lean.__dict__.pop("_width_verdicts", None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ("llama", "qwen2", "mistral", "llama-wide"))
@torch.inference_mode()
def test_at_fixed_shapes_a_path_node_has_the_bits_ar_computes_alone(arch, dtype):
    """StaticRows: every row over the run's span in calls of 16 rows, through the padded forward
    (width buckets), and a prefill wider than every bucket runs the same rows eagerly."""
    model = _model(arch, dtype)
    _skip_unless_bitwise(model)
    assert KVState(model, PROMPT, invariant=True, graphs=True).path == "lean+invariant+padded"
    assert gpu_check.path_bits_match(model, [*PROMPT, 17], graphs=True)
    long = [(7 * i) % 90 + 1 for i in range(300)]  # 299 prefill rows: wider than graphs.MAX_BUCKET
    assert gpu_check.path_bits_match(model, long, graphs=True)


def test_a_run_at_fixed_shapes_skips_the_probe_of_the_attention_it_does_not_run():
    model = _model("llama", torch.bfloat16)
    lean = lean_forward_for(model)
    lean.__dict__.pop("_width_verdicts", None)
    KVState(model, PROMPT, invariant=True, graphs=True)
    assert [key[2] for key in lean._width_verdicts] == [False], "StaticRows attention: the grouped probe is not run"
    KVState(model, PROMPT, invariant=True, graphs=False)
    assert sorted(key[2] for key in lean._width_verdicts) == [False, True]


@torch.inference_mode()
def test_where_forwards_replay_graphs_the_probe_replays_its_calls_too(monkeypatch):
    """A library may pick other kernels under stream capture than eagerly: where the run's
    forwards are captured, the probe's calls go through capture.replayed. Here a stand-in for a
    captured one-row GEMM of its own (the eager calls agree): only the captured verdict pads."""
    from dynatree_core.forward import capture, choice

    def replayed(fn, device):
        return lambda x: fn(x) + (x.shape[-2] == 1) * 1e-2 if x.dim() == 2 and x.shape[-1] > 8 else fn(x)

    monkeypatch.setattr(capture, "replayed", replayed)
    model = _model("llama-wide", torch.bfloat16)
    lean = lean_forward_for(model)
    lean.__dict__.pop("_width_verdicts", None)
    lean.__dict__.pop("_static_verdicts", None)
    cpu = torch.device("cpu")
    assert width_verdict(lean, torch.bfloat16, cpu, attention=False).linear_rows == invariant.LinearRows()
    padded = width_verdict(lean, torch.bfloat16, cpu, attention=False, captured=True).linear_rows
    assert padded == invariant.LinearRows.every(2), padded
    monkeypatch.setattr(choice.cuda_graphs, "capture_wanted", lambda device, model: True)
    picked = choice.choose_forward(model, graphs=True, invariant=True)
    assert picked.capture and picked.verdict.linear_rows == invariant.LinearRows.every(2), picked
    assert (torch.bfloat16, "cpu", True) in lean._static_verdicts
    lean.__dict__.pop("_width_verdicts", None)
    lean.__dict__.pop("_static_verdicts", None)


def test_static_rows_hold_each_rows_slots_in_sequence_order_then_masked_padding():
    visible = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 1, 1, 1]], dtype=torch.bool)
    slots, tail = StaticRows.build(visible, 8)
    assert slots.shape == (invariant.ATTENTION_ROWS, 8) and tail.shape == slots.shape
    assert slots[0, :3].tolist() == [0, 1, 4] and slots[1, :4].tolist() == [0, 2, 3, 4]
    assert tail[0].tolist() == [0.0] * 3 + [float("-inf")] * 5 and tail[1, :4].eq(0).all() and tail[1, 4:].isinf().all()
    assert tail[2:, 0].eq(0).all() and tail[2:, 1:].isinf().all(), "padding rows see slot 0 only"
    with pytest.raises(ValueError, match="more than the span"):
        StaticRows.build(visible, 3)


@pytest.mark.parametrize("q,length,span", [(1, 40, 64), (5, 300, 256), (17, 100, 128), (33, 256, 256)])
def test_static_rows_built_without_a_sort_list_every_rows_visible_slots_in_order(q, length, span):
    """StaticRows.build places each visible slot by a cumulative count (capturable, no host read
    without `check`): each row's slots are its visible slots ascending, whatever the row's count
    (none, some, exactly the span), with a cache wider than the span or narrower."""
    gen = torch.Generator().manual_seed(q * length)
    visible = torch.rand(q, length, generator=gen) < torch.rand(q, 1, generator=gen)
    visible[0] = False
    for i in range(1, q):
        while int(visible[i].sum()) > span:  # rows over the span are refused (checked apart)
            visible[i, visible[i].nonzero()[0]] = False
    if q > 2 and length >= span:
        visible[2] = False
        visible[2, :span] = True  # a row that sees exactly the span
    slots, tail = StaticRows.build(visible, span, check=False)
    assert slots.is_contiguous() and slots.shape[0] % invariant.ATTENTION_ROWS == 0
    for i in range(q):
        seen = visible[i].nonzero().flatten().tolist()
        assert slots[i, : len(seen)].tolist() == seen
        assert tail[i, : len(seen)].eq(0).all() and tail[i, len(seen) :].isinf().all()


def test_captured_width_invariant_forwards_replay_and_stay_exact(monkeypatch):
    """With captures (stand-in graphs on this CPU) the width-invariant forward is captured per
    bucket; where the fixed-shape attention is not invariant on a device, rows are grouped eagerly."""
    from test_graphs import _force_capture

    from dynatree_core.forward import choice

    _force_capture(monkeypatch)
    target = _model("llama", torch.bfloat16)
    _skip_unless_bitwise(target)
    draft = copy.deepcopy(noisy_copy("llama", 0.01)).to(torch.bfloat16)
    config = DecodeConfig(max_new_tokens=30, forward=ForwardSettings(graphs=True))
    ar = generate(target, PROMPT, make_method("ar"), config=config)
    tree = generate(target, PROMPT, make_method("fixed_tree"), draft=draft, config=config)
    assert ar.forward_path == tree.forward_path == "lean+invariant+graphs"
    assert tree.token_ids == ar.token_ids and tree.tokens_per_iteration > 1
    monkeypatch.setattr(choice, "static_attention_agrees", lambda *a, **k: False)
    assert KVState(target, PROMPT, invariant=True, graphs=True).path == "lean+invariant"


def test_the_span_holds_a_whole_run_whose_trees_fill_slots_past_it():
    """A run of capacity 256 (prompt 200 + 56 new tokens): near its end a tree's rows fill slots
    past 256 while no row sees more than 256 keys, so the span stays 256 (a change would give its
    last positions other bits than `ar`'s) and the tokens stay `ar`'s."""
    from dynatree_core.decoding.engine import iterate, start_run

    target = _model("llama", torch.bfloat16)
    _skip_unless_bitwise(target)
    draft = copy.deepcopy(noisy_copy("llama", 0.01)).to(torch.bfloat16)
    prompt = [(5 * i) % 90 + 1 for i in range(200)]
    config = DecodeConfig(max_new_tokens=56, forward=ForwardSettings(graphs=True))
    ar = generate(target, prompt, make_method("ar"), config=config)
    state = start_run(
        target, prompt, make_method("fixed_tree", {"depth": 4, "branch": 3, "tau": 0.0}), draft=draft, config=config
    )
    tokens = [t for record in iterate(state) for t in record.committed]
    assert tokens == ar.token_ids
    assert state.target_kv.padded.static.positions_end == 256
    assert state.target_kv.peak_bytes > 0 and state.target_kv.cache.layers[0].capacity > 256, (
        "slots past the span were filled"
    )


@pytest.mark.parametrize("arch", ("llama", "qwen2", "llama-wide"))
@torch.inference_mode()
def test_the_gpus_forms_keep_a_path_nodes_bits_those_ar_computes_alone(arch, gpu_forms):
    """bfloat16 with the forms a GPU's lean forward takes (one fused RMSNorm kernel, fused
    projections): still bit for bit, grouped and at fixed shapes."""
    model = _model(arch, torch.bfloat16)
    assert lean_forward_for(model).blocks[0].qkv is not None
    _assert_path_bits_match_ar(model, f"{arch} bfloat16, the GPU's forms")
    assert gpu_check.path_bits_match(model, [*PROMPT, 17], graphs=True)
