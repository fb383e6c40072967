"""Runs on Ray workers (measure/cluster.py): a comparison fanned out over actors gives what one
process gives, a round of a prompt on one worker; on a two-node cluster (ray.cluster_utils on
this machine) the workers land on different nodes; the CLI's --ray writes the same report. The
live engines (live/engine.py, Ray actors) on a two-node cluster: two pairs on different nodes, and
an automatic replica that serves a second session on the node its pair was not on."""

from __future__ import annotations

import json

import pytest
from conftest import build_noisy_copy, build_tiny_model
from test_compare import PROMPT

from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.pairs import ModelPair
from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.compare import measure
from dynatree_core.measure.entries import Entry

ray = pytest.importorskip("ray")
from dynatree_core.measure.cluster import PairSource, Workers  # noqa: E402


def tiny_pair() -> ModelPair:
    """test_compare's pair built anew: the suite's shared tiny models (conftest's cache) may carry
    what other tests attached to them, which need not pickle, and a worker's pair is pickled."""
    from types import SimpleNamespace

    target = build_tiny_model("llama")
    draft = build_noisy_copy(target, "llama", 0.01)
    return ModelPair(
        target=SimpleNamespace(model=target, tokenizer=None), draft=SimpleNamespace(model=draft, token_map=None)
    )


ENTRIES = [Entry("fixed_tree"), Entry("linear", {"k": "3"})]
PROMPTS = [PROMPT, [2, 3, 4], [8, 1, 6, 2, 9]]


@pytest.fixture
def local_ray():
    if ray.is_initialized():  # another module's runtime (tests/test_engine.py shuts its own down)
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield ray
    ray.shutdown()


def _tokens(results) -> list:
    return [[[run.token_ids for run in rnd] for rnd in runs] for runs in results]


def test_a_comparison_on_two_workers_gives_the_one_process_outputs_a_round_of_a_prompt_each(local_ray):
    pair, config = tiny_pair(), DecodeConfig(max_new_tokens=12)
    workers = Workers(PairSource(pair=pair), count=2).start()  # the pair pickled before any run touched it
    kw = dict(config=config, repetitions=2, include_hf=False)
    stats, alone = measure(pair, ENTRIES, PROMPTS, **kw)
    progress = []
    spread, fanned = measure(pair, ENTRIES, PROMPTS, workers=workers, on_progress=lambda *a: progress.append(a), **kw)
    assert _tokens(fanned) == _tokens(alone)  # results[entry][round][prompt], the same layout and outputs
    assert [s.exact for s in spread] == [s.exact for s in stats] == [6, 6, 6]  # every run equals ar's
    assert [s.label for s in spread] == [s.label for s in stats]
    assert len({p["pid"] for p in workers.places}) == 2 and all(p["threads"] == 1 for p in workers.places)
    assert progress[-1][:2] == (18, 18) and len(progress) == 6  # a round of a prompt a report: 2 x 3 units of 3 runs
    with pytest.raises(DynaTreeError, match="not watched"):
        measure(pair, ENTRIES, PROMPTS, workers=workers, on_record=lambda *a: None, **kw)
    workers.stop()


def test_on_a_two_node_cluster_the_workers_land_one_per_node():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="warning")
    try:
        cluster.wait_for_nodes()
        pair = tiny_pair()
        workers = Workers(PairSource(pair=pair)).start()  # one per node: each holds its node's one CPU
        assert len(workers.actors) == 2
        assert len({p["node"] for p in workers.places}) == 2
        kw = dict(config=DecodeConfig(max_new_tokens=8), repetitions=1, include_hf=False)
        _, alone = measure(pair, ENTRIES, PROMPTS[:2], **kw)
        _, fanned = measure(pair, ENTRIES, PROMPTS[:2], workers=workers, **kw)
        assert _tokens(fanned) == _tokens(alone)
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_bench_and_compare_run_on_ray_from_the_cli(tiny_pair_dirs, tmp_path, capsys, local_ray):
    from dynatree_core.cli import main

    target, draft = tiny_pair_dirs
    models = ["--target", target, "--draft", draft, "--max-new-tokens", "6", "--no-hf"]
    out = tmp_path / "bench.json"
    args = ["bench", *models, "--policies", "fixed_tree", "--limit", "2", "--warmup", "0"]
    assert main([*args, "--ray", "--ray-workers", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [w["threads"] for w in report["environment"]["workers"]] == [1, 1]
    assert len(report["prompts"]) == 4 and all(row["exact"] for row in report["prompts"])
    assert [r["label"] for r in report["results"]] == ["ar (our loop)", "fixed_tree"]
    capsys.readouterr()
    compare = ["compare", *models, "--prompt", "Hello", "--policy", "fixed_tree", "--repetitions", "2", "--json"]
    assert main([*compare, "--ray"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["correctness"]["ok"] and len(shown["environment"]["workers"]) == 1  # one node here: one worker
    assert main([*args, "--ray-workers", "2"]) == 2
    assert "--ray-workers needs --ray" in capsys.readouterr().err


def test_on_a_two_node_cluster_pairs_spread_and_an_auto_replica_serves_a_second_session(tiny_pair_dirs, monkeypatch):
    from ray.cluster_utils import Cluster

    from dynatree_core.decoding.engine import generate
    from dynatree_core.decoding.methods import make_method
    from dynatree_core.decoding.pairs import load_pair
    from dynatree_core.live.engine import Engine, PairSpec
    from dynatree_core.live.engine_run import EngineRun
    from dynatree_core.live.pool import AUTO, EnginePool

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("DYNATREE_MAX_PAIRS", "2")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="error")
    pool = EnginePool(replicas=AUTO)
    try:
        cluster.wait_for_nodes()
        assert Engine.nodes() == 2 and pool.limit == 4
        target, draft = tiny_pair_dirs
        tree_pair, self_pair = PairSpec(target, draft, threads=1), PairSpec(target, None, threads=1)
        first, other = pool.get(tree_pair), pool.get(self_pair)
        nodes = {e: ray.get(e._actor.node.remote(), timeout=120) for e in (first, other)}
        assert nodes[first] == first.node and nodes[other] == other.node and first.node != other.node
        info = first.wait_ready(300)
        config = DecodeConfig(max_new_tokens=10, eos_token_ids=info.eos_token_ids, context_length=info.context_length)
        prompt = [1, 17, 4, 99, 250, 7]
        busy = EngineRun.start_in(first, prompt, make_method("fixed_tree"), settings={}, config=config)
        assert busy.step() is not None and first.load == 1  # a session's run holds the pair's one engine
        assert pool.get(tree_pair) is first  # the next session: every engine busy, so a replica starts loading
        replica = pool.engines(tree_pair)[-1]  # (the busy one serves meanwhile: a loading replica is the last choice)
        assert replica is not first and replica.node == other.node and replica.wait_ready(300)
        assert pool.get(tree_pair) is replica and len(pool.engines(tree_pair)) == 2, "ready and idle: no third"
        second = EngineRun.start_in(replica, prompt, make_method("fixed_tree"), settings={}, config=config)
        assert second.start_worker() and second.wait(300) and second.done and second.error is None
        local = load_pair(target, draft)
        want = generate(local.target.model, prompt, make_method("ar"), config=config).token_ids
        assert second.token_ids == want, "the replica decodes exact"
        busy.close()
        second.close()
    finally:
        pool.close_all()
        ray.shutdown()
        cluster.shutdown()
