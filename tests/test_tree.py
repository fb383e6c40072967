"""Tree invariants on hand-written and random trees."""

import random

import pytest
import torch

from dynatree_core.core.tree import DraftTree, Reason, Status
from dynatree_core.forward.rows import closure, lineage


def random_tree(seed: int, n: int = 30) -> DraftTree:
    rng = random.Random(seed)
    tree = DraftTree.with_root(7)
    for _ in range(n):
        verified = [i for i in range(len(tree)) if tree.is_verified(i)]
        parent = rng.choice(verified)
        node = tree.add(parent, rng.randrange(50), -rng.random() * 3)
        if rng.random() < 0.2:
            tree.prune(node, Reason.THRESHOLD)
    return tree


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("kind", ["bfs", "dfs"])
def test_mask_is_ancestor_closure_and_depth_is_row_sum_minus_one(seed, kind):
    tree = random_tree(seed)
    order = tree.order(kind)
    mask = closure(lineage(tree.parent_rows(order)))
    for i, node in enumerate(order):
        expected = {order.index(a) for a in tree.path(node)}
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == expected, "row must be the node's ancestors"
        assert int(mask[i].sum()) - 1 == tree.depths[node], "depth = mask row sum - 1"


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("kind", ["bfs", "dfs"])
def test_orders_keep_parents_before_children_and_exclude_pruned(seed, kind):
    tree = random_tree(seed)
    order = tree.order(kind)
    assert order[0] == 0, "the root comes first"
    seen = set()
    for node in order:
        assert tree.parents[node] in seen or node == 0, "parent precedes child"
        seen.add(node)
    assert seen == {i for i in range(len(tree)) if tree.is_verified(i)}, "exactly the verified nodes"


def test_prune_removes_descendants_and_keeps_reason():
    tree = DraftTree.with_root(1)
    a = tree.add(0, 2, -0.1)
    b = tree.add(a, 3, -0.2)
    c = tree.add(0, 4, -2.0)
    tree.prune(a, Reason.BUDGET)
    assert tree.status[b] == Status.PRUNED and tree.reason[b] == "budget"
    assert tree.order("bfs") == [0, c]
    with pytest.raises(ValueError, match="verified child"):
        tree.add(a, 5, -0.1)
    d = tree.add(a, 5, -0.1, status=Status.PRUNED, reason=Reason.RERANK)  # a withdrawn subtree grows pruned
    assert tree.depths[d] == 2 and tree.order("bfs") == [0, c]


def test_position_ids_are_root_position_plus_depth():
    tree = DraftTree.with_root(1)
    a = tree.add(0, 2, -0.1)
    tree.add(a, 3, -0.2)
    tree.add(0, 4, -1.0)
    order = tree.order("bfs")
    assert tree.position_ids(order, 10) == [10 + tree.depths[n] for n in order]


def test_cumulative_logp_is_path_sum():
    tree = random_tree(3)
    for node in range(len(tree)):
        assert tree.cum_logp[node] == pytest.approx(sum(tree.logp[n] for n in tree.path(node)))


def test_tree_round_trips_through_dict():
    tree = random_tree(5)
    again = DraftTree.from_dict(tree.to_dict())
    assert again.to_dict() == tree.to_dict()


def test_from_dict_rejects_bad_parents():
    data = random_tree(1).to_dict()
    data["parents"][3] = 5
    with pytest.raises(ValueError):
        DraftTree.from_dict(data)
