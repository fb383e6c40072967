"""Draft levels decided on the device (drafting/device.py): the tree a policy reads back once is,
node for node (tokens, parents, log-probs, statuses, reasons), the tree its host path builds
from the same draft distributions; runs stay exact, and an iteration reads the device at most
twice (the tree, the target's choices) and never syncs for its timings."""

from __future__ import annotations

import copy
import dataclasses
import hashlib

import pytest
import reference_drafting as reference
import torch
from conftest import ARCHS, ancestor_mask, examples, hf_greedy, noisy_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from test_feature_draft import feature_draft

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.core.transfer import counting
from dynatree_core.decoding.engine import DecodeConfig, decode, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting import DraftRequest, make_policy
from dynatree_core.drafting.policy import JOIN_PARAMS
from dynatree_core.forward.capture import StepGraphs
from dynatree_core.forward.rows import closure

DEVICE_POLICIES = [  # every policy with a device path, at its defaults and at shapes that bind
    ("fixed_tree", {}),
    ("fixed_tree", {"budget": 5, "tau": 0.0, "branch": 4}),
    ("fixed_tree", {"tau": 0.001, "depth": 4}),
    ("linear", {}),
    ("eagle2", {}),
    ("eagle2", {"depth": 5, "topk": 2, "total": 6}),
    ("delayed", {}),
    ("delayed", {"l1": 0}),
    ("dynatree", {}),
    ("dynatree", {"budget": 6, "d0": 2, "rho_deep": 0.5, "tau_h": 0.5, "tau_l": 0.2}),
    ("dynatree", {"adaptive_branch": False, "dynamic_depth": False, "d0": 4, "tau": 0.0}),
    ("delayed_auto", {}),
    ("dyspec_threshold", {}),
    ("dyspec_threshold", {"threshold": 0.005, "budget": 7, "max_children": 3}),
]


def signature(tree) -> tuple:
    return tree.tokens, tree.parents, tree.logp, [str(s) for s in tree.status], [str(r) for r in tree.reason]


def runs(target, draft, prompt, policy, params, n=24, switch="device_draft", **forward):
    """The records of two runs of the same request, `switch` off then on: by default the host path
    and the device path (`forward`: the other ForwardSettings)."""
    return [
        list(
            decode(
                target,
                prompt,
                make_method(policy, params),
                draft=draft,
                config=DecodeConfig(n, forward=ForwardSettings(**forward, **{switch: on})),
            )
        )
        for on in (False, True)
    ]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy,params", DEVICE_POLICIES)
def test_device_levels_build_the_host_paths_trees_and_stay_exact(arch, policy, params):
    target, prompt = tiny_model(arch), [1, 5, 7, 9, 11]
    for draft in (noisy_copy(arch, 0.3), feature_draft(arch)):
        host, device = runs(target, draft, prompt, policy, params)
        assert [t for r in device for t in r.committed] == hf_greedy(target, prompt, 24)
        if policy == "delayed_auto":  # its shape follows measured times, so trees differ run to run:
            continue  # the next test fixes the shape
        assert [r.committed for r in host] == [r.committed for r in device]
        for i, (a, b) in enumerate(zip(host, device, strict=True)):
            assert signature(a.tree) == signature(b.tree), f"{policy} {params}: iteration {i + 1}'s tree differs"


@pytest.mark.parametrize("shape", [(2, 1, 2), (3, 0, 2), (1, 3, 0)])
def test_delayed_autos_tree_grown_on_the_device_from_its_root_is_the_host_paths(shape, monkeypatch):
    """delayed_auto chooses (K, L1, L2) from its root's distribution and measured times; with the
    choice fixed, the tree grown on the device after that root is the host path's."""
    from dynatree_core.drafting.delayed import DelayedAuto

    monkeypatch.setattr(DelayedAuto, "choose", lambda self, probs, max_depth: shape)
    target, prompt = tiny_model("llama"), [1, 5, 7, 9, 11]
    for draft in (noisy_copy("llama", 0.3), feature_draft("llama")):
        host, device = runs(target, draft, prompt, "delayed_auto", {})
        assert [t for r in device for t in r.committed] == hf_greedy(target, prompt, 24)
        assert [(signature(r.tree), r.tree.notes) for r in host] == [(signature(r.tree), r.tree.notes) for r in device]


@pytest.mark.parametrize("policy,params", [DEVICE_POLICIES[0], DEVICE_POLICIES[4]])
def test_device_levels_through_the_padded_forward_a_gpu_captures(policy, params):
    """ids and positions handed over as device tensors fill the padded forward's static buffers."""
    target, prompt = tiny_model("llama"), [1, 5, 7, 9, 11]
    for draft in (noisy_copy("llama", 0.3), feature_draft("llama")):
        host, device = runs(target, draft, prompt, policy, params, graphs=True)
        assert [t for r in device for t in r.committed] == hf_greedy(target, prompt, 24)
        assert [signature(r.tree) for r in host] == [signature(r.tree) for r in device]
        assert device[-1].forward_path.startswith("lean+padded")


@pytest.mark.parametrize(
    "paths", [{"static_cache": False}, {"fast_forward": False}], ids=("dynamic-cache", "hf-forward")
)
def test_device_levels_through_the_reference_forwards(paths):
    """Device ids and masks through transformers' own forward, over the static and dynamic caches."""
    for arch in ("llama", "gpt2"):
        target, prompt = tiny_model(arch), [1, 5, 7, 9, 11]
        for draft in (noisy_copy(arch, 0.3), feature_draft(arch)):
            host, device = runs(target, draft, prompt, "dynatree", {}, **paths)
            assert [t for r in device for t in r.committed] == hf_greedy(target, prompt, 24)
            assert [signature(r.tree) for r in host] == [signature(r.tree) for r in device]


@torch.inference_mode()
@pytest.mark.parametrize("graphs", [False, True], ids=("row-groups", "static-rows"))
def test_device_levels_are_exact_in_bfloat16_with_a_width_invariant_target(graphs):
    """bfloat16 trees = bfloat16 `ar`, token for token. At fixed shapes (StaticRows, what a GPU
    captures) the verify forward is queued from the device's rows, its span sized by the bound
    the engine passes (`most_keys`), and every record equals the host-built batch's."""
    target = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    draft = copy.deepcopy(noisy_copy("llama", 0.05)).to(torch.bfloat16)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    config = DecodeConfig(32, forward=ForwardSettings(width_invariant=True, graphs=graphs))
    ar = generate(target, prompt, make_method("ar", {}), config=config).token_ids
    for policy, params in DEVICE_POLICIES[::2]:
        results = [
            generate(
                target,
                prompt,
                make_method(policy, params),
                draft=draft,
                config=dataclasses.replace(
                    config, forward=dataclasses.replace(config.forward, device_draft=True, device_verify=v)
                ),
            )
            for v in (True, False)
        ]
        assert [r.token_ids for r in results] == [ar, ar], f"{policy} {params}"
        if graphs and policy != "delayed_auto":
            assert [verified(r) for r in results[0].records] == [verified(r) for r in results[1].records]
            assert results[0].records[-1].forward_path.startswith("lean+invariant+padded")


def verified(record) -> tuple:
    """What an iteration sent to the target and what came back."""
    return (record.order, record.mask, record.position_ids, record.prefix_len, record.chain_len,
            record.target_tokens, record.accepted, record.bonus_token, record.committed)  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("graphs", [False, True])
def test_the_verify_forward_queued_from_the_devices_rows_is_the_host_batchs(arch, graphs):
    """The verify forward built on the device from the levels (rows padded to a bound the host
    knows without reading) sends the same nodes with the same masks and positions, and the target makes
    the same choices there, as the batch the host builds from the tree: every iteration's record
    is equal, for a token draft and a feature draft (its features read from those rows)."""
    target, prompt = tiny_model(arch), [1, 5, 7, 9, 11]
    for draft in (noisy_copy(arch, 0.3), feature_draft(arch)):
        for policy, params in DEVICE_POLICIES[::3] + [("delayed", {})]:
            host, late = runs(
                target, draft, prompt, policy, params, switch="device_verify", graphs=graphs, device_draft=True
            )
            assert [t for r in late for t in r.committed] == hf_greedy(target, prompt, 24), f"{policy} {params}"
            if policy != "delayed_auto":  # its shape follows measured times
                assert [verified(r) for r in late] == [verified(r) for r in host], f"{policy} {params}"
                # the host sends the chain and the nodes; the device's rows are padded, never fewer
                assert all(h.verify_rows == h.chain_len + len(h.order) - 1 for h in host)
                assert all(a.verify_rows >= b.verify_rows for a, b in zip(late, host, strict=True))


@pytest.mark.parametrize("device_verify", [True, False])
def test_an_iteration_drains_the_device_once_when_its_tree_is_verified_from_there(device_verify):
    """With the verify forward queued from the device's rows (decoding/batch.py), the target's
    choices are the iteration's one draining read: the tree is copied behind the draft and read
    while the target runs (a late read); delayed_auto also reads its root's distribution. Without
    it (device_verify off): the tree, then the target's choices. A level's "did it admit anything"
    is read late, once per level after the first; the timing marks are read after the draining
    read, so never a sync."""
    target, prompt = tiny_model("llama"), [1, 5, 7, 9, 11]
    for draft in (noisy_copy("llama", 0.01), feature_draft("llama")):
        for policy, params in DEVICE_POLICIES:
            config = DecodeConfig(20, forward=ForwardSettings(device_draft=True, device_verify=device_verify))
            with counting() as moved:
                result = generate(target, prompt, make_method(policy, params), draft=draft, config=config)
            early = device_verify
            reads = (1 if early else 2) + (policy == "delayed_auto")
            assert moved["to_host"] <= reads * result.iterations, f"{policy} {params}: {dict(moved)}"
            assert moved["sync"] == 0, f"{policy} {params}: {dict(moved)}"
            after_first = sum(max(r.draft_forwards - 1, 0) for r in result.records)
            tree_reads = sum(r.draft_forwards > 0 for r in result.records) if early else 0
            assert moved["late"] <= after_first + tree_reads, f"{policy} {params}: {dict(moved)}"
            if early:  # every drafting iteration read its tree late, none drained for it
                assert moved["to_host"] <= result.iterations + (policy == "delayed_auto") * tree_reads
    with counting() as moved:  # salf decides its levels on the host (a heap over every level so far)
        result = generate(
            target,
            prompt,
            make_method("salf", {}),
            draft=draft,
            config=DecodeConfig(20, forward=ForwardSettings(device_draft=True)),
        )
    assert moved["to_host"] <= result.draft_forwards + result.iterations and moved["sync"] == 0


# ----- the levels' decisions against the host's, on made-up draft distributions ------------------
class PathDrafter:
    """A stand-in drafter whose distribution at a node is a function of the node's token path
    only, so the host path (`expand`) and the device path (`expand_level`) see the same rows.
    Values are coarse (many exact ties) and some are -inf (tokens the draft cannot propose)."""

    vocab = 12

    def __init__(self, seed: int, steps: StepGraphs | None = None):
        self.seed = seed
        self.steps = steps if steps is not None else StepGraphs(torch.device("cpu"), capture=False)
        self.slots: dict[int, int] = {}
        self.paths: list[tuple] = []
        self.level_paths: list[tuple] = []
        self.ran: list[list[tuple]] = []  # each forward's rows' paths

    def row(self, path: tuple) -> torch.Tensor:
        digest = hashlib.sha256(repr((self.seed, path)).encode()).digest()
        values = torch.tensor([b % 8 for b in digest[: self.vocab]], dtype=torch.float32) * 0.75
        values[torch.tensor([b % 5 == 0 for b in digest[self.vocab : 2 * self.vocab]])] = -torch.inf
        return torch.log_softmax(values, -1)

    def expand(self, tree, nodes):
        self.ran.append([tuple(tree.tokens[a] for a in tree.path(n)[1:]) for n in nodes])
        return torch.stack([self.row(path) for path in self.ran[-1]])

    def to_logp(self, logits):
        return logits  # its rows are log-probabilities already

    def level_top(self, logits, k):
        return logits.topk(min(k, logits.shape[-1]), dim=-1)

    def expand_level(self, tokens, parents, depth, *, then=None):
        if tokens is None:
            self.level_paths = self.row_paths = [()]
        else:
            self.level_paths = [
                self.level_paths[p] + (t,) for t, p in zip(tokens.tolist(), parents.tolist(), strict=True)
            ]
        self.ran.append(self.level_paths)
        logits = torch.stack([self.row(p) for p in self.level_paths])
        return logits if then is None else then[1](logits, *then[2])  # the level's decision after its forward

    def expand_rows(self, tokens, parents, depths):
        """A best-first search's batch (Drafter.expand_rows): parents name rows over every forward."""
        paths = [self.row_paths[p] + (t,) for t, p in zip(tokens.tolist(), parents.tolist(), strict=True)]
        assert [len(path) for path in paths] == depths.tolist()
        self.row_paths = self.row_paths + paths
        self.ran.append(paths)
        return torch.stack([self.row(p) for p in paths])

    def bind(self, node, level, row):
        self.slots[node] = (level, row)


class RowsProbe:
    """Stands in for the engine's EarlyVerify (decoding/batch.py): keeps the verify rows built on
    the device, and the order the tree's view names their nodes in."""

    def __init__(self):
        self.rows, self.order = None, []

    def launch(self, rows, *, depth):
        self.rows, self.depth = rows, depth


def drafted(policy: str, values: dict, max_depth: int, seed: int, on_device: bool):
    """The policy's tree; on the device, also checked against the verify rows built there."""
    probe = RowsProbe() if on_device else None
    tree = make_policy(policy, values).draft(
        DraftRequest(root_token=7, max_depth=max_depth, drafter=PathDrafter(seed), on_device=on_device, early=probe)
    )
    if probe is not None:
        check_rows(tree, probe)
    return tree


def decided(policy: str, values: dict, max_depth: int, seed: int) -> list:
    """The policy's tree as tensor levels both ways (counts read at once, then at fixed widths read
    late) and as the paper's loop decides it node by node (reference_drafting), on one drafter's rows."""
    trees = [drafted(policy, values, max_depth, seed, on_device) for on_device in (False, True)]
    request = DraftRequest(root_token=7, max_depth=max_depth, drafter=PathDrafter(seed))
    if policy == "dynatree":
        trees.append(reference.dynatree(make_policy(policy, values), request))
    else:
        joins = {p.name for p in JOIN_PARAMS}  # the engine's joined branches, not the paper's loop
        full = {k: v for k, v in make_policy(policy, values).config.items() if k not in joins}
        trees.append(getattr(reference, policy)(request, **full))
    return trees


def check_rows(tree, probe: RowsProbe) -> None:
    """The rows are the tree's verified nodes in bfs order (DraftTree.order), with its ancestor
    mask and depths; padding rows after them see only themselves; the view names the rows' nodes
    in that order."""
    order = tree.order("bfs")
    n = len(order) - 1
    if probe.rows is None:  # nothing drafted
        assert n == 0
        return
    rows = probe.rows
    width = rows.tokens.shape[0]
    assert rows.valid.tolist() == [True] * n + [False] * (width - n)
    assert rows.tokens[:n].tolist() == [tree.tokens[v] for v in order[1:]]
    assert rows.depths[:n].tolist() == [tree.depths[v] for v in order[1:]]
    assert (rows.depths <= probe.depth).all()
    ancestors = closure(rows.lines)
    assert torch.equal(ancestors[: n + 1, : n + 1], ancestor_mask(tree, order))
    assert torch.equal(ancestors[n + 1 :], torch.eye(width + 1, dtype=torch.bool)[n + 1 :])
    assert not ancestors[: n + 1, n + 1 :].any()
    assert probe.order == order


@examples(60)
@given(
    seed=st.integers(0, 10**6),
    depth=st.integers(1, 5),
    branch=st.integers(1, 5),
    tau=st.sampled_from([0.0, 0.001, 0.02, 0.1, 0.3]),
    budget=st.integers(1, 40),
    max_depth=st.integers(0, 6),
)
def test_topk_levels_decide_as_the_papers_loops_do(seed, depth, branch, tau, budget, max_depth):
    values = {"depth": depth, "branch": branch, "tau": tau, "budget": budget}
    trees = decided("fixed_tree", values, max_depth, seed)
    assert signature(trees[0]) == signature(trees[1]) == signature(trees[2])


@examples(40)
@given(seed=st.integers(0, 10**6), depth=st.integers(1, 5), topk=st.integers(1, 5), total=st.integers(1, 30))
def test_eagle2s_beam_decides_as_the_papers_loop_does(seed, depth, topk, total):
    trees = []
    for on_device in (False, True):
        policy = make_policy("eagle2", {"depth": depth, "topk": topk, "total": total})
        trees.append(
            policy.draft(DraftRequest(root_token=7, max_depth=6, drafter=PathDrafter(seed), on_device=on_device))
        )
    request = DraftRequest(root_token=7, max_depth=6, drafter=PathDrafter(seed))
    trees.append(reference.eagle2(request, depth=depth, topk=topk, total=total))
    assert signature(trees[0]) == signature(trees[1]) == signature(trees[2])


@examples(200)
@given(
    seed=st.integers(0, 10**6),
    branches=st.lists(st.integers(1, 4), min_size=3, max_size=3).map(sorted),
    taus=st.sampled_from([(0.2, 0.5), (0.4, 0.9), (0.05, 0.3)]),
    depths=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    rhos=st.sampled_from([(0.0, 0.0), (0.02, 0.3), (0.1, 0.1), (0.001, 0.5)]),
    tau=st.sampled_from([0.0, 0.01, 0.1]),
    budget=st.integers(1, 30),
    flags=st.tuples(st.booleans(), st.booleans()),
    max_depth=st.integers(0, 7),
)
def test_dynatrees_gated_levels_decide_as_the_papers_loops_do(
    seed, branches, taus, depths, rhos, tau, budget, flags, max_depth
):
    b_min, b_mid, b_max = branches
    values = {"b_min": b_min, "b_mid": b_mid, "b_max": b_max, "tau_l": taus[0], "tau_h": taus[1]}
    values |= {"d0": depths[0], "d_max": depths[0] + depths[1], "rho_stop": rhos[0], "rho_deep": rhos[1]}
    values |= {"tau": tau, "budget": budget, "adaptive_branch": flags[0], "dynamic_depth": flags[1]}
    trees = decided("dynatree", values, max_depth, seed)
    assert signature(trees[0]) == signature(trees[1]) == signature(trees[2])
    assert trees[0].notes == trees[1].notes == trees[2].notes


@examples(60)
@given(
    seed=st.integers(0, 10**6),
    threshold=st.sampled_from([0.0, 0.001, 0.02, 0.1, 0.3]),
    budget=st.integers(1, 40),
    depth=st.integers(1, 5),
    children=st.integers(1, 6),
    max_depth=st.integers(0, 6),
)
def test_dyspec_thresholds_levels_decide_as_the_papers_loops_do(seed, threshold, budget, depth, children, max_depth):
    values = {"threshold": threshold, "budget": budget, "depth": depth, "max_children": children}
    trees = decided("dyspec_threshold", values, max_depth, seed)
    assert signature(trees[0]) == signature(trees[1]) == signature(trees[2])


def verified_paths(tree) -> dict:
    """Each verified node's token path with its status, reason and log-probability; the root's state."""
    path = lambda n: tuple(tree.tokens[a] for a in tree.path(n)[1:])  # noqa: E731
    out = {path(n): (tree.status[n], tree.reason[n], tree.logp[n]) for n in range(1, len(tree)) if tree.is_verified(n)}
    return {**out, (): (tree.status[0], tree.reason[0])}


@examples(80)
@given(
    seed=st.integers(0, 10**6),
    nodes=st.integers(2, 30),
    batch=st.integers(1, 8),
    th=st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.6, 0.9]),
    max_depth=st.integers(0, 6),
)
def test_salfs_tensor_search_decides_as_the_papers_heaps_do(seed, nodes, batch, th, max_depth):
    """The same G, the same batches (their masses, forwards and rows) as Algorithm 2 with heaps. The
    pruned candidates shown may differ where a node leaves G within a batch: the heaps pass over its
    child and pop the next, which cannot enter G either; the tensor search pops the child."""
    values = {"nodes": nodes, "batch": batch, "th": th}
    drafters = [PathDrafter(seed), PathDrafter(seed)]
    request = lambda d: DraftRequest(root_token=7, max_depth=max_depth, drafter=d)  # noqa: E731
    tree = make_policy("salf", values).draft(request(drafters[0]))
    ref = reference.salf(request(drafters[1]), **values)
    assert verified_paths(tree) == verified_paths(ref)
    assert tree.notes == ref.notes  # the masses, step by step (Theorem 1)
    assert drafters[0].ran == drafters[1].ran  # the forwards' rows, batch by batch


def canonical(tree) -> tuple:
    """A tree as its nodes' token paths (node ids apart): each one's status, reason and
    log-probability; DySpec's taken nodes in order; each verified node's draws."""
    path = lambda n: tuple(tree.tokens[a] for a in tree.path(n)[1:])  # noqa: E731
    nodes = {path(n): (tree.status[n], tree.reason[n], tree.logp[n]) for n in range(len(tree))}
    taken = [path(int(n)) for n in (tree.notes or {}).get("taken", [])]
    draws = {path(n): (d.tokens, d.weights.tolist()) for n, d in tree.sampled.items() if n == 0 or tree.is_verified(n)}
    return nodes, taken, draws


@examples(80)
@given(
    seed=st.integers(0, 10**6),
    budget=st.integers(1, 30),
    depth=st.integers(1, 6),
    children=st.integers(1, 6),
    batch=st.integers(1, 8),
    max_depth=st.integers(0, 7),
    draw=st.sampled_from(["top", "without_replacement"]),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
)
def test_dyspecs_tensor_search_decides_as_the_papers_heap_does(
    seed, budget, depth, children, batch, max_depth, draw, temperature
):
    """DySpec's greedy expansion on the pool (dyspec._Greedy) and with a heap, node by node
    (reference_drafting.dyspec): the same tree node for node (reasons, the draws left out, the run
    ahead), the same takes in order, the same forwards' rows and, sampled, the same draws."""
    from dynatree_core.core.sampling_config import SamplingConfig

    values = {"budget": budget, "depth": depth, "max_children": children, "batch": batch}

    def request():
        if draw == "top":
            return DraftRequest(root_token=7, max_depth=max_depth, drafter=PathDrafter(seed))
        sampling, gen = SamplingConfig(temperature=temperature, top_k=8), torch.Generator().manual_seed(seed)
        return DraftRequest(
            root_token=7, max_depth=max_depth, drafter=PathDrafter(seed), draw=draw, sampling=sampling, gen=gen
        )

    requests = [request(), request()]
    tree, ref = make_policy("dyspec", values).draft(requests[0]), reference.dyspec(requests[1], **values)
    assert canonical(tree) == canonical(ref)
    assert requests[0].drafter.ran == requests[1].drafter.ran


@examples(40)
@given(seed=st.integers(0, 10**6), k=st.integers(1, 5), l1=st.integers(0, 4), l2=st.integers(0, 4))
def test_delayed_trees_decide_as_the_papers_loops_do(seed, k, l1, l2):
    """Every candidate of a delayed tree is a node: its verify rows are the whole tree, in bfs order
    (the device's candidates come row by row; the rows sort them by probability within a depth)."""
    values = {"k": k, "l1": l1, "l2": l2}
    trees = decided("delayed", values, 6, seed)
    assert signature(trees[0]) == signature(trees[1]) == signature(trees[2])


def sampled_trees(policy: str, values: dict, seed: int, draw: str, temperature: float = 1.0) -> list:
    """The policy's sampled tree as tensor levels and the papers' sampled loop's
    (reference_drafting), each from its own generator seeded alike, on one drafter's rows;
    checked equal node for node, with every expanded node's draws and their q."""
    from dynatree_core.core.sampling_config import SamplingConfig

    sampling = SamplingConfig(temperature=temperature, top_k=8)

    def request():
        gen = torch.Generator().manual_seed(seed)
        return DraftRequest(root_token=7, max_depth=6, drafter=PathDrafter(seed), draw=draw, sampling=sampling, gen=gen)

    trees = [make_policy(policy, values).draft(request()), getattr(reference, policy)(request(), **values)]
    assert signature(trees[0]) == signature(trees[1])
    draws = [{n: (d.tokens, d.weights.tolist()) for n, d in t.sampled.items()} for t in trees]
    assert draws[0] == draws[1]
    return trees


@examples(60)
@given(
    seed=st.integers(0, 10**6),
    draw=st.sampled_from(["iid", "without_replacement"]),
    depth=st.integers(1, 4),
    branch=st.integers(1, 5),
    tau=st.sampled_from([0.0, 0.01, 0.1]),
    budget=st.integers(1, 30),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
)
def test_sampled_levels_draw_and_decide_as_the_papers_loop_does(seed, draw, depth, branch, tau, budget, temperature):
    """Sampled fixed_tree / linear as tensor levels (request.SampledLevels): the same draws from the
    same generator, row by row, and the same tree, node for node, draws and their q included."""
    values = {"depth": depth, "branch": branch, "tau": tau, "budget": budget}
    tree = sampled_trees("fixed_tree", values, seed, draw, temperature)[0]
    assert tree.sampled, "every expanded node records its draws"


@examples(40)
@given(
    seed=st.integers(0, 10**6),
    draw=st.sampled_from(["iid", "without_replacement"]),
    k=st.integers(1, 5),
    l1=st.integers(0, 3),
    l2=st.integers(0, 3),
)
def test_sampled_delayed_levels_draw_as_the_papers_loop_does(seed, draw, k, l1, l2):
    """Sampled delayed trees on grow_all_levels: each row's distinct draws are its children, the
    same draws from the same generator as the loop's, node for node."""
    sampled_trees("delayed", {"k": k, "l1": l1, "l2": l2}, seed, draw)


def test_candidates_are_ordered_as_the_hosts_stable_sort_orders_them():
    """Real candidates first, by cumulative log-prob (highest first), ties (zeros of either sign
    and -inf included) in candidate order; candidates that are not real (NaN) last, in candidate order."""
    import math
    import random

    from dynatree_core.drafting.admission import most_probable_first

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        cum = [rng.choice([0.0, -0.0, -math.inf, -0.5, -1.25, rng.uniform(-5, 0)]) for _ in range(n)]
        valid = [rng.random() < 0.7 for _ in range(n)]
        want = sorted(range(n), key=lambda i: (not valid[i], -cum[i] if valid[i] else 0.0))
        real = torch.where(torch.tensor(valid), torch.tensor(cum, dtype=torch.float64), math.nan)
        got = most_probable_first(real).tolist()
        assert got == want, (cum, valid)
