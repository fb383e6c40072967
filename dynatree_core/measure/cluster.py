"""A comparison's or a benchmark's runs fanned out over Ray actors, one per GPU or per node.

Ray places actors by resources across a cluster's nodes and runs one actor's method calls in
order. `connect` starts a local runtime on first use (nothing to set up), or joins the cluster that
DYNATREE_RAY_ADDRESS (else Ray's own RAY_ADDRESS) names. The library imports Ray only inside
functions, when it is used: here for workers (`bench --ray`, `compare --ray`), through `connect`
for the live engines (live/actor.py).

The unit of work is one round of one prompt: every entry of the comparison runs it, in the
schedule's rotated order (entries.schedule), on ONE worker, so every ratio a report gives is
between runs on one machine. A worker loads its own pair once, and warms up on the first prompt
it is given before its first unit, as a one-process run does; units go to the workers round-robin
and come back in the one-process layout, results[entry][round][prompt]. Each run is timed alone
on its worker: a worker holds every CPU of its node (or one GPU), so no two runs share cores.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import threading
from collections.abc import Callable

import torch

from dynatree_core.core.settings import env, ray_starts_only_when_asked
from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.methods import make_method
from dynatree_core.decoding.pairs import load_pair
from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.entries import Entry, rotation, run_entry
from dynatree_core.runs.records import RunResult


def connect():
    """Ray, initialised: this process's runtime if it has one, else the cluster DYNATREE_RAY_ADDRESS
    or RAY_ADDRESS names, else a new local runtime (the dashboard off)."""
    # Ray starts itself on any call made while it is not running (RAY_ENABLE_AUTO_CONNECT), in whatever
    # thread made it, and a local runtime dies with the thread that started it: a stray call (an
    # engine's handle after a shutdown) would start a runtime that dies a moment later and takes this
    # process's connection with it. Here Ray starts only through this function, unless the user says otherwise.
    no_auto_start = ray_starts_only_when_asked()
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - ray is in requirements.txt
        raise DynaTreeError("running on Ray needs the ray package: pip install 'ray==2.60.0'") from exc
    if no_auto_start:  # read when Ray was first imported, which may have been before this call
        from ray._private import auto_init_hook

        auto_init_hook.enable_auto_connect = False
    with _STARTING:
        if not ray.is_initialized():
            _init_in_a_lasting_thread(ray, env("DYNATREE_RAY_ADDRESS") or None)  # None: RAY_ADDRESS, else local
    return ray


_STARTING = threading.Lock()
START_TIMEOUT_S = 120.0  # Ray's start, or joining a cluster
LOAD_TIMEOUT_S = 900.0  # a worker's load of its pair
UNIT_TIMEOUT_S = 3600.0  # a round of one prompt, every entry, on one worker


def _init_in_a_lasting_thread(ray, address: str | None) -> None:
    """ray.init in a thread that lives as long as this process. A local runtime's processes (GCS,
    raylet) die with the THREAD that started them (Linux's parent-death signal follows the thread),
    and a Streamlit page's script runs in a thread that ends with the run: started there, the
    runtime would be killed a moment later."""
    started, failed = threading.Event(), []

    def keep() -> None:
        try:
            ray.init(address=address, include_dashboard=False, logging_level="error")  # not its SIGTERM note
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            failed.append(exc)
        started.set()
        if not failed:
            threading.Event().wait()  # never set: the thread (and Ray's processes) last until the process ends

    threading.Thread(target=keep, name="dynatree-ray", daemon=True).start()
    if not started.wait(START_TIMEOUT_S):
        raise DynaTreeError(
            f"Ray did not start within {START_TIMEOUT_S:.0f} s (address: {address or 'a local runtime'})"
        )
    if failed:
        raise DynaTreeError(f"Ray did not start: {failed[0]}") from failed[0]


@dataclasses.dataclass(frozen=True)
class PairSource:
    """What a worker loads: decoding.pairs.load_pair's arguments (a pair is loaded where it runs,
    never shipped: a packed CPU model does not pickle), or, for tests, a picklable `pair` itself."""

    target: str = ""
    draft: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    pack: bool = True
    pair: object = None

    def load(self):
        if self.pair is not None:
            return self.pair
        return load_pair(self.target, self.draft, device=self.device, dtype=self.dtype, pack=self.pack)


class PairWorker:
    """One worker: its pair, the comparison's entries and prompts, and the units it is given."""

    def __init__(self, source: PairSource, threads: int):
        if threads:
            torch.set_num_threads(threads)  # Ray sets one thread per actor unless told
        self.pair = source.load()
        self.warmed = False
        self.policies: dict = {}

    def where(self) -> dict:
        """Where this worker runs: its host, device, CPU threads and Ray node."""
        import ray

        model = self.pair.target.model
        device = str(model.get_input_embeddings().weight.device)
        return {
            "host": platform.node(),
            "node": ray.get_runtime_context().get_node_id(),
            "device": device,
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }

    def unit(self, shared: tuple, job: tuple) -> list[tuple[int, RunResult]]:
        """One round of one prompt (`job` = (round, prompt, seed, warmup)): every entry once, in the
        round's rotated order, after this worker's warm-up rounds on that prompt (the base `seed`)
        if it has not warmed up yet. `shared`: the comparison's (entries, their configs, prompts).
        Returns [(entry index, RunResult)] of the measured runs."""
        entries, configs, prompts = shared
        rnd, prompt, seed, warmup = job
        if not self.warmed:
            for w in range(-warmup, 0):
                for j in rotation(len(entries), w):
                    self._run(j, entries[j], configs[j], prompts[prompt], seed)
            self.warmed = True
        order = rotation(len(entries), rnd)
        return [(j, self._run(j, entries[j], configs[j], prompts[prompt], seed + rnd)) for j in order]

    def _run(self, j: int, entry: Entry, config: DecodeConfig, prompt_ids: list[int], seed: int) -> RunResult:
        if j not in self.policies:  # one policy object an entry, as in one process (its history resets per run)
            self.policies[j] = make_method(entry.policy, entry.params)
        return run_entry(self.pair, self.policies[j], config, prompt_ids, seed)


@dataclasses.dataclass
class Workers:
    """Ray actors, each holding one pair: `start` places them, `run` fans a schedule out over them."""

    source: PairSource
    count: int = 0  # 0: one per GPU of the cluster (a CUDA pair), else one per node
    actors: list = dataclasses.field(default_factory=list)
    places: list[dict] = dataclasses.field(default_factory=list)

    def start(self) -> Workers:
        ray = connect()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        cuda = self.source.device.startswith("cuda") or (self.source.device == "auto" and _gpus(nodes) > 0)
        count = self.count or (_gpus(nodes) if cuda else len(nodes)) or 1
        if cuda:
            options = dict(num_gpus=1, num_cpus=1)
            threads = 0
        else:  # every CPU of the smallest node (a worker per node), or a share where more workers than nodes
            cpus = min(int(n["Resources"].get("CPU", 1)) for n in nodes)
            share = max(1, cpus * len(nodes) // count) if count > len(nodes) else cpus
            options, threads = dict(num_cpus=share), share
        remote = ray.remote(PairWorker).options(scheduling_strategy="SPREAD", **options)
        self.actors = [remote.remote(self.source, threads) for _ in range(count)]
        try:
            self.places = ray.get([a.where.remote() for a in self.actors], timeout=LOAD_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.stop()
            raise DynaTreeError(f"Ray workers did not load the pair within {LOAD_TIMEOUT_S:.0f} s") from None
        return self

    def run(
        self,
        entries: list[Entry],
        configs: list[DecodeConfig],
        prompts: list[list[int]],
        *,
        repetitions: int,
        warmup: int,
        seed: int,
        on_progress: Callable[[int, int, str], None] | None = None,
    ) -> list[list[list[RunResult]]]:
        """The schedule's rounds of every prompt as units over the workers (module docstring): the
        one-process layout, results[entry][round][prompt]."""
        ray = connect()
        units = [(r, i) for r in range(repetitions) for i in range(len(prompts))]
        shared = ray.put((entries, configs, prompts))  # once to the object store; each call reads it there
        pending = {}
        for n, (r, i) in enumerate(units):
            actor = self.actors[n % len(self.actors)]
            pending[actor.unit.remote(shared, (r, i, seed, warmup))] = (r, i)
        results: list[list[list]] = [[[None] * len(prompts) for _ in range(repetitions)] for _ in entries]
        done = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=UNIT_TIMEOUT_S)
            if not ready:
                self.stop()
                raise DynaTreeError(f"no round of a prompt finished on the Ray workers within {UNIT_TIMEOUT_S:.0f} s")
            r, i = pending.pop(ready[0])
            for j, result in ray.get(ready[0]):
                results[j][r][i] = result
            done += len(entries)
            if on_progress:
                where = f", prompt {i + 1}/{len(prompts)}" if len(prompts) > 1 else ""
                on_progress(done, len(units) * len(entries), f"round {r + 1}{where}")
        return results

    def stop(self) -> None:
        ray = connect()
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def _gpus(nodes: list[dict]) -> int:
    return int(sum(n["Resources"].get("GPU", 0) for n in nodes))
