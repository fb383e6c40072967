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


def exactness_note(dtype: str) -> str | None:
    """What a reduced-precision run promises about greedy exactness (None for float32: identical).

    The algorithm is exact in any dtype; the arithmetic is not. A tree forward computes a token's
    logits in a different batch shape than `ar`'s 1-token forward, and in bfloat16/float16 the
    rounding differs enough to flip the argmax where two tokens nearly tie (issue 16, item 3)."""
    if str(dtype).removeprefix("torch.") in ("float32", "float64"):
        return None
    return (
        f"In {str(dtype).removeprefix('torch.')}, greedy outputs can differ from `ar`'s at near-ties: the tree "
        "forward rounds differently from a 1-token forward (numerics, not the algorithm). float32 is token-identical."
    )


def memory_mb(device, resident_bytes: int = 0) -> float:
    """Peak memory of a run. On a GPU: the allocator's peak (weights, caches and activations). On
    CPU torch keeps no allocator statistics, so the caller passes what it holds: the weights of
    the models it uses plus its KV caches at their largest (after a verification forward, before
    compaction); activations are not counted there."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resident_bytes / 2**20


def weight_bytes(model) -> int:
    """Bytes of a model's parameters and buffers (oneDNN-packed weights included)."""
    if model is None:
        return 0
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_bytes_per_token(model) -> int:
    """K and V of one token over all layers, from the config (for runs whose cache we cannot see)."""
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    element = model.get_input_embeddings().weight.element_size()
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * element


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
    threads: int = 0,
    forward_path: str = "",
    draft_kind: str = "",
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
        threads=threads,
        forward_path=forward_path,
        draft_kind=draft_kind,
        device=device,
        dtype=dtype,
        records=list(records),
    )
