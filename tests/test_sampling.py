"""Speculative sampling end to end on a tiny model: the first two generated tokens follow the
target's own sampling distribution; same seed, same output; invalid pairings are refused."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import noisy_copy, tiny_model

from dynatree_core.core.sampling_config import SamplingConfig, adjust
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.errors import DynaTreeError

PROMPT = [1, 5, 7, 9]
SAMPLING = SamplingConfig(temperature=0.9, top_k=20)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Chi-square quantile at significance 0.001 (z = 3.09), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@torch.no_grad()
def exact_first_two(model, prompt: list[int] = PROMPT) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's law of the first token and the marginal law of the second, by enumeration."""
    p1 = adjust(model(torch.tensor([prompt])).logits[0, -1], SAMPLING)
    vocab = p1.shape[0]
    batch = torch.tensor([prompt + [t] for t in range(vocab)])
    p2_given = adjust(model(batch).logits[:, -1], SAMPLING)
    return p1, p1 @ p2_given


def chi2(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom, bins with expected count < 5 merged into one."""
    n = float(counts.sum())
    expected = law * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize(
    "policy,params,verifier",
    [
        ("fixed_tree", {"depth": 2, "branch": 3, "tau": 0.0}, "specinfer"),
        ("fixed_tree", {"depth": 2, "branch": 3, "tau": 0.0}, "without_replacement"),
        ("linear", {"k": 2}, "naive"),
        ("delayed", {"k": 2, "l1": 0, "l2": 2}, "spectr"),
        ("eagle2", {"depth": 2, "topk": 2, "total": 4}, "nss"),
        ("fixed_tree", {"depth": 2, "branch": 2, "tau": 0.0, "budget": 6}, "traversal"),
        ("linear", {"k": 2}, "block"),
        ("dyspec", {"budget": 4, "depth": 2, "max_children": 3, "batch": 2}, "without_replacement"),
        ("fixed_tree", {"depth": 2, "branch": 3, "tau": 0.0}, "khisti"),
    ],
)
def test_first_two_tokens_follow_the_target(policy, params, verifier):
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    p1, p2 = exact_first_two(target)
    n = 1500
    c1, c2 = torch.zeros_like(p1), torch.zeros_like(p2)
    for seed in range(n):
        config = DecodeConfig(max_new_tokens=2, sampling=SAMPLING, verifier=verifier, seed=seed)
        tokens = generate(target, PROMPT, make_method(policy, params), draft=draft, config=config).token_ids
        c1[tokens[0]] += 1
        c2[tokens[1]] += 1
    for counts, law in ((c1, p1), (c2, p2)):
        assert counts[law == 0].sum() == 0, "a token the target rules out was generated"
        stat, df = chi2(counts, law)
        assert stat < chi2_critical(df), f"{policy}/{verifier}: chi2 {stat:.1f} with {df} df"


@pytest.mark.parametrize(
    "policy,params,verifier",
    [
        ("fixed_tree", {"depth": 2, "branch": 3, "tau": 0.0}, "specinfer"),
        ("fixed_tree", {"depth": 2, "branch": 2, "tau": 0.0, "budget": 6}, "traversal"),
        ("eagle2", {"depth": 2, "topk": 2, "total": 4}, "nss"),
    ],
)
def test_a_feature_draft_keeps_the_target_law(policy, params, verifier):
    """With a feature draft the first iteration is the prefill (the target samples token 1 alone);
    token 2 comes through the tree drafted in the second iteration (3 tokens asked, so that tree
    has room for a level): its marginal law must be the target's."""
    from dynatree_core.drafts.feature import FeatureDraft

    target = tiny_model("llama")
    draft = FeatureDraft.from_target(target, seed=1)
    p1, p2 = exact_first_two(target)
    n = 1500
    c1, c2 = torch.zeros_like(p1), torch.zeros_like(p2)
    drafted = 0
    for seed in range(n):
        config = DecodeConfig(max_new_tokens=3, sampling=SAMPLING, verifier=verifier, seed=seed)
        result = generate(target, PROMPT, make_method(policy, params), draft=draft, config=config)
        c1[result.token_ids[0]] += 1
        c2[result.token_ids[1]] += 1
        drafted += len(result.records[1].tree) > 1
    assert drafted == n, "the second iteration must draft a tree"
    for counts, law in ((c1, p1), (c2, p2)):
        assert counts[law == 0].sum() == 0, "a token the target rules out was generated"
        stat, df = chi2(counts, law)
        assert stat < chi2_critical(df), f"{policy}/{verifier}: chi2 {stat:.1f} with {df} df"


REPEATING = [5, 7, 9, 11, 5, 7]  # the suffix 5 7 occurred before: a retrieved draft from the first iteration
EVERY_TOKEN = [*range(1, 96), 5]  # the prefill's rows give every token of the tiny vocabulary successors


@pytest.mark.parametrize(
    "policy,params,prompt,tokens",
    [
        ("suffix", {"branches": 2}, REPEATING, 2),
        ("recycle", {"k": 3, "depth": 2, "branch": 3}, EVERY_TOKEN, 3),
        ("joined_fixed_tree", {"depth": 1, "branch": 2, "tau": 0.0, "retrieved": 2, "recycled": 3}, REPEATING, 2),
    ],
)
def test_cost_free_candidates_keep_the_target_law(policy, params, prompt, tokens):
    """Retrieved, recycled and joined trees are deterministic proposals: under sampling they are
    verified by `nss` (every other verifier needs children drawn from q) and the first two
    tokens must follow the target's law. The suffix match drafts from the first iteration; the
    recycled matrix, seeded by the prefill, from the second (3 tokens asked: token 2 comes through
    its tree)."""
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    p1, p2 = exact_first_two(target, prompt)
    n = 1500
    c1, c2 = torch.zeros_like(p1), torch.zeros_like(p2)
    proposed = 0
    for seed in range(n):
        config = DecodeConfig(max_new_tokens=tokens, sampling=SAMPLING, verifier="nss", seed=seed)
        result = generate(target, prompt, make_method(policy, params), draft=draft, config=config)
        c1[result.token_ids[0]] += 1
        c2[result.token_ids[1]] += 1
        proposed += any(r.tree.sources for r in result.records[:2])
    assert proposed == n, "every run must verify retrieved or recycled nodes"
    for counts, law in ((c1, p1), (c2, p2)):
        assert counts[law == 0].sum() == 0, "a token the target rules out was generated"
        stat, df = chi2(counts, law)
        assert stat < chi2_critical(df), f"{policy}: chi2 {stat:.1f} with {df} df"


def test_same_seed_same_output_and_seeds_differ():
    target, draft = tiny_model("qwen2"), noisy_copy("qwen2", 0.05)

    def run(seed):
        config = DecodeConfig(max_new_tokens=16, sampling=SAMPLING, verifier="specinfer", seed=seed)
        return generate(target, PROMPT, make_method("fixed_tree"), draft=draft, config=config).token_ids

    assert run(5) == run(5)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_invalid_pairings_are_refused():
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    hot = DecodeConfig(max_new_tokens=4, sampling=SAMPLING, verifier="specinfer")
    with pytest.raises(DynaTreeError, match="only 'nss' is lossless"):
        generate(target, PROMPT, make_method("eagle2"), draft=draft, config=hot)
    with pytest.raises(DynaTreeError, match="unknown sampling verifier"):
        bad = DecodeConfig(sampling=SAMPLING, verifier="?")
        generate(target, PROMPT, make_method("linear"), draft=draft, config=bad)
    with pytest.raises(DynaTreeError, match="temperature"):
        generate(target, PROMPT, make_method("linear"), draft=draft, config=DecodeConfig(verifier="naive"))
    with pytest.raises(DynaTreeError, match="single|one drafted path"):
        block = DecodeConfig(max_new_tokens=4, sampling=SAMPLING, verifier="block")
        generate(target, PROMPT, make_method("fixed_tree"), draft=draft, config=block)
    with pytest.raises(DynaTreeError, match=r"budget >= 39"):  # 3 + 9 + 27 > 32: the budget can bind
        walk = DecodeConfig(max_new_tokens=4, sampling=SAMPLING, verifier="traversal")
        generate(target, PROMPT, make_method("fixed_tree"), draft=draft, config=walk)
    auto = DecodeConfig(max_new_tokens=4, sampling=SAMPLING)  # auto: nss on a deterministic tree
    assert len(generate(target, PROMPT, make_method("eagle2"), draft=draft, config=auto).token_ids) == 4


def test_the_check_catches_a_lossy_verifier(monkeypatch):
    """Accepting the first drafted child outright is the classic lossy bug: the test must see it."""
    from dynatree_core.verify import otlp

    monkeypatch.setitem(
        otlp.SOLVERS, "naive", (lambda p, q, xs, gen=None, trace=None: (xs[0], 0), otlp.naive_distribution)
    )
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.3)
    p1, _ = exact_first_two(target)
    counts = torch.zeros_like(p1)
    for seed in range(400):
        config = DecodeConfig(max_new_tokens=2, sampling=SAMPLING, verifier="naive", seed=seed)
        counts[generate(target, PROMPT, make_method("linear", {"k": 1}), draft=draft, config=config).token_ids[0]] += 1
    stat, df = chi2(counts, p1)
    assert stat > chi2_critical(df)


def test_lab_repeats_one_step_and_its_histogram_matches_the_target():
    from dynatree_core.measure.lab import chi_square_critical, run_lab

    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    config = DecodeConfig(max_new_tokens=8, sampling=SAMPLING, verifier="traversal")
    seen = []
    result = run_lab(target, PROMPT, make_method("delayed"), config, 300, draft=draft, progress=seen.append)
    assert seen[-1] == 300 and len(result.first_tokens) == 300 and len(result.records) == 300
    p1, _ = exact_first_two(target)
    assert torch.allclose(result.target_law, p1)
    stat, dof = result.chi_square()
    assert stat < chi_square_critical(dof)
    rows = result.table()
    assert abs(sum(r["observed"] for r in rows) - 1) < 1e-9 and rows[0]["target p"] == float(p1.max())
    assert all(rec.analysis for rec in result.records)  # the lab always computes the analysis
    from dynatree_core.viz import acceptance_by_depth

    for row in acceptance_by_depth(result.records):  # the exact per-tree law predicts what happened
        n = row["iterations"]
        assert abs(row["expected"] - row["realised"]) < 4 * (0.25 / n) ** 0.5, row


@pytest.mark.parametrize("verifier", ["specinfer", "spectr", "khisti", "naive", "nss"])
def test_reach_probabilities_of_top_down_verifiers_are_consistent(verifier):
    """Root reach 1; children's reach sums to at most their parent's (the rest stops there)."""
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    config = DecodeConfig(max_new_tokens=6, sampling=SAMPLING, verifier=verifier, analyze=True, seed=3)
    policy = make_method("fixed_tree", {"depth": 3, "branch": 2, "tau": 0.0})
    from dynatree_core.decoding.engine import decode

    for rec in decode(target, PROMPT, policy, draft=draft, config=config):
        reach = {int(k): v["reach"] for k, v in rec.analysis.items()}
        assert reach[0] == 1.0
        for node in rec.order:
            kids = [c for c in rec.order if c and rec.tree.parents[c] == node]
            assert sum(reach[c] for c in kids) <= reach[node] + 1e-9
        if verifier != "nss" and rec.tree.draws(0):
            assert 0 <= rec.analysis["0"]["expected_acceptance"] <= 1


def test_sampling_settings_at_their_edges():
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")),
                dict(top_p=0.0), dict(top_p=1.5), dict(top_p=float("nan")), dict(top_k=-1)):  # fmt: skip
        with pytest.raises(DynaTreeError):
            SamplingConfig(**bad)
    SamplingConfig(top_p=1.0)  # the edges that are valid
    # a tiny positive temperature is sampling that always picks the argmax: the greedy output
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    greedy = generate(target, PROMPT, make_method("ar"), config=DecodeConfig(max_new_tokens=12)).token_ids
    cold = SamplingConfig(temperature=1e-6)
    for name in ("ar", "linear", "fixed_tree"):
        config = DecodeConfig(max_new_tokens=12, sampling=cold, seed=3)
        assert generate(target, PROMPT, make_method(name), draft=draft, config=config).token_ids == greedy, name
