"""Side-by-side comparison of drafting policies on one prompt and one model pair.

Fairness protocol (what `schedule` encodes and the tests check): the same loaded models for every
run; one warm-up run per entry, discarded; then `repetitions` rounds in which every entry runs
once, the order rotated each round so that no entry always runs first (or right after a given
other one). Three references run in the same rounds: `ar` (our loop, one target forward per token),
`hf_generate` (Hugging Face's plain generate, eager) and `hf_static` (generate with a static cache,
compiled by generate on CUDA); speedups are over the fastest of them. Throughput is engine time (RunResult), so a
live view that draws between iterations does not slow the numbers it shows.

Under greedy decoding every output must equal `ar`'s token for token: `correctness` names the
first entry and position that differ. Sampled outputs differ by design (losslessness is what the
Verification Lab and the test suite check).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import statistics
from collections.abc import Callable
from typing import Any

from dynatree_core.decoding.baselines import Baseline
from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.methods import REFERENCES, make_method, verifier_for
from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.entries import Entry, labelled, run_entry, run_schedule
from dynatree_core.measure.samples import iteration_sample
from dynatree_core.runs.metrics import depth_reach
from dynatree_core.runs.records import IterationRecord, RunResult
from dynatree_core.runs.validate import check_size_and_depth
from dynatree_core.runs.validate_reports import check_comparison

COMPARE_VERSION = 1


@dataclasses.dataclass
class EntryStats:
    """One entry's numbers over its measured runs (means unless named otherwise)."""

    label: str
    policy: str
    params: dict[str, Any]
    verifier: str
    reference: bool
    runs: int  # measured runs: rounds x prompts
    throughput_tps: float  # per round: its tokens over its wall time (all prompts); mean over rounds
    throughput_std: float  # std over rounds
    speedup: float  # mean throughput over the best reference's
    tokens_per_iteration: float
    acceptance_rate: float
    mean_accepted_length: float
    iterations: float
    ttft_ms: float | None  # None for black boxes: HF generate exposes no per-step timings
    tpot_ms: float | None
    draft_ms_per_iteration: float
    verify_ms_per_iteration: float
    overhead_ms_per_iteration: float  # commit + bookkeeping
    peak_memory_mb: float
    tree_size_mean: float | None  # drafted nodes sent to the target per iteration (None: black box)
    tree_size_max: int | None
    accepted_lengths: list[int]  # every iteration of every measured run
    committed_per_iteration: list[int]  # the first measured run, iteration by iteration
    acceptance_by_depth: list[float]  # d = 1, 2, ...: P(accepted >= d | the tree reached depth d)
    token_ids: list[list[int]]  # every measured run's output (round by round, prompt by prompt)
    text: str  # the first measured run's output text
    exact: int | None = None  # greedy: runs whose output equals ar's on the same prompt
    outside_forwards_share: float | None = None  # wall time outside model forwards / wall (None: black box)
    family: str = "model"  # where its candidates come from (core/tree.FAMILIES)
    memory_overhead: float | None = None  # peak memory over ar's, minus 1
    verify_rows_mean: float | None = None  # rows per target forward (padded where queued from the device)
    sample: dict | None = None  # one typical iteration and its token texts (measure/samples.py)


@dataclasses.dataclass
class Comparison:
    prompt: str
    prompt_ids: list[int]
    models: dict[str, str]  # target, draft, device, dtype
    settings: dict[str, Any]  # max_new_tokens, temperature, top_p, top_k, verifier, seed, repetitions
    entries: list[EntryStats]
    correctness: dict[str, Any]
    # what it ran on, when and how (the CLI's reports; the page's own runs: environment and date)
    environment: dict[str, Any] | None = None
    date: str = ""
    command: str = ""

    def to_dict(self) -> dict:
        return {"version": COMPARE_VERSION, **dataclasses.asdict(self)}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> Comparison:
        if not isinstance(data, dict) or "entries" not in data or "correctness" not in data:
            raise DynaTreeError("not a DynaTree comparison file (no entries / correctness)")
        try:
            check_comparison(data)
        except ValueError as exc:
            raise DynaTreeError(f"comparison file refused: {exc}") from None
        try:
            entries = [EntryStats(**e) for e in data["entries"]]
            return cls(
                prompt=data["prompt"],
                prompt_ids=data["prompt_ids"],
                models=data["models"],
                settings=data["settings"],
                entries=entries,
                correctness=data["correctness"],
                environment=data.get("environment"),
                date=data.get("date", ""),
                command=data.get("command", ""),
            )
        except (KeyError, TypeError) as exc:
            raise DynaTreeError(f"comparison file is incomplete or from another version: {exc}") from exc

    @classmethod
    def from_json(cls, text: str | bytes) -> Comparison:
        try:
            check_size_and_depth(text)
            data = json.loads(text)
        except (json.JSONDecodeError, ValueError, RecursionError) as exc:
            raise DynaTreeError(f"not a JSON file: {exc}") from exc
        return cls.from_dict(data)

    def table(self) -> list[dict[str, Any]]:
        """One row per entry: what the page's table, the CLI and the CSV show."""
        rows = []
        for e in self.entries:
            rows.append(
                {
                    "policy": e.label,
                    "family": e.family,
                    "verifier": e.verifier,
                    "tokens/s": round(e.throughput_tps, 2),
                    "± std": round(e.throughput_std, 2),
                    "speedup": round(e.speedup, 3),
                    "tokens/iter": round(e.tokens_per_iteration, 3),
                    "acceptance": round(e.acceptance_rate, 3),
                    "accepted len": round(e.mean_accepted_length, 3),
                    "iterations": round(e.iterations, 1),
                    "TTFT ms": _round(e.ttft_ms, 1),
                    "TPOT ms": _round(e.tpot_ms, 1),
                    "draft ms/iter": _round(None if e.tree_size_mean is None else e.draft_ms_per_iteration, 2),
                    "verify ms/iter": _round(None if e.tree_size_mean is None else e.verify_ms_per_iteration, 2),
                    "overhead ms/iter": _round(None if e.tree_size_mean is None else e.overhead_ms_per_iteration, 2),
                    "peak MB": round(e.peak_memory_mb, 1),
                    "outside forwards": _round(e.outside_forwards_share, 3),
                    "tree mean": _round(e.tree_size_mean, 1),
                    "tree max": e.tree_size_max,
                    "runs": e.runs,
                }
            )
        return rows

    def csv(self) -> str:
        rows = self.table()
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()

    def markdown(self) -> str:
        rows = self.table()
        keys = [
            "policy",
            "family",
            "verifier",
            "tokens/s",
            "± std",
            "speedup",
            "tokens/iter",
            "acceptance",
            "tree mean",
        ]
        out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        out += ["| " + " | ".join("" if r[k] is None else str(r[k]) for k in keys) + " |" for r in rows]
        return "\n".join(out)


def _round_tps(runs: list[RunResult]) -> float:
    """A round's throughput: its tokens over its wall time, all prompts together."""
    return sum(r.new_tokens for r in runs) / max(sum(r.wall_s for r in runs), 1e-9)


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _depth_acceptance(records: list[IterationRecord]) -> list[float]:
    """Realised acceptance by depth: accepted >= d over iterations whose tree reached depth d."""
    reach = depth_reach(records)
    return [accepted / reached for _, (reached, accepted) in sorted(reach.items())]


def entry_stats(entry: Entry, verifier: str, rounds: list[list[RunResult]], best_reference_tps: float) -> EntryStats:
    """Summarise an entry's measured runs, given round by round (each round: one run per prompt)."""
    runs = [r for rnd in rounds for r in rnd]
    tps = [_round_tps(rnd) for rnd in rounds]
    records = [rec for r in runs for rec in r.records]
    iterations = sum(r.iterations for r in runs)

    def per_iter(total: Callable[[RunResult], float]) -> float:
        return sum(total(r) for r in runs) / iterations if iterations else 0.0

    black_box = not records
    return EntryStats(
        label=entry.label,
        policy=entry.policy,
        family=make_method(entry.policy, entry.params).configured_family(),
        params=dict(runs[0].params),
        verifier=verifier,
        reference=entry.policy in REFERENCES,
        runs=len(runs),
        throughput_tps=statistics.fmean(tps),
        throughput_std=statistics.stdev(tps) if len(tps) > 1 else 0.0,
        speedup=statistics.fmean(tps) / best_reference_tps if best_reference_tps else 0.0,
        tokens_per_iteration=sum(r.new_tokens for r in runs) / iterations if iterations else 0.0,
        acceptance_rate=statistics.fmean(r.acceptance_rate for r in runs),
        mean_accepted_length=statistics.fmean(r.mean_accepted_length for r in runs),
        iterations=iterations / len(runs),
        ttft_ms=None if black_box else statistics.fmean(r.ttft_ms for r in runs),
        tpot_ms=None if black_box else statistics.fmean(r.tpot_ms for r in runs),
        draft_ms_per_iteration=per_iter(lambda r: r.draft_ms),
        verify_ms_per_iteration=per_iter(lambda r: r.verify_ms),
        overhead_ms_per_iteration=per_iter(lambda r: r.commit_ms + r.overhead_ms),
        peak_memory_mb=max(r.peak_memory_mb for r in runs),
        tree_size_mean=None if black_box else statistics.fmean(rec.drafted for rec in records),
        tree_size_max=None if black_box else max(rec.drafted for rec in records),
        verify_rows_mean=None if black_box else statistics.fmean(rec.verify_rows for rec in records),
        accepted_lengths=[len(rec.accepted) for rec in records],
        committed_per_iteration=[len(rec.committed) for rec in runs[0].records],
        acceptance_by_depth=_depth_acceptance(records),
        token_ids=[list(r.token_ids) for r in runs],
        text=runs[0].text,
        outside_forwards_share=None
        if black_box
        else sum(rec.outside_forwards_ms for rec in records) / max(sum(rec.wall_ms for rec in records), 1e-9),
    )


def check_outputs(stats: list[EntryStats], greedy: bool) -> dict[str, Any]:
    """Greedy: every run of every entry equals ar's first output; else the first difference."""
    if not greedy:
        return {
            "checked": False,
            "ok": None,
            "message": "sampling: outputs differ by design (losslessness is checked in the Verification Lab)",
        }
    reference = next(s for s in stats if s.policy == "ar").token_ids[0]
    for s in stats:
        for tokens in s.token_ids:
            if tokens != reference:
                common = min(len(tokens), len(reference))
                position = next((i for i in range(common) if tokens[i] != reference[i]), common)
                return {
                    "checked": True,
                    "ok": False,
                    "policy": s.label,
                    "position": position,
                    "message": f"{s.label} differs from ar at generated token {position}",
                }
    return {"checked": True, "ok": True, "message": f"all {len(stats)} outputs equal ar's, token for token"}


def measure(
    pair,
    entries: list[Entry],
    prompts: list[list[int]],
    *,
    config: DecodeConfig,
    repetitions: int,
    warmup: int = 1,
    include_hf: bool = True,
    on_progress: Callable[[int, int, str], None] | None = None,
    on_record: Callable[[str, IterationRecord, RunResult | None], None] | None = None,
    tokenizer=None,
    workers=None,
) -> tuple[list[EntryStats], list[list[list[RunResult]]]]:
    """The protocol of the module docstring over one or more prompts: references first, then the
    entries, each summarised over its measured runs (ratios to the faster reference). Also
    returns the runs themselves, results[entry][round][prompt]. `workers` (cluster.Workers,
    started): the runs go to Ray actors, a round of a prompt to one of them, in the same layout."""
    if repetitions < 1:
        raise DynaTreeError("repetitions must be at least 1")
    if not prompts:
        raise DynaTreeError("no prompts to run")
    refs = reference_entries(include_hf)
    all_entries = labelled(refs + [e for e in entries if e.policy not in REFERENCES])
    policies = [make_method(e.policy, e.params) for e in all_entries]  # validate before any run
    configs = [dataclasses.replace(config, verifier=e.verifier or config.verifier) for e in all_entries]
    verifiers = [verifier_for(p, c) for p, c in zip(policies, configs, strict=True)]

    if workers is not None:  # Ray actors (measure/cluster.py): the same schedule, a round of a prompt per call
        if on_record is not None:
            raise DynaTreeError("runs on Ray workers are not watched iteration by iteration")
        kw = dict(repetitions=repetitions, warmup=warmup, seed=config.seed, on_progress=on_progress)
        results = workers.run(all_entries, configs, prompts, **kw)
    else:

        def run_one(j: int, prompt: int, seed: int) -> RunResult:
            policy, entry = policies[j], all_entries[j]
            hook = (
                None
                if on_record is None or isinstance(policy, Baseline)
                else (lambda r: on_record(entry.label, r, None))
            )
            return run_entry(pair, policy, configs[j], prompts[prompt], seed, tokenizer=tokenizer, on_record=hook)

        results = run_schedule(
            all_entries, repetitions, run_one, config.seed, on_progress, n_prompts=len(prompts), warmup=warmup
        )
    best = max(statistics.fmean(_round_tps(rnd) for rnd in results[j]) for j in range(len(refs)))
    stats = [entry_stats(e, v, rounds, best) for e, v, rounds in zip(all_entries, verifiers, results, strict=True)]
    ar = results[0]
    for s, rounds in zip(stats, results, strict=True):
        s.memory_overhead = s.peak_memory_mb / stats[0].peak_memory_mb - 1 if stats[0].peak_memory_mb else None
        if config.sampling.greedy:
            s.exact = sum(run.token_ids == ar[0][i].token_ids for rnd in rounds for i, run in enumerate(rnd))
    return stats, results


def reference_entries(include_hf: bool = True) -> list[Entry]:
    """The references every comparison runs first (methods.REFERENCES): `ar`, and unless left out
    HF generate eager and with a static cache."""
    hf = [Entry("hf_generate", label="hf_generate"), Entry("hf_static", label="hf_static")]
    return [Entry("ar", label="ar (our loop)")] + (hf if include_hf else [])


def compare(
    pair,
    entries: list[Entry],
    prompt_ids: list[int],
    *,
    config: DecodeConfig,
    repetitions: int = 3,
    include_hf: bool = True,
    prompt: str = "",
    models: dict[str, str] | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
    on_record: Callable[[str, IterationRecord, RunResult | None], None] | None = None,
    tokenizer=None,
    workers=None,
) -> Comparison:
    """One prompt, 1-6 policies (the page and `compare` CLI). on_progress(done, total, label)
    after each run; on_record(label, record, None) after each iteration of a stepped policy."""
    if not 1 <= len(entries) <= 6:
        raise DynaTreeError(f"compare 1 to 6 policies, got {len(entries)}")
    stats, results = measure(
        pair,
        entries,
        [prompt_ids],
        config=config,
        repetitions=repetitions,
        include_hf=include_hf,
        on_progress=on_progress,
        on_record=on_record,
        tokenizer=tokenizer,
        workers=workers,
    )
    for s, rounds in zip(stats, results, strict=True):  # a tree the page draws with no model loaded
        s.sample = iteration_sample(rounds[0][0].records, tokenizer and tokenizer.decode)
    return Comparison(
        prompt=prompt,
        prompt_ids=list(prompt_ids),
        models=models or {},
        settings={
            "max_new_tokens": config.max_new_tokens,
            "temperature": config.sampling.temperature,
            "top_p": config.sampling.top_p,
            "top_k": config.sampling.top_k,
            "verifier": config.verifier,
            "seed": config.seed,
            "repetitions": repetitions,
        },
        entries=stats,
        correctness=check_outputs(stats, config.sampling.greedy),
    )
