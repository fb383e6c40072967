"""Bottom-up verification (Traversal, and block verification on a path) is lossless: exact laws
over every draft tree of small vocabularies, chi-square over seeded runs, and the reductions the
papers state (K = 1 is block verification; BV accepts at least as much as naive sampling)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dynatree_core.verify.traversal import WalkSpec, walk, walk_law

VOCAB = 3


def laws_for(seed: int, vocab: int = VOCAB):
    """p(.|path), q(.|path) for every context path: fixed random pairs, some with zeros."""
    cache: dict = {}

    def get(path: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if path not in cache:
            gen = torch.Generator().manual_seed(seed * 1000 + hash(path) % 997)
            p = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 2
            q = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 2
            if len(path) % 2 == 0 and seed % 2:
                p[0] = 0.0
            cache[path] = (p / p.sum(), q / q.sum())
        return cache[path]

    return get


def draw_lists(q: torch.Tensor, k: int, without_replacement: bool):
    if without_replacement:
        for xs in itertools.permutations(range(len(q)), min(k, int((q > 0).sum()))):
            weight, left = 1.0, 1.0
            for x in xs:
                weight *= float(q[x]) / left
                left -= float(q[x])
            yield list(xs), weight
    else:
        for xs in itertools.product(range(len(q)), repeat=k):
            weight = float(torch.prod(q[list(xs)]))
            if weight > 0:
                yield list(xs), weight


def trees(laws, widths: list[int], without_replacement: bool, prune_last: bool = False):
    """Every draft tree whose level-d nodes each draw widths[d] children, with its probability.
    Yields (probability, WalkSpec, path of each node). prune_last: the deepest level is drawn
    but never verified (the policy pruned it)."""

    def grow(spec, paths, frontier, level, prob):
        if level == len(widths):
            yield prob, spec, paths
            return
        # every frontier node draws its children; enumerate the joint draws of the level
        options = [list(draw_lists(laws(paths[n])[1], widths[level], without_replacement)) for n in frontier]
        for combo in itertools.product(*options):
            s = WalkSpec(dict(spec.p), dict(spec.q), dict(spec.draws), {k: dict(v) for k, v in spec.children.items()})
            s.without_replacement = without_replacement
            new_paths, new_frontier, weight = dict(paths), [], prob
            for node, (xs, w) in zip(frontier, combo, strict=True):
                weight *= w
                s.q[node], s.draws[node] = laws(paths[node])[1], xs
                if prune_last and level == len(widths) - 1:
                    continue
                for x in dict.fromkeys(xs):
                    child = len(new_paths)
                    new_paths[child] = paths[node] + (x,)
                    s.children.setdefault(node, {})[x] = child
                    s.p[child] = laws(new_paths[child])[0]
                    new_frontier.append(child)
            yield from grow(s, new_paths, new_frontier, level + 1, weight)

    root = WalkSpec({0: laws(())[0]}, {}, {}, {}, without_replacement)
    yield from grow(root, {0: ()}, [0], 0, 1.0)


def joint_law(laws, widths, without_replacement, prune_last=False) -> torch.Tensor:
    """Law of the first len(widths) + 1 tokens: what the walk commits, then the target's own
    continuation (the next iterations) up to that length."""
    length = len(widths) + 1
    joint = torch.zeros((VOCAB,) * length, dtype=torch.float64)
    for prob, spec, paths in trees(laws, widths, without_replacement, prune_last):
        for p_out, nodes, final in walk_law(spec):
            prefix = paths[nodes[-1]] if nodes else ()
            if isinstance(final, int):
                heads = [(prefix + (final,), 1.0)]
            else:
                heads = [(prefix + (y,), float(final[y])) for y in range(VOCAB) if final[y] > 0]
            for head, w in heads:
                _extend(joint, laws, head, prob * p_out * w, length)
    return joint


def _extend(joint, laws, head, weight, length):
    if len(head) == length:
        joint[head] += weight
        return
    p = laws(head)[0]
    for y in range(VOCAB):
        if p[y] > 0:
            _extend(joint, laws, head + (y,), weight * float(p[y]), length)


def target_law(laws, length) -> torch.Tensor:
    joint = torch.zeros((VOCAB,) * length, dtype=torch.float64)
    _extend(joint, laws, (), 1.0, length)
    return joint


@pytest.mark.parametrize("without_replacement", [False, True], ids=["iid", "without_replacement"])
@pytest.mark.parametrize("widths", [[2], [2, 2], [3, 1], [1, 2]])
@pytest.mark.parametrize("seed", range(3))
def test_traversal_is_exact_on_every_small_tree(widths, without_replacement, seed):
    laws = laws_for(seed)
    got = joint_law(laws, widths, without_replacement)
    want = target_law(laws, len(widths) + 1)
    assert torch.allclose(got, want, atol=1e-9, rtol=0), float((got - want).abs().max())


@pytest.mark.parametrize("seed", range(4))
def test_block_verification_is_exact_on_a_depth_three_path(seed):
    laws = laws_for(seed)
    got = joint_law(laws, [1, 1, 1], without_replacement=False)
    assert torch.allclose(got, target_law(laws, 4), atol=1e-9, rtol=0)


@pytest.mark.parametrize("without_replacement", [False, True])
def test_traversal_is_exact_when_the_deepest_draws_were_pruned(without_replacement):
    laws = laws_for(5)
    got = joint_law(laws, [2, 2], without_replacement, prune_last=True)
    assert torch.allclose(got, target_law(laws, 3), atol=1e-9, rtol=0)


def test_the_exact_check_catches_a_lossy_walk(monkeypatch):
    """Not vacuous: keeping P and w unchanged after a rejection is lossy, and the check sees it."""
    import dynatree_core.verify.traversal as tv

    laws = laws_for(1)
    monkeypatch.setattr(tv, "after_rejection", lambda w, P, Q: (w, P))
    got = joint_law(laws, [2, 2], without_replacement=False)
    assert not torch.allclose(got, target_law(laws, 3), atol=1e-3)


def _expected_tokens(laws, depth: int, rule: str) -> float:
    """Expected committed tokens per step on a sampled path of `depth` drafts."""
    total = 0.0
    for prob, spec, _ in trees(laws, [1] * depth, False):
        if rule == "block":
            total += prob * sum(p * (len(nodes) + 1) for p, nodes, _ in walk_law(spec))
            continue
        node, alive = 0, 1.0  # naive: accept each draft with min(1, p/q) until the first rejection
        for length in range(1, depth + 1):
            (x,) = spec.draws[node]
            accept = min(1.0, float(spec.p[node][x] / spec.q[node][x]))
            total += prob * alive * (1 - accept) * length
            alive *= accept
            node = spec.children[node][x]
        total += prob * alive * (depth + 1)
    return total


@pytest.mark.parametrize("seed", range(4))
def test_block_verification_accepts_at_least_as_much_as_naive(seed):
    """Sun et al. 2024c: BV's expected block length is never below naive speculative sampling's."""
    laws = laws_for(seed)
    naive, block = _expected_tokens(laws, 3, "naive"), _expected_tokens(laws, 3, "block")
    assert 1.0 <= naive <= block + 1e-12 <= 4.0 + 1e-12


def chi2_999(dof: int) -> float:
    """Chi-square quantile at 0.999 (Wilson-Hilferty; within 1% for dof >= 3)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def test_samples_follow_the_exact_law():
    """The sampling walk and the enumerated law agree (chi-square at 0.001, fixed seed)."""
    laws = laws_for(2)
    spec = next(s for _, s, _ in trees(laws, [2, 2], False) if len(s.children.get(0, {})) == 2)
    law: dict = {}
    for prob, nodes, final in walk_law(spec):
        for y in range(VOCAB):
            if final[y] > 0:
                law[(*nodes, y)] = law.get((*nodes, y), 0.0) + prob * float(final[y])
    gen, n = torch.Generator().manual_seed(7), 20_000
    counts: dict = {}
    for _ in range(n):
        nodes, y = walk(spec, gen)
        counts[(*nodes, y)] = counts.get((*nodes, y), 0) + 1
    assert set(counts) <= set(law)
    stat = sum((counts.get(key, 0) - n * p) ** 2 / (n * p) for key, p in law.items())
    assert stat < chi2_999(len(law) - 1), f"chi2 {stat:.1f} with {len(law) - 1} dof"


def test_same_seed_same_walk_and_a_trace():
    laws = laws_for(3)
    spec = next(s for _, s, _ in trees(laws, [2, 1], False))
    runs = []
    for _ in range(2):
        trace: list = []
        runs.append((walk(spec, torch.Generator().manual_seed(11), trace), trace))
    assert runs[0] == runs[1]
    trace = runs[0][1]
    assert trace[-1]["kind"] == "sample" and any(e["kind"] == "test" for e in trace)


@pytest.mark.slow
@pytest.mark.parametrize(
    "without_replacement,k", [(False, 3), (True, 2), (False, 1)], ids=["iid", "without_replacement", "block"]
)
def test_one_traversal_step_is_lossless_200k_runs(without_replacement, k):
    """The issue's statistical check for the bottom-up verifier: 200k seeded runs of one step
    (root draws k children from q, each child drafted one level further; k = 1 is block
    verification on a depth-2 path) on 4 random p/q pairs;
    chi-square of the first committed token against p at 0.001. Fixed seeds: deterministic."""
    runs, pairs = 200_000, 4
    gen = torch.Generator().manual_seed(2025)
    for seed in range(pairs):
        laws = laws_for(10 + seed, vocab=VOCAB)
        p = laws(())[0]
        counts = torch.zeros(VOCAB, dtype=torch.float64)
        q_root = laws(())[1]
        for _ in range(runs // pairs):
            xs = torch.multinomial(q_root, k, replacement=not without_replacement, generator=gen).tolist()
            spec = WalkSpec({0: p}, {0: q_root}, {0: xs}, {}, without_replacement)
            for x in dict.fromkeys(xs):
                child = len(spec.p)
                spec.children.setdefault(0, {})[x] = child
                spec.p[child], spec.q[child] = laws((x,))
                spec.draws[child] = torch.multinomial(spec.q[child], 1, generator=gen).tolist()
            nodes, y = walk(spec, gen)
            first = next(t for t, n in spec.children[0].items() if n == nodes[0]) if nodes else y
            counts[first] += 1
        expected = p * (runs // pairs)
        used = expected > 0
        assert counts[~used].sum() == 0
        stat = float(((counts[used] - expected[used]) ** 2 / expected[used]).sum())
        assert stat < chi2_999(int(used.sum()) - 1), f"pair {seed}: chi2 {stat:.1f}"
