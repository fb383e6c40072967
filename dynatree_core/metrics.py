"""Reduce a run's iteration records to its summary metrics (Spec-Bench style contract).

Definitions (also in the README glossary):
  tokens_per_iteration   committed tokens / iterations (accepted drafts + bonus)
  acceptance_rate        accepted draft tokens / draft tokens the target verified
  mean_accepted_length   accepted draft tokens per iteration (bonus excluded)
  throughput_tps         new tokens / wall seconds, the prompt's prefill included
  ttft_ms                wall time of the first iteration (prefill + first verification)
  tpot_ms                (wall - ttft) / (new tokens - 1)
"""

from __future__ import annotations

from typing import Any

from dynatree_core.trace import IterationRecord, RunResult


def memory_mb(device) -> float:
    """Peak CUDA memory allocated on a GPU; the process's resident memory on CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def summarize(
    records: list[IterationRecord],
    *,
    policy: str,
    params: dict[str, Any],
    text: str,
    prompt_ids: list[int],
    target_forwards: int,
    device: str = "cpu",
    dtype: str = "float32",
) -> RunResult:
    token_ids = [t for r in records for t in r.committed]
    n_iter = len(records)
    accepted = sum(len(r.accepted) for r in records)
    drafted = sum(r.drafted for r in records)
    wall_ms = sum(r.wall_ms for r in records)
    ttft_ms = records[0].wall_ms if records else 0.0
    new = len(token_ids)
    return RunResult(
        policy=policy,
        params=dict(params),
        text=text,
        prompt_ids=list(prompt_ids),
        token_ids=token_ids,
        iterations=n_iter,
        new_tokens=new,
        target_forwards=target_forwards,
        draft_forwards=sum(r.draft_forwards for r in records),
        tokens_per_iteration=_ratio(new, n_iter),
        acceptance_rate=_ratio(accepted, drafted),
        mean_accepted_length=_ratio(accepted, n_iter),
        throughput_tps=_ratio(new, wall_ms / 1000),
        wall_s=wall_ms / 1000,
        ttft_ms=ttft_ms,
        tpot_ms=_ratio(wall_ms - ttft_ms, new - 1) if new > 1 else 0.0,
        peak_memory_mb=max((r.memory_mb for r in records), default=0.0),
        draft_ms=sum(r.draft_ms for r in records),
        verify_ms=sum(r.verify_ms for r in records),
        commit_ms=sum(r.commit_ms for r in records),
        overhead_ms=sum(r.overhead_ms for r in records),
        stop_reason=records[-1].stop if records and records[-1].stop else "none",
        device=device,
        dtype=dtype,
        records=list(records),
    )
