"""Each paper's drafting rule, on scripted draft distributions (no model): the exact tree it must
build, its stopping rules, budgets and reasons. Greedy exactness on real models is in
test_engine.py (every registered policy) and test_embedded.py."""

from __future__ import annotations

import itertools
import math
import random
import types

import pytest
import torch

from dynatree_core.core.tree import DraftTree, Status
from dynatree_core.drafting import POLICIES, DraftRequest, make_policy
from dynatree_core.drafting.common import sibling_value
from dynatree_core.forward.capture import StepGraphs

VOCAB = 12


class ScriptedDrafter:
    """Stands in for Drafter: the distribution after a path is looked up in `script` (keyed by
    the path's tokens below the root) or drawn once from a seeded generator. Records batches."""

    def __init__(self, script: dict[tuple[int, ...], dict[int, float]] | None = None, seed: int = 0):
        self.script = dict(script or {})
        self.seed = seed
        self.batches: list[int] = []
        self.expanded: list[list[tuple[int, ...]]] = []  # the paths run through the draft, per forward

    def dist(self, path: tuple[int, ...]) -> list[float]:
        if path in self.script:
            probs = [1e-6] * VOCAB
            for tok, p in self.script[path].items():
                probs[tok] = p
        else:
            rng = random.Random(hash((self.seed, path)))
            probs = [rng.random() ** 4 for _ in range(VOCAB)]  # peaked, distinct values
        total = sum(probs)
        return [p / total for p in probs]

    def expand(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        assert nodes and len(set(nodes)) == len(nodes)
        for n in nodes:
            assert tree.is_verified(n), "only verified nodes are run through the draft"
            assert all(tree.status[a] == Status.KEPT for a in tree.path(n)[:-1]), "ancestors were expanded"
        self.batches.append(len(nodes))
        paths = [tuple(tree.tokens[a] for a in tree.path(n)[1:]) for n in nodes]
        self.expanded.append(paths)
        rows = [self.dist(path) for path in paths]
        return torch.tensor(rows, dtype=torch.float64).log()

    # greedy drafting's tensor levels (drafting/device.py): rows named by their parent rows
    steps = StepGraphs(torch.device("cpu"), capture=False)

    def expand_level(self, tokens, parents, depth, *, then=None):
        if tokens is None:
            self.level_paths = self.row_paths = [()]
        else:
            pairs = zip(tokens.tolist(), parents.tolist(), strict=True)
            self.level_paths = [self.level_paths[p] + (t,) for t, p in pairs]
        self.batches.append(len(self.level_paths))
        self.expanded.append(list(self.level_paths))
        logits = torch.tensor([self.dist(path) for path in self.level_paths], dtype=torch.float64).log()
        return logits if then is None else then[1](logits, *then[2])  # the level's decision after its forward

    def expand_rows(self, tokens, parents, depths):
        """A best-first search's batch (Drafter.expand_rows): parents name rows over every forward."""
        paths = [self.row_paths[p] + (t,) for t, p in zip(tokens.tolist(), parents.tolist(), strict=True)]
        assert [len(path) for path in paths] == depths.tolist()
        self.row_paths = self.row_paths + paths
        self.batches.append(len(paths))
        self.expanded.append(paths)
        return torch.tensor([self.dist(path) for path in paths], dtype=torch.float64).log()

    def to_logp(self, logits):
        return logits  # its rows are log-probabilities already

    def level_top(self, logits, k):
        return logits.topk(min(k, logits.shape[-1]), dim=-1)

    def bind(self, node, level, row):
        pass

    @property
    def forwards(self) -> int:
        return len(self.batches)


def draft(name: str, params: dict, drafter: ScriptedDrafter, max_depth: int = 32) -> DraftTree:
    return make_policy(name, params).draft(
        DraftRequest(root_token=0, max_depth=max_depth, drafter=drafter, context=[5, 0])
    )


def check_invariants(tree: DraftTree) -> None:
    for n in range(1, len(tree)):
        if tree.is_verified(n):
            assert tree.is_verified(tree.parents[n]), "verified nodes form a tree"
        if tree.status[n] != Status.KEPT:
            assert tree.reason[n], f"node {n} ({tree.status[n]}) has no reason"
    if tree.status[0] != Status.KEPT:
        assert tree.reason[0]


def verified(tree: DraftTree) -> list[int]:
    return [n for n in range(1, len(tree)) if tree.is_verified(n)]


def best_paths(drafter: ScriptedDrafter, depth: int, children: int, n: int) -> set[tuple[int, ...]]:
    """Brute force (best-first search): the n most probable paths, each node offering its top
    `children` draws, down to `depth`. Exact because a path is never more probable than its parent."""
    import heapq

    found: list[tuple[int, ...]] = []
    heap = [(-1.0, ())]
    while heap and len(found) < n + 1:
        neg, path = heapq.heappop(heap)
        found.append(path)
        if len(path) < depth:
            probs = drafter.dist(path)
            for tok in sorted(range(VOCAB), key=lambda t: -probs[t])[:children]:
                heapq.heappush(heap, (neg * probs[tok], path + (tok,)))
    return set(found[1 : n + 1])  # the root's empty path excluded


def paths_of(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[a] for a in tree.path(n)[1:]) for n in verified(tree)}


# ----- every policy -------------------------------------------------------------------------------
MODEL_POLICIES = [name for name, cls in POLICIES.items() if cls.needs_draft_model]


def budget_params(name: str, budget: int) -> tuple[dict, int]:
    """Parameters that bound the tree size, and the most drafted nodes they allow."""
    if name in ("delayed", "delayed_auto"):
        k = min(budget, 4)
        return {"k": k, "l1": 1, "l2": 2}, 1 + 2 * k
    if name == "salf":
        return {"nodes": max(budget, 2)}, max(budget, 2) - 1  # N counts the root
    return {{"eagle2": "total", "linear": "k"}.get(name, "budget"): budget}, budget


@pytest.mark.parametrize("name", MODEL_POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_budget_reasons_and_tree_shape_on_random_drafts(name, seed):
    for budget in (1, 3, 9, 30):
        params, limit = budget_params(name, budget)
        tree = draft(name, params, ScriptedDrafter(seed=seed))
        check_invariants(tree)
        assert len(verified(tree)) <= limit
        for max_depth in (0, 1, 2):
            tree = draft(name, params, ScriptedDrafter(seed=seed), max_depth=max_depth)
            check_invariants(tree)
            assert max((tree.depths[n] for n in verified(tree)), default=0) <= max_depth


# ----- DynaTree -----------------------------------------------------------------------------------
def test_dynatree_branches_by_confidence_and_gates_depth():
    script = {
        (): {1: 0.95, 2: 0.05},  # c = 0.95 >= tau_h: B_min = 1 child
        (1,): {3: 0.6, 4: 0.3, 5: 0.1},  # tau_l <= 0.6 < tau_h: B_mid = 2
        (1, 3): {6: 0.25, 7: 0.25, 8: 0.25, 9: 0.25},  # c < tau_l: B_max = 3
    }
    params = {"tau": 0.0, "rho_stop": 0.02, "rho_deep": 0.5, "d0": 2, "d_max": 6, "budget": 50, "history": False}
    tree = draft("dynatree", params, ScriptedDrafter(script))
    kids = tree.child_map()
    assert [tree.tokens[n] for n in kids[0]] == [1]
    assert [tree.tokens[n] for n in kids[kids[0][0]]] == [3, 4]
    node_13 = next(n for n in verified(tree) if tree.tokens[n] == 3)
    assert len(kids[node_13]) == 3
    node_14 = next(n for n in verified(tree) if tree.tokens[n] == 4)
    # depth 2 = d0 and p = 0.95 * 0.3 < rho_deep: gated; the depth-3 children of (1, 3) are
    # below rho_deep as well; p(1,3,x) = 0.95*0.6*0.25 = 0.14 >= rho_stop
    assert tree.reason[node_14] == "depth_gate"
    assert all(tree.reason[n] == "depth_gate" for n in kids[node_13])


def test_dynatree_early_stop_depth_limit_and_switches():
    script = {(): {1: 0.35, 2: 0.33, 3: 0.32}}  # c = 0.35 < tau_l: three children
    params = {"tau": 0.0, "rho_stop": 0.325, "rho_deep": 0.33, "history": False}
    tree = draft("dynatree", params, ScriptedDrafter(script))
    by_token = {tree.tokens[n]: n for n in verified(tree) if tree.depths[n] == 1}
    assert tree.reason[by_token[3]] == "early_stop"  # 0.32 < rho_stop
    assert tree.status[by_token[1]] == Status.KEPT
    fixed = {"adaptive_branch": False, "dynamic_depth": False, "history": False, "tau": 0.0, "budget": 256}
    tree = draft("dynatree", {**fixed, "b_mid": 2, "d0": 3}, ScriptedDrafter(seed=1))
    assert len(verified(tree)) == 2 + 4 + 8  # a full binary tree of depth d0
    assert {tree.reason[n] for n in verified(tree) if tree.depths[n] == 3} == {"depth_limit"}


def test_dynatree_history_moves_d0_with_acceptance():
    policy = make_policy("dynatree", {"window": 2, "d0": 4, "d_max": 8, "tau": 0.0})
    request = DraftRequest(root_token=0, max_depth=32, drafter=ScriptedDrafter(seed=2), context=[0])
    depth = max(policy.draft(request).depths)
    for _ in range(2):  # everything accepted: deeper
        policy.draft(request)
        policy.observe(types.SimpleNamespace(accepted=list(range(depth))))
    assert policy.d0 == 5 and policy.tau_h == pytest.approx(0.85)
    for _ in range(2):  # nothing accepted: shallower
        policy.draft(request)
        policy.observe(types.SimpleNamespace(accepted=[]))
    assert policy.d0 == 4
    policy.reset()
    assert policy.d0 == 4 and policy.tau_h == 0.9 and not policy.window


def test_dynatree_rejects_inconsistent_parameters():
    from dynatree_core.errors import DynaTreeError

    with pytest.raises(DynaTreeError, match="b_min <= b_mid"):
        make_policy("dynatree", {"b_min": 3, "b_mid": 2})
    with pytest.raises(DynaTreeError, match="tau_l < tau_h"):
        make_policy("dynatree", {"tau_l": 0.9, "tau_h": 0.5})


# ----- DySpec -------------------------------------------------------------------------------------
def test_sibling_value_telescopes_to_the_path_product():
    probs = [0.5, 0.2, 0.15, 0.1]
    for rank, p in enumerate(probs):
        assert sibling_value(0.3, probs, rank) == pytest.approx(0.3 * p)


@pytest.mark.parametrize("seed", range(5))
def test_dyspec_builds_the_optimal_tree_in_heap_order(seed):
    drafter = ScriptedDrafter(seed=seed)
    budget, depth, children = 20, 6, 4
    tree = draft("dyspec", {"budget": budget, "depth": depth, "max_children": children}, drafter)
    check_invariants(tree)
    assert paths_of(tree) == best_paths(drafter, depth, children, budget)
    values = [math.exp(tree.cum_logp[int(n)]) for n in tree.notes["taken"]]
    assert sorted(tree.notes["taken"]) == verified(tree)
    assert values == sorted(values, reverse=True), "nodes are taken by decreasing estimated value"
    assert drafter.forwards < budget, "unexpanded nodes are batched into one forward"


def test_dyspec_threshold_keeps_every_draw_above_threshold():
    drafter = ScriptedDrafter(seed=7)
    tree = draft("dyspec_threshold", {"threshold": 0.01, "budget": 256, "depth": 4, "max_children": 12}, drafter)
    want = {p for p in best_paths(drafter, 4, 12, 2000) if math.prod(_path_probs(drafter, p)) >= 0.01}
    assert paths_of(tree) == want
    assert drafter.forwards <= 4  # one per level


def _path_probs(drafter: ScriptedDrafter, path: tuple[int, ...]) -> list[float]:
    return [drafter.dist(path[:i])[tok] for i, tok in enumerate(path)]


# ----- EAGLE-2 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_eagle2_beam_then_rerank(seed):
    drafter = ScriptedDrafter(seed=seed)
    k, depth, total = 3, 4, 10
    tree = draft("eagle2", {"topk": k, "depth": depth, "total": total}, drafter)
    check_invariants(tree)
    assert drafter.batches == [1] + [k] * (depth - 1), "top-k of the newest level expanded per step"
    for level in range(1, depth):  # the expanded nodes are the k most probable of their level
        nodes = [n for n in range(len(tree)) if tree.depths[n] == level]
        best = sorted(nodes, key=lambda n: -tree.cum_logp[n])[:k]
        assert set(drafter.expanded[level]) == {tuple(tree.tokens[a] for a in tree.path(n)[1:]) for n in best}
    kept = verified(tree)
    assert len(kept) == total
    drafted = sorted(range(1, len(tree)), key=lambda n: -tree.cum_logp[n])
    assert set(kept) == set(drafted[:total]), "the rerank keeps the global top-N"
    assert all(tree.reason[n] == "rerank" for n in range(1, len(tree)) if n not in kept)


# ----- SALF ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_salf_without_stopping_finds_the_top_n_nodes(seed):
    drafter = ScriptedDrafter(seed=seed)
    nodes, batch = 16, 4
    tree = draft("salf", {"nodes": nodes, "batch": batch, "th": 0.0}, drafter, max_depth=32)
    check_invariants(tree)
    assert paths_of(tree) == best_paths(drafter, 15, nodes, nodes - 1), "Algorithm 2 is optimal (Theorem 2)"
    assert max(drafter.batches) <= batch


@pytest.mark.parametrize("th", [0.05, 0.3, 0.6, 0.9])
@pytest.mark.parametrize("seed", range(4))
def test_salf_mass_decreases_and_stops_at_the_first_step_below_th(th, seed):
    drafter = ScriptedDrafter(seed=seed)
    tree = draft("salf", {"nodes": 24, "batch": 4, "th": th}, drafter)
    masses = tree.notes["salf_mass"]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(masses)), f"Theorem 1: {masses}"
    assert all(m >= th for m in masses[:-1])
    if 0 < masses[-1] < th:
        assert any(tree.reason[n] == "salf_stop" for n in range(len(tree)))
    assert drafter.forwards == len(masses) - 1 or masses[-1] >= th


# ----- delayed expansion --------------------------------------------------------------------------
@pytest.mark.parametrize("k,l1,l2", [(1, 3, 2), (3, 0, 4), (2, 2, 3), (4, 5, 0)])
def test_delayed_tree_has_the_k_l1_l2_shape(k, l1, l2):
    drafter = ScriptedDrafter(seed=3)
    tree = draft("delayed", {"k": k, "l1": l1, "l2": l2}, drafter)
    check_invariants(tree)
    nodes = verified(tree)
    assert len(nodes) == l1 + (k * l2)
    assert drafter.forwards == l1 + l2, "one draft forward per level"
    kids = tree.child_map()
    for n in [0, *nodes]:
        want = (k if tree.depths[n] == l1 else 1) if tree.depths[n] < l1 + l2 else 0
        assert len(kids.get(n, [])) == want
    cut = draft("delayed", {"k": k, "l1": l1, "l2": l2}, ScriptedDrafter(seed=3), max_depth=2)
    assert max((cut.depths[n] for n in verified(cut)), default=0) == min(2, l1 + l2)


# ----- prompt lookup --------------------------------------------------------------------------------
def test_ngram_merges_the_continuations_of_earlier_matches():
    policy = make_policy("ngram", {"max_n": 2, "min_n": 1, "depth": 3, "branches": 3})
    context = [7, 1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2]  # suffix (1, 2) occurred twice before
    tree = policy.draft(DraftRequest(root_token=2, max_depth=32, drafter=None, context=context))
    check_invariants(tree)
    assert paths_of(tree) == {(3,), (3, 5), (3, 5, 8), (3, 4), (3, 4, 9)}  # (1 2) -> 3 5 8 and 3 4 9
    first = next(n for n in verified(tree) if tree.depths[n] == 1)
    assert math.exp(tree.logp[first]) == pytest.approx(1.0)  # both continuations start with 3
    small = make_policy("ngram", {"max_n": 2, "depth": 3, "budget": 2}).draft(
        DraftRequest(root_token=2, max_depth=32, drafter=None, context=context)
    )
    check_invariants(small)
    assert len(verified(small)) == 2 and "budget" in small.reason
    none = policy.draft(DraftRequest(root_token=6, max_depth=32, drafter=None, context=[1, 2, 6]))
    assert len(none) == 1 and none.reason[0] == "no_match"
    assert {tree.source(n) for n in range(1, len(tree))} == {"retrieved"}
    ends = policy.draft(DraftRequest(root_token=2, max_depth=32, drafter=None, context=[1, 2, 3, 1, 2]))
    assert paths_of(ends) == {(3,), (3, 1), (3, 1, 2)}
    assert ends.reason[len(ends) - 1] == "depth_limit", "depth 3 reached"
    longer = make_policy("ngram", {"max_n": 2, "depth": 5}).draft(
        DraftRequest(root_token=2, max_depth=32, drafter=None, context=[1, 2, 3, 1, 2])
    )
    assert longer.reason[len(longer) - 1] == "context_end", "the continuation ran into the context's end"


def test_delayed_auto_picks_the_shape_the_cost_model_favours():
    policy = make_policy("delayed_auto", {"warmup": 0})
    assert policy.choose([0.9, 0.05, 0.03, 0.01], 32) == (2, 2, 3)  # nothing measured yet: static
    policy.target_obs = [(1, 50.0), (40, 60.0)]  # extra tokens in the target forward are cheap
    policy.draft_obs = [(1, 5.0), (4, 6.0)]
    policy.alpha = 0.9
    k, l1, l2 = policy.choose([0.95, 0.03, 0.01, 0.01], 32)
    assert k == 1 and l1 + l2 >= 5, (k, l1, l2)  # a confident draft: one long chain
    policy.alpha = 0.2
    k, l1, l2 = policy.choose([0.3, 0.3, 0.2, 0.15], 32)
    assert k >= 3 and l1 == 0, (k, l1, l2)  # an uncertain root: branch at once, stay short
    policy.target_obs = [(1, 50.0), (40, 2000.0)]  # every extra token is expensive
    k, l1, l2 = policy.choose([0.3, 0.3, 0.2, 0.15], 32)
    assert l1 + k * l2 <= 2, (k, l1, l2)
    policy.target_obs = [(1, 50.0), (40, 60.0)]
    assert policy.choose([0.95, 0.03, 0.01, 0.01], 1)[1:] in ((1, 0), (0, 1))  # max_depth respected


def test_delayed_auto_shares_the_root_forward_with_its_tree():
    drafter = ScriptedDrafter(seed=5)
    policy = make_policy("delayed_auto", {"k": 3, "l1": 1, "l2": 2})
    tree = policy.draft(DraftRequest(root_token=0, max_depth=32, drafter=drafter, context=[0]))
    check_invariants(tree)
    assert drafter.forwards == 1 + 2 and len(verified(tree)) == 1 + 3 * 2
    assert tree.notes == {"k": [3.0], "l1": [1.0], "l2": [2.0]}


def test_the_registry_lists_the_built_in_policies_in_its_explicit_order():
    from dynatree_core.decoding.baselines import BASELINES, Baseline
    from dynatree_core.decoding.methods import catalogue
    from dynatree_core.drafting import ORDER, POLICIES, Policy

    assert tuple(POLICIES)[: len(ORDER)] == ORDER
    assert list(catalogue()) == [*POLICIES, *BASELINES]  # the black boxes last
    assert list(BASELINES) == ["hf_assisted", "hf_prompt_lookup", "hf_generate", "hf_static"]
    assert all(issubclass(c, Policy) and not issubclass(c, Baseline) for c in POLICIES.values())
    assert all(issubclass(c, Baseline) and not issubclass(c, Policy) for c in BASELINES.values())
    assert all(c.describe()["black_box"] for c in BASELINES.values())
    assert not any(c.describe()["black_box"] for c in POLICIES.values())


def test_a_levels_top_k_copied_once_equals_each_nodes_own_top_k():
    """level_top (one host copy per level) gives every row what a per-node top-k gave."""
    import torch

    from dynatree_core.drafting.request import level_top

    logp = torch.log_softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(0)), -1)
    lp_rows, tok_rows = level_top(logp, 4)
    for row in range(5):
        top_lp, top_tok = logp[row].topk(3)
        assert list(zip(tok_rows[row][:3], lp_rows[row][:3], strict=True)) == list(
            zip(top_tok.tolist(), top_lp.tolist(), strict=True)
        )


def test_a_registered_baseline_is_listed_and_run_through_generate_like_the_built_in_ones(monkeypatch):
    """The Baseline protocol: one `run` call, its own registry; methods.catalogue lists it after the
    policies, make_method builds it, engine.generate dispatches to it and decode refuses to step it."""
    from dynatree_core.decoding import baselines
    from dynatree_core.decoding.engine import DecodeConfig, decode, generate
    from dynatree_core.decoding.methods import catalogue, make_method, verifier_for
    from dynatree_core.errors import DynaTreeError
    from dynatree_core.runs.records import RunResult

    calls = []

    class Echo(baselines.Baseline):
        """Repeats the prompt's last token (a stand-in black box)."""

        name = "echo_baseline"
        summary = "test"
        needs_draft_model = False
        params = (baselines.Param("times", int, 2, 1, 8, "repeats"),)

        def run(self, target, prompt_ids, *, draft, config, draft_token_map=None, tokenizer=None):
            calls.append((target, list(prompt_ids), config.max_new_tokens))
            tokens = [prompt_ids[-1]] * self.config["times"]
            fields = {f: 0 for f in RunResult.__dataclass_fields__ if f not in ("policy", "params", "token_ids")}
            fields.update(text="", prompt_ids=list(prompt_ids), stop_reason="max_new_tokens", device="cpu")
            fields.update(dtype="float32", forward_path="hf")
            return RunResult(policy=self.name, params=dict(self.config), token_ids=tokens, **fields)

    monkeypatch.setitem(baselines.BASELINES, Echo.name, Echo)
    assert list(catalogue())[-1] == "echo_baseline"
    method = make_method("echo_baseline", {"times": 3})
    assert verifier_for(method, DecodeConfig()) == "hf"
    result = generate("a target", [4, 5, 6], method, config=DecodeConfig(max_new_tokens=7))
    assert result.token_ids == [6, 6, 6] and calls == [("a target", [4, 5, 6], 7)]
    with pytest.raises(DynaTreeError, match="cannot be stepped"):
        next(decode(None, [4, 5, 6], method))
    with pytest.raises(DynaTreeError, match="baseline 'echo_baseline' has no parameter depth"):
        make_method("echo_baseline", {"depth": 2})


def test_verifier_resolution_reads_a_policys_capabilities_as_data():
    """verify/registry.resolve_verifier decides on Capabilities alone (no policy object, no probing)."""
    from dynatree_core.core.sampling_config import SamplingConfig
    from dynatree_core.errors import DynaTreeError
    from dynatree_core.verify.registry import Capabilities, resolve_verifier

    warm = SamplingConfig(temperature=0.8)
    iid_tree = Capabilities("t", draws=("top", "iid"), local_shape=False, local_shape_hint="budget >= 14")
    assert resolve_verifier(iid_tree, "auto", warm) == ("specinfer", "iid")
    assert resolve_verifier(iid_tree, "auto", SamplingConfig()) == ("greedy", "top")
    assert resolve_verifier(Capabilities("t"), "auto", warm) == ("nss", "top")
    with pytest.raises(DynaTreeError, match=r"bottom-up.*\(budget >= 14\)"):
        resolve_verifier(iid_tree, "traversal", warm)
    assert resolve_verifier(Capabilities("t", draws=("iid",), local_shape=True), "traversal", warm) == (
        "traversal",
        "iid",
    )
    with pytest.raises(DynaTreeError, match="verifies one drafted path"):
        resolve_verifier(iid_tree, "block", warm)
    caps = make_policy("fixed_tree", {"depth": 2, "branch": 3, "budget": 5}).capabilities()
    assert (caps.local_shape, caps.local_shape_hint) == (False, "budget >= 12")
    assert make_policy("fixed_tree", {"depth": 2, "branch": 3, "budget": 12}).capabilities().local_shape
