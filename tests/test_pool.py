"""The server's resident pairs (live/pool.py): one engine per pair, at most DYNATREE_MAX_PAIRS a
node, the least recently used idle one closed to make room, and one in use never closed; replicas,
by number or automatic; where an engine goes (live/actor.place) on a cluster's nodes."""

from __future__ import annotations

import pytest

from dynatree_core.errors import DynaTreeError
from dynatree_core.live import actor
from dynatree_core.live import pool as pool_module
from dynatree_core.live.engine import PairSpec
from dynatree_core.live.pool import EnginePool, PoolFull, max_pairs


class FakeEngine:
    """An engine's lifecycle without a process: `in_use` and `alive` set by the test."""

    def __init__(self, spec: PairSpec):
        self.spec, self.alive, self.in_use, self.closed = spec, True, False, False

    def close(self) -> None:
        self.closed, self.alive = True, False


def _specs(n: int) -> list[PairSpec]:
    return [PairSpec(f"target-{i}", None) for i in range(n)]


@pytest.fixture(autouse=True)
def no_handoff(monkeypatch):
    monkeypatch.setattr(pool_module, "HANDOFF_S", 0.0)  # an engine counts as used only by its runs and jobs


def test_one_engine_per_pair_shared_by_every_request():
    pool = EnginePool(limit=2, start=FakeEngine)
    a, b = _specs(2)
    assert pool.get(a) is pool.get(a) and pool.get(b) is not pool.get(a)
    assert [s for s, _ in pool.resident()] == [b, a], "least recently used first"


def test_the_least_recently_used_idle_pair_makes_room():
    pool = EnginePool(limit=2, start=FakeEngine)
    a, b, c = _specs(3)
    ea, eb = pool.get(a), pool.get(b)
    pool.get(a)  # a used again: b is now the least recently used
    ec = pool.get(c)
    assert eb.closed and not ea.closed and not ec.closed
    assert {s for s, _ in pool.resident()} == {a, c}


def test_a_pair_in_use_is_never_closed_and_the_newcomer_gets_a_message():
    pool = EnginePool(limit=2, start=FakeEngine)
    a, b, c = _specs(3)
    ea, eb = pool.get(a), pool.get(b)
    ea.in_use = eb.in_use = True
    with pytest.raises(PoolFull) as info:
        pool.get(c)
    text = str(info.value)
    assert "DYNATREE_MAX_PAIRS" in text and "target-0" in text and "target-1" in text and "target-2" in text
    assert not ea.closed and not eb.closed and isinstance(info.value, DynaTreeError)
    eb.in_use = False
    assert pool.get(c) is not None and eb.closed and not ea.closed


def test_an_engine_just_handed_out_is_kept_until_its_user_registers(monkeypatch):
    monkeypatch.setattr(pool_module, "HANDOFF_S", 60.0)
    pool = EnginePool(limit=1, start=FakeEngine)
    a, b = _specs(2)
    pool.get(a)
    with pytest.raises(PoolFull):
        pool.get(b)


def test_a_dead_engine_is_replaced():
    pool = EnginePool(limit=1, start=FakeEngine)
    (a,) = _specs(1)
    first = pool.get(a)
    first.alive = False
    second = pool.get(a)
    assert second is not first and first.closed and second.alive


def test_discard_forgets_only_the_engine_it_names():
    pool = EnginePool(limit=2, start=FakeEngine)
    (a,) = _specs(1)
    first = pool.get(a)
    first.alive = False
    second = pool.get(a)
    pool.discard(a, first)
    assert pool.get(a) is second
    pool.discard(a, second)
    assert second.closed and pool.resident() == []


@pytest.mark.parametrize(("raw", "ok"), [("3", 3), ("0", None), ("two", None), ("", "default")])
def test_the_limit_is_a_setting(monkeypatch, raw, ok):
    monkeypatch.setenv("DYNATREE_MAX_PAIRS", raw)
    if ok is None:
        with pytest.raises(DynaTreeError, match="DYNATREE_MAX_PAIRS"):
            max_pairs()
    elif ok == "default":
        assert 1 <= max_pairs() <= actor.MAX_DEFAULT_PAIRS
    else:
        assert max_pairs() == ok


def test_the_default_limit_holds_the_shipped_pairs_on_this_machine():
    """24 GiB here: the three offline pairs (embedded, embedded-token, embedded-eagle3) stay loaded."""
    if actor._memory_gib() < 18:
        pytest.skip("a machine with less memory keeps fewer pairs")
    assert max_pairs() >= 3


@pytest.mark.parametrize("name", ["DYNATREE_LOAD_TIMEOUT", "DYNATREE_JOB_TIMEOUT"])
def test_the_waits_are_settings(monkeypatch, name):
    from dynatree_core.live.engine import load_timeout_s
    from dynatree_core.ui.resources import job_timeout_s

    read = load_timeout_s if name == "DYNATREE_LOAD_TIMEOUT" else job_timeout_s
    monkeypatch.setenv(name, "42")
    assert read() == 42.0
    for bad in ("soon", "0", "-5"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(DynaTreeError, match=name):
            read()


class LoadedEngine(FakeEngine):
    """A FakeEngine with a load (its unfinished runs and jobs) and a readiness, set by the test."""

    def __init__(self, spec: PairSpec):
        super().__init__(spec)
        self.load, self.ready = 0, True


def test_replicas_start_together_and_a_new_run_goes_to_the_least_loaded_with_a_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(pool_module, "available_cores", lambda: 4)
    pool = EnginePool(limit=4, start=LoadedEngine, replicas=2)
    (a,) = _specs(1)
    first = pool.get(a)
    first.load = 1  # a session's run holds it
    second = pool.get(a)
    assert second is not first and {first.spec.threads, second.spec.threads} == {2}
    assert second.spec.target == a.target and [s for s, _ in pool.resident()] == [a]
    second.load = 2
    assert pool.get(a) is first  # the least loaded
    first.ready = False
    assert pool.get(a) is second  # a replica still loading is the last choice
    first.ready = True
    first.alive = False  # died: replaced by a new replica
    third = pool.get(a)
    assert third not in (first, second) and third.load == 0 and first.closed
    assert pool.engines(a) == [second, third]
    pool.close_all()
    assert second.closed and third.closed and pool.resident() == []


def test_replicas_count_toward_the_limit_and_a_pair_serves_with_the_replicas_that_fit(monkeypatch):
    pool = EnginePool(limit=3, start=LoadedEngine, replicas=2)
    a, b = _specs(2)
    ea = pool.get(a)
    ea.in_use = True
    eb = pool.get(b)  # one engine of room left: b gets one replica, not two
    assert eb is pool.get(b) and sum(1 for _ in pool.resident()) == 2
    monkeypatch.setenv("DYNATREE_REPLICAS", "3")
    assert EnginePool(start=LoadedEngine).replicas == 3
    monkeypatch.setenv("DYNATREE_REPLICAS", "0")
    with pytest.raises(DynaTreeError, match="DYNATREE_REPLICAS must be at least 1"):
        EnginePool(start=LoadedEngine)


class TwoNodes(LoadedEngine):
    """A LoadedEngine on a two-node cluster: the pool's limit and auto replicas count the nodes."""

    @staticmethod
    def nodes() -> int:
        return 2


def test_auto_replicas_add_one_a_node_while_every_engine_of_the_pair_is_busy(monkeypatch):
    monkeypatch.setattr(actor, "max_pairs", lambda: 2)
    monkeypatch.setattr(pool_module, "max_pairs", lambda: 2)
    pool = EnginePool(start=TwoNodes, replicas=pool_module.AUTO)
    assert pool.limit == 4, "DYNATREE_MAX_PAIRS a node, times the nodes"
    (a,) = _specs(1)
    first = pool.get(a)
    assert pool.get(a) is first and pool.engines(a) == [first], "an idle engine: no replica"
    first.load = 1  # a session's run holds it: the next session gets a replica on the other node
    second = pool.get(a)
    assert second is not first and first.spec.threads is second.spec.threads is None, "a node each: every core"
    second.load = 1
    assert pool.get(a) in (first, second) and len(pool.engines(a)) == 2, "one a node at most"
    one_node = EnginePool(limit=4, start=LoadedEngine, replicas=pool_module.AUTO)
    alone = one_node.get(a)
    alone.load = 3
    assert one_node.get(a) is alone, "one machine: auto never splits its cores"
    monkeypatch.setenv("DYNATREE_REPLICAS", "auto")
    assert EnginePool(start=LoadedEngine).replicas == pool_module.AUTO


def test_a_full_node_makes_room_as_the_limit_does(monkeypatch):
    """Where the nodes that could take an engine are full (actor.NodesFull: a CUDA pair's GPU
    nodes), an idle pair is closed and the start tried again; with none idle, the message."""
    full = {"now": True}

    class GpuNodes(LoadedEngine):
        def __init__(self, spec):
            if spec.target == "target-2" and full["now"]:
                full["now"] = False
                raise actor.NodesFull("every node with a GPU holds 2 engine(s)")
            super().__init__(spec)

    pool = EnginePool(limit=8, start=GpuNodes)
    a, b, c = _specs(3)
    ea, eb = pool.get(a), pool.get(b)
    ea.in_use = True
    assert pool.get(c) is not None and eb.closed and not ea.closed
    full["now"], eb2 = True, pool.get(b)
    eb2.in_use = True
    pool.get(a).in_use = True
    pool.discard(c, pool.get(c))
    full["now"] = True
    with pytest.raises(actor.NodesFull, match="GPU"):
        pool.get(c)


class FakeRay:
    """ray.nodes() of a cluster: `cpu` nodes, then `gpu` nodes with one GPU each, the head first."""

    def __init__(self, cpu: int, gpu: int = 0):
        self.list = [
            {"NodeID": f"n{i}", "Alive": True, "Resources": {"CPU": 2, **({"GPU": 1} if i >= cpu else {})}}
            for i in range(cpu + gpu)
        ]
        self.list[0]["Resources"]["node:__internal_head__"] = 1

    def nodes(self):
        return list(reversed(self.list))  # Ray's order is not the head's first


def test_engines_go_to_nodes_with_room_a_replica_where_its_pair_is_not(monkeypatch):
    monkeypatch.setattr(actor, "_PLACED", actor.collections.Counter())
    monkeypatch.setenv("DYNATREE_MAX_PAIRS", "2")
    ray = FakeRay(cpu=2, gpu=1)
    a, b = _specs(2)
    assert actor.place(ray, a) == "n0", "the head first on ties"
    assert actor.place(ray, PairSpec(a.target, None, threads=1)) == "n1", "a replica (any threads) where a is not"
    assert actor.place(ray, b) == "n2" and actor.place(ray, b) == "n0", "the fewest engines, then the head"
    cuda = PairSpec("big", None, device="cuda")
    assert actor.place(ray, cuda) == "n2", "a CUDA pair only on a GPU node"
    with pytest.raises(actor.NodesFull, match="every node with a GPU holds 2"):
        actor.place(ray, cuda)
    actor.unplace("n2", cuda)
    assert actor.place(ray, cuda) == "n2", "an ended engine's room is free again"
    assert actor.place(ray, b) == "n1"
    with pytest.raises(actor.NodesFull, match="3 node"):
        actor.place(ray, PairSpec("c", None))
