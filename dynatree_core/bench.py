"""Compare drafting policies on a prompt set, in one process: `python -m dynatree_core bench`.

Every policy runs on every prompt with the same models, interleaved prompt by prompt (so drift
in machine speed hits all policies alike), after one untimed warm-up run. Speed is reported as
a ratio to `ar` measured in the same run; every run's tokens are checked against `ar`'s.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Any

from dynatree_core.drafting import make_policy
from dynatree_core.engine import DecodeConfig, generate, resolve_verifier
from dynatree_core.errors import DynaTreeError
from dynatree_core.prompts import Prompt
from dynatree_core.sampling import SamplingConfig
from dynatree_core.session import ModelPair, encode_prompt


@dataclasses.dataclass
class PolicyRow:
    policy: str
    params: dict[str, Any]
    verifier: str  # as resolved (greedy at temperature 0)
    tokens_per_iteration: float
    acceptance_rate: float
    throughput_tps: float
    speedup_vs_ar: float  # total tokens / total wall, over ar's in the same run
    draft_forwards_per_iteration: float
    exact: int | None  # prompts whose tokens equal ar's (greedy only: sampled runs differ by design)
    prompts: int


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


def compare(
    pair: ModelPair,
    specs: list[tuple[str, dict, str]],
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    progress=None,
) -> list[PolicyRow]:
    """Interleaved runs (prompt by prompt, every spec) after one warm-up each; ratios to ar.
    Sampled runs use seed = prompt index for every spec."""
    target = pair.target
    base = DecodeConfig(
        max_new_tokens=max_new_tokens,
        eos_token_ids=target.eos_token_ids,
        context_length=target.context_length,
        sampling=sampling,
    )
    specs = [("ar", {}, "auto"), *[s for s in specs if s[0] != "ar"]]
    policies = [make_policy(name, params) for name, params, _ in specs]  # validate before running
    configs = [dataclasses.replace(base, verifier=verifier) for _, _, verifier in specs]
    verifiers = [resolve_verifier(p, c)[0] for p, c in zip(policies, configs, strict=True)]
    encoded = [encode_prompt(target.tokenizer, p.text, chat=p.chat) for p in prompts]  # as each prompt says

    def run(j, ids, seed=0):
        policy = policies[j]
        return generate(
            target.model,
            ids,
            policy,
            draft=pair.draft.model if pair.draft and policy.needs_draft_model else None,
            config=dataclasses.replace(configs[j], seed=seed),
            draft_token_map=pair.draft.token_map if pair.draft else None,
        )

    for j in range(len(policies)):  # warm-up: first calls pay for allocation and kernel selection
        run(j, encoded[0])
    results: list[list] = [[] for _ in policies]
    for i, ids in enumerate(encoded):
        for j, policy in enumerate(policies):
            results[j].append(run(j, ids, seed=i))
            if progress:
                progress(f"prompt {i + 1}/{len(encoded)} {policy.name}@{verifiers[j]}")
    ar = results[0]
    ar_tps = sum(r.new_tokens for r in ar) / sum(r.wall_s for r in ar)
    rows = []
    for policy, verifier, runs in zip(policies, verifiers, results, strict=True):
        tokens, wall = sum(r.new_tokens for r in runs), sum(r.wall_s for r in runs)
        iters = sum(r.iterations for r in runs)
        accepted = sum(r.mean_accepted_length * r.iterations for r in runs)
        drafted = sum(_drafted(r) for r in runs)
        rows.append(
            PolicyRow(
                policy=policy.name,
                params=dict(policy.config),
                verifier=verifier,
                tokens_per_iteration=tokens / iters,
                acceptance_rate=accepted / drafted if drafted else 0.0,
                throughput_tps=tokens / wall,
                speedup_vs_ar=(tokens / wall) / ar_tps,
                draft_forwards_per_iteration=statistics.fmean(r.draft_forwards / r.iterations for r in runs),
                exact=sum(r.token_ids == a.token_ids for r, a in zip(runs, ar, strict=True))
                if sampling.greedy
                else None,
                prompts=len(runs),
            )
        )
    return rows


def _drafted(result) -> float:
    """Draft tokens the target verified (from the records; a black box's from its rate)."""
    if result.records:
        return sum(rec.drafted for rec in result.records)
    accepted = result.mean_accepted_length * result.iterations
    return accepted / result.acceptance_rate if result.acceptance_rate else 0.0


def markdown(rows: list[PolicyRow]) -> str:
    out = [
        "| policy | verifier | tokens / iteration | acceptance | draft forwards / iteration | tokens / s "
        "| speedup vs ar | exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        exact = f"{r.exact}/{r.prompts}" if r.exact is not None else "n/a (sampled)"
        out.append(
            f"| {r.policy} | {r.verifier} | {r.tokens_per_iteration:.2f} | {r.acceptance_rate:.2f} | "
            f"{r.draft_forwards_per_iteration:.1f} | {r.throughput_tps:.1f} | {r.speedup_vs_ar:.2f} | "
            f"{exact} |"
        )
    return "\n".join(out)


def stderr_progress(message: str) -> None:
    print(f"\r{message:<60}", end="", file=sys.stderr, flush=True)
