"""Two sessions on one pair: iterations per second with one engine against two replicas.

The classroom case: two students run the same pair at once. With one engine (the pool's default)
their runs take turns an iteration each; with two replicas (DYNATREE_REPLICAS=2) each run gets its
own engine and its share of the cores. Each way starts a pool of engines (Ray actors, live/engine.py)
as the app does, with the app's threads (one engine:
every core but one, the app's share; two: half the cores each), waits for them to load, then
starts two live fixed_tree runs of the embedded pair at once and times them from the first start
to the last finish: iterations of both runs / seconds. The ways alternate, `--rounds` times each.

    PYTHONPATH=. .venv/bin/python -m benchmarks.replicas [--rounds 2] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks import RESULTS
from dynatree_core.core.threads import available_cores
from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.methods import make_method
from dynatree_core.decoding.pairs import encode_prompt
from dynatree_core.live.engine import Engine, PairSpec
from dynatree_core.live.engine_run import EngineRun
from dynatree_core.live.pool import EnginePool
from dynatree_core.measure.prompt_sets import load_prompts
from dynatree_core.runs.environment import environment

PROMPTS = 2  # the first OOD prompts, one a session


def sessions(pool: EnginePool, spec: PairSpec, tokens: int) -> dict:
    """Two runs started at once on the pair's engines (least loaded each), timed to both finishing."""
    info = pool.get(spec).wait_ready()
    ids = [encode_prompt(info.tokenizer, p.text, chat=p.chat, history=p.history) for p in load_prompts("ood")[:PROMPTS]]
    config = DecodeConfig(max_new_tokens=tokens, eos_token_ids=frozenset(), context_length=info.context_length)
    t0 = time.perf_counter()
    runs = []
    for prompt in ids:
        engine = pool.get(spec)  # the least loaded replica: a started run counts in its engine's load
        engine.wait_ready()
        runs.append(EngineRun.start_in(engine, prompt, make_method("fixed_tree"), settings={}, config=config))
        runs[-1].start_worker()
    for run in runs:
        run.wait(600)
    wall = time.perf_counter() - t0
    iterations = sum(len(run.records) for run in runs)
    engines = {id(run.backend._engine) for run in runs}
    for run in runs:
        run.close()
    return {"iterations": iterations, "wall_s": round(wall, 3), "iterations_per_s": round(iterations / wall, 2),
            "engines_used": len(engines), "tokens": [len(run.token_ids) for run in runs]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--out", default=str(RESULTS / "cpu-replicas.json"))
    args = parser.parse_args(argv)
    start = Engine
    spec = PairSpec("embedded", None)
    out = {"command": "PYTHONPATH=. .venv/bin/python -m benchmarks.replicas " + " ".join(argv or []),
           "engine": "ray", "cores": available_cores(), "tokens": args.tokens, "runs": []}  # fmt: skip
    for _ in range(args.rounds):
        for replicas in (1, 2):
            pool = EnginePool(limit=4, start=start, replicas=replicas)
            pool.get(spec)  # starts every replica
            for engine in pool.engines(spec):  # loaded and warmed up before the sessions start
                engine.wait_ready()
            measured = sessions(pool, spec, args.tokens)
            measured["replicas"] = replicas
            out["runs"].append(measured)
            print(json.dumps(measured), flush=True)
            pool.close_all()
    rate = {r: statistics.fmean(m["iterations_per_s"] for m in out["runs"] if m["replicas"] == r) for r in (1, 2)}
    out["iterations_per_s"] = {str(r): round(v, 2) for r, v in rate.items()}
    out["two_over_one"] = round(rate[2] / rate[1], 3)
    out["environment"] = environment("cpu", "auto", True, "")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(f"two replicas / one: {out['two_over_one']}x ({out['iterations_per_s']})")


if __name__ == "__main__":
    main()
