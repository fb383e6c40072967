"""What a comparison or a benchmark runs, and in which order: entries (a registered policy or
baseline with its parameters, its own verifier and a unique label), parsed from the CLI's specs
('name:key=value,...@verifier'), and the fairness schedule that interleaves them (compare.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dynatree_core.decoding.engine import generate
from dynatree_core.decoding.methods import make_method, method_class
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.records import RunResult


def parse_spec(spec: str) -> tuple[str, dict[str, str], str]:
    """'name', 'name:key=value,key=value', either with '@verifier' appended."""
    spec, _, verifier = spec.partition("@")
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise DynaTreeError(f"policy spec {spec!r}: expected key=value, got {item!r}")
        params[key.strip()] = value.strip()
    return name.strip(), params, verifier.strip() or "auto"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One contestant: a registered policy with its parameters and a unique label."""

    policy: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    label: str = ""
    verifier: str = ""  # "" : the run's verifier (DecodeConfig.verifier)


def labelled(entries: list[Entry]) -> list[Entry]:
    """Give every entry a unique label: the policy name (with @verifier when it has its own), plus
    the parameters that differ from the registry defaults when the same name appears more than
    once (then #2, #3 if still equal)."""
    bases = [e.policy + (f"@{e.verifier}" if e.verifier else "") for e in entries]
    out, seen = [], {}
    for e, base in zip(entries, bases, strict=True):
        label = e.label or base
        if not e.label and bases.count(base) > 1:
            config = make_method(e.policy, e.params).config
            defaults = make_method(e.policy).config
            changed = [f"{k}={v}" for k, v in config.items() if v != defaults[k]]
            label = f"{base} ({', '.join(changed)})" if changed else base
        seen[label] = seen.get(label, 0) + 1
        out.append(dataclasses.replace(e, label=label if seen[label] == 1 else f"{label} #{seen[label]}"))
    return out


def schedule(n_entries: int, repetitions: int, n_prompts: int = 1, warmup: int = 1) -> list[tuple[int, int, int]]:
    """(round, prompt index, entry index) in run order. Rounds -warmup..-1 are discarded warm-ups
    on the first prompt; in round r every entry runs each prompt once, prompt by prompt, the
    entries' order rotated by r so that no entry always runs first."""
    plan = [(r, 0, j) for r in range(-warmup, 0) for j in range(n_entries)]
    for r in range(repetitions):
        for i in range(n_prompts):
            plan += [(r, i, j) for j in rotation(n_entries, r)]
    return plan


def rotation(n_entries: int, round_: int) -> list[int]:
    """The entries' order in round `round_`: rotated by the round, so no entry always runs first."""
    return [(j + round_) % n_entries for j in range(n_entries)]


def run_entry(pair, policy, config, prompt_ids: list[int], seed: int, *, tokenizer=None, on_record=None) -> RunResult:
    """One run of `policy` (decoding.methods.make_method's) on `pair` with `config` seeded `seed`."""
    drafting = pair.drafting(policy)
    config = dataclasses.replace(config, seed=seed)
    return generate(
        pair.target.model, prompt_ids, policy, config=config, tokenizer=tokenizer, on_record=on_record, **drafting
    )


def parse_entries(specs: list[str]) -> list[Entry]:
    """CLI specs 'name' or 'name:key=value,...' -> entries (unknown policies named)."""
    out = []
    for spec in specs:
        name, params, verifier = parse_spec(spec)
        if verifier != "auto":
            raise DynaTreeError("compare uses one verifier for every policy: pass --verifier, not NAME@VERIFIER")
        method_class(name)  # an unknown name is refused here, with the known ones
        out.append(Entry(name, params))
    return out


def run_schedule(
    entries: list[Entry],
    repetitions: int,
    run_one: Callable[[int, int, int], RunResult],
    seed: int = 0,
    on_progress: Callable[[int, int, str], None] | None = None,
    *,
    n_prompts: int = 1,
    warmup: int = 1,
) -> list[list[list[RunResult]]]:
    """Run `schedule` with run_one(entry index, prompt index, seed); warm-ups are dropped.
    Returns results[entry][round][prompt]. Round r uses seed + r for every entry and prompt (the
    warm-ups use seed), so sampled entries see the same seeds."""
    plan = schedule(len(entries), repetitions, n_prompts, warmup)
    results: list[list[list[RunResult]]] = [[[] for _ in range(repetitions)] for _ in entries]
    for done, (rnd, prompt, j) in enumerate(plan, 1):
        result = run_one(j, prompt, seed + max(rnd, 0))
        if rnd >= 0:
            results[j][rnd].append(result)
        if on_progress:
            where = " (warm-up)" if rnd < 0 else (f", prompt {prompt + 1}/{n_prompts}" if n_prompts > 1 else "")
            on_progress(done, len(plan), entries[j].label + where)
    return results
