"""The one-off work the pages ask of a model pair, as named jobs: a comparison, a benchmark, the
Verification Lab, one generate call (an AR reference or an HF baseline) and the latency profile.

Each job is `fn(pair, payload, emit) -> result`: `payload` is a dict of plain, picklable
arguments, `emit(kind, data)` reports progress. The same functions run in the pair's engine process
(engine.py: queued, one at a time, no live iteration between their forwards, so their
timings are the engine's alone) and, with DYNATREE_LIVE_ENGINE=thread, in the app's process under
its forward lock (ui/resources.py). Results are picklable (they cross the process boundary).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dynatree_core.decoding.engine import generate
from dynatree_core.decoding.methods import make_method, verifier_for
from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.bench import run_bench
from dynatree_core.measure.compare import compare
from dynatree_core.measure.lab import run_lab
from dynatree_core.measure.latency import pair_profile

Emit = Callable[[str, Any], None]
RECORD_EVERY_S = 0.5  # live trees of a running comparison: at most two a second cross to the page


def compare_job(pair, payload: dict, emit: Emit):
    """measure/compare.py `compare` on the pair. Emits ("progress", (done, total, label)) after each
    run and ("record", (label, record)) for the latest iteration, at most every RECORD_EVERY_S."""
    last = [0.0]

    def on_record(label, rec, _result) -> None:
        now = time.monotonic()
        if now - last[0] >= RECORD_EVERY_S:
            last[0] = now
            emit("record", (label, rec))

    return compare(
        pair,
        payload["entries"],
        payload["prompt_ids"],
        config=payload["config"],
        repetitions=payload["repetitions"],
        include_hf=payload["include_hf"],
        prompt=payload.get("prompt", ""),
        models=payload.get("models"),
        on_progress=lambda done, total, label: emit("progress", (done, total, label)),
        on_record=on_record,
        tokenizer=pair.target.tokenizer,
    )


def bench_job(pair, payload: dict, emit: Emit):
    """measure/bench.py `run_bench` on the pair (prompts are encoded with its tokenizer)."""
    return run_bench(
        pair,
        payload["entries"],
        payload["prompts"],
        config=payload["config"],
        repeats=payload["repeats"],
        include_hf=payload["include_hf"],
        max_prompt_tokens=payload.get("max_prompt_tokens"),
        progress=lambda done, total, label: emit("progress", (done, total, label)),
    )


def lab_job(pair, payload: dict, emit: Emit):
    """measure/lab.py `run_lab`: `trials` single steps of a policy on a fixed context."""
    policy = make_method(payload["policy"], payload["params"])
    config, trials = payload["config"], payload["trials"]
    verifier_for(policy, config)  # an invalid pairing is refused before any work
    return run_lab(
        pair.target.model,
        payload["context"],
        policy,
        config,
        trials,
        **pair.drafting(policy),
        progress=lambda i: emit("progress", (i, trials, "step")),
    )


def generate_job(pair, payload: dict, emit: Emit):
    """One `generate` call: an AR reference (methods.REFERENCES) or an HF baseline, timed alone."""
    policy = make_method(payload["method"], payload.get("params"))
    return generate(
        pair.target.model,
        payload["prompt_ids"],
        policy,
        config=payload["config"],
        tokenizer=pair.target.tokenizer,
        **pair.drafting(policy),
    )


def latency_job(pair, payload: dict, emit: Emit):
    """The pair's forward latency profile (measure/latency.py): context 128, 1-64 new tokens."""
    return pair_profile(pair, (1, 2, 4, 8, 16, 32, 64), (128,), repeats=3)


JOBS: dict[str, Callable[[Any, dict, Emit], Any]] = {
    "compare": compare_job,
    "bench": bench_job,
    "lab": lab_job,
    "generate": generate_job,
    "latency": latency_job,
}
JOB_TITLES = {  # what a page waiting behind a job calls it
    "compare": "a comparison",
    "bench": "a benchmark",
    "lab": "a Verification Lab run",
    "generate": "a reference or baseline run",
    "latency": "a latency profile",
}


def run_job(pair, name: str, payload: dict, emit: Emit) -> Any:
    """Run job `name` on a loaded pair (in whichever process holds it)."""
    if name not in JOBS:
        raise DynaTreeError(f"{name!r} is not a job ({', '.join(JOBS)})")
    return JOBS[name](pair, payload, emit)
