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
from dynatree_core.engine import DecodeConfig, generate
from dynatree_core.errors import DynaTreeError
from dynatree_core.prompts import Prompt
from dynatree_core.session import ModelPair, encode_prompt


@dataclasses.dataclass
class PolicyRow:
    policy: str
    params: dict[str, Any]
    tokens_per_iteration: float
    acceptance_rate: float
    throughput_tps: float
    speedup_vs_ar: float  # total tokens / total wall, over ar's in the same run
    draft_forwards_per_iteration: float
    exact: int  # prompts whose tokens equal ar's
    prompts: int


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'name' or 'name:key=value,key=value'."""
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise DynaTreeError(f"policy spec {spec!r}: expected key=value, got {item!r}")
        params[key.strip()] = value.strip()
    return name.strip(), params


def compare(
    pair: ModelPair,
    specs: list[tuple[str, dict]],
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    progress=None,
) -> list[PolicyRow]:
    target = pair.target
    config = DecodeConfig(
        max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids, context_length=target.context_length
    )
    specs = [("ar", {}), *[s for s in specs if s[0] != "ar"]]
    policies = [make_policy(name, params) for name, params in specs]  # validate before running
    encoded = [encode_prompt(target.tokenizer, p.text, chat=p.chat) for p in prompts]  # as each prompt says

    def run(policy, ids):
        return generate(
            target.model,
            ids,
            policy,
            draft=pair.draft.model if pair.draft and policy.needs_draft_model else None,
            config=config,
            draft_token_map=pair.draft.token_map if pair.draft else None,
        )

    for policy in policies:  # warm-up: first calls pay for allocation and kernel selection
        run(policy, encoded[0])
    results: list[list] = [[] for _ in policies]
    for i, ids in enumerate(encoded):
        for j, policy in enumerate(policies):
            results[j].append(run(policy, ids))
            if progress:
                progress(f"prompt {i + 1}/{len(encoded)} {policy.name}")
    ar = results[0]
    ar_tps = sum(r.new_tokens for r in ar) / sum(r.wall_s for r in ar)
    rows = []
    for policy, runs in zip(policies, results, strict=True):
        tokens, wall = sum(r.new_tokens for r in runs), sum(r.wall_s for r in runs)
        iters = sum(r.iterations for r in runs)
        accepted = sum(r.mean_accepted_length * r.iterations for r in runs)
        drafted = sum(_drafted(r) for r in runs)
        rows.append(
            PolicyRow(
                policy=policy.name,
                params=dict(policy.config),
                tokens_per_iteration=tokens / iters,
                acceptance_rate=accepted / drafted if drafted else 0.0,
                throughput_tps=tokens / wall,
                speedup_vs_ar=(tokens / wall) / ar_tps,
                draft_forwards_per_iteration=statistics.fmean(r.draft_forwards / r.iterations for r in runs),
                exact=sum(r.token_ids == a.token_ids for r, a in zip(runs, ar, strict=True)),
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
        "| policy | tokens / iteration | acceptance | draft forwards / iteration | tokens / s "
        "| speedup vs ar | exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.policy} | {r.tokens_per_iteration:.2f} | {r.acceptance_rate:.2f} | "
            f"{r.draft_forwards_per_iteration:.1f} | {r.throughput_tps:.1f} | {r.speedup_vs_ar:.2f} | "
            f"{r.exact}/{r.prompts} |"
        )
    return "\n".join(out)


def stderr_progress(message: str) -> None:
    print(f"\r{message:<60}", end="", file=sys.stderr, flush=True)
