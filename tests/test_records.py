"""Records round-trip through JSON; the parameter registry validates input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import noisy_copy, tiny_model

from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import catalogue, make_method
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.records import RunResult


def test_run_result_round_trips_through_json():
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.01)
    result = generate(
        target, [1, 2, 3], make_method("fixed_tree", {"tau": 0.0}), draft=draft, config=DecodeConfig(max_new_tokens=12)
    )
    data = json.loads(result.to_json())
    again = RunResult.from_dict(data)
    assert again.to_dict() == result.to_dict()
    assert [r.tree.to_dict() for r in again.records] == [r.tree.to_dict() for r in result.records]


def test_metrics_are_consistent_with_records():
    target, draft = tiny_model("gpt2"), noisy_copy("gpt2", 0.01)
    r = generate(
        target, [5, 6, 7], make_method("fixed_tree", {"tau": 0.0}), draft=draft, config=DecodeConfig(max_new_tokens=20)
    )
    assert r.new_tokens == len(r.token_ids) == 20
    assert r.tokens_per_iteration == pytest.approx(20 / r.iterations)
    accepted = sum(len(x.accepted) for x in r.records)
    assert r.mean_accepted_length == pytest.approx(accepted / r.iterations)
    assert r.acceptance_rate == pytest.approx(accepted / sum(x.drafted for x in r.records))
    assert r.wall_s > 0 and r.throughput_tps == pytest.approx(20 / r.wall_s)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "abc", "", "1.5", 99, -1])
def test_int_params_reject_bad_values(bad):
    with pytest.raises(DynaTreeError):
        make_method("fixed_tree", {"depth": bad})


@pytest.mark.parametrize("bad", ["nan", math.inf, "2", -0.1])
def test_float_params_reject_bad_values(bad):
    with pytest.raises(DynaTreeError):
        make_method("fixed_tree", {"tau": bad})


def test_params_accept_edges_and_strings():
    policy = make_method("fixed_tree", {"depth": "16", "tau": "0", "budget": 1})
    assert policy.config == {"depth": 16, "branch": 3, "tau": 0.0, "budget": 1, "retrieved": 0, "recycled": 0}


def test_unknown_policy_and_param_are_named():
    with pytest.raises(DynaTreeError, match="unknown policy"):
        make_method("bogus")
    with pytest.raises(DynaTreeError, match="no parameter"):
        make_method("linear", {"depth": 3})


def test_every_default_is_within_its_range():
    for cls in catalogue().values():
        for p in cls.params:
            assert p.parse(p.default) == p.default


def test_sampled_records_round_trip_and_older_records_still_load():
    """Traces and the analysis survive JSON; records saved before they existed load with defaults;
    a record missing a required field is refused by name."""
    from dynatree_core.core.sampling_config import SamplingConfig
    from dynatree_core.runs.records import IterationRecord

    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    config = DecodeConfig(
        max_new_tokens=6, sampling=SamplingConfig(temperature=0.8), verifier="traversal", analyze=True
    )
    result = generate(target, [1, 2, 3], make_method("delayed"), draft=draft, config=config)
    back = RunResult.from_dict(json.loads(result.to_json()))
    assert [r.verification for r in back.records] == [r.verification for r in result.records]
    assert back.records[0].analysis == result.records[0].analysis and back.records[0].verifier == "traversal"
    old = result.records[0].to_dict()
    for key in ("verifier", "verification", "analysis"):
        del old[key]
    loaded = IterationRecord.from_dict(old)
    assert loaded.verifier == "greedy" and loaded.verification == [] and loaded.analysis == {}
    del old["committed"]
    with pytest.raises(ValueError, match="committed"):
        IterationRecord.from_dict(old)


@pytest.mark.parametrize(("policy", "verifier"), [("delayed", "traversal"), ("dyspec", "without_replacement")])
def test_an_imported_sampled_run_carries_its_draws_and_can_be_verified_again(policy, verifier):
    """Sampled drafting's draws (q and the drawn tokens) are exported exactly with the tree, so a
    run read back from JSON verifies again: the analysis recomputed on the imported trees, with
    the target's distributions at their nodes, equals what the run recorded."""
    from dynatree_core.core.sampling_config import SamplingConfig
    from dynatree_core.verify.registry import resolve_verifier
    from dynatree_core.verify.sampling import analyze

    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    sampling = SamplingConfig(temperature=0.8, top_k=40)
    config = DecodeConfig(max_new_tokens=8, sampling=sampling, verifier=verifier, analyze=True, seed=1)
    method = make_method(policy)
    prompt = [1, 2, 3]
    result = generate(target, prompt, method, draft=draft, config=config)
    back = RunResult.from_dict(json.loads(result.to_json()))
    _, draw = resolve_verifier(method.capabilities(), verifier, sampling)
    context = list(prompt)
    checked = 0
    for rec, old in zip(back.records, result.records, strict=True):
        assert rec.tree.sampled.keys() == old.tree.sampled.keys()
        for node, d in rec.tree.sampled.items():
            assert d.tokens == old.tree.sampled[node].tokens
            assert d.weights is None and torch.equal(d.dense(), old.tree.sampled[node].dense()), "exact, packed"
        if rec.tree.sampled:
            paths = [context[:-1] + [rec.tree.tokens[n] for n in rec.tree.path(node)] for node in rec.order]
            with torch.inference_mode():  # the target at every verified node, one path at a time
                logits = torch.stack([target(torch.tensor([path])).logits[0, -1] for path in paths])
            again = analyze(rec.tree, rec.order, logits, sampling, verifier, draw)
            assert again.keys() == rec.analysis.keys()
            for node, entry in again.items():
                assert entry.keys() == rec.analysis[node].keys()
                assert all(math.isclose(v, rec.analysis[node][k], abs_tol=1e-5) for k, v in entry.items())
            checked += 1
        context += rec.committed
    assert checked >= 2
    assert (
        "sampled"
        not in generate(target, prompt, method, draft=draft, config=DecodeConfig(max_new_tokens=4))
        .records[0]
        .tree.to_dict()
    )
