"""Reduce a run's iteration records to its summary metrics (Spec-Bench style contract).

Definitions (also in the glossary, docs/glossary.md):
  tokens_per_iteration   committed tokens / iterations (accepted drafts + bonus)
  acceptance_rate        accepted draft tokens / draft tokens the target verified
  mean_accepted_length   accepted draft tokens per iteration (bonus excluded)
  throughput_tps         new tokens / wall seconds, the prompt's prefill included
  ttft_ms                wall time of the first iteration (prefill + first verification)
  tpot_ms                (wall - ttft) / (new tokens - 1)
"""

from __future__ import annotations

from typing import Any

from dynatree_core.runs.records import IterationRecord, RunResult


def exactness_note(dtype: str, forward_paths: str | list[str] = "") -> str | None:
    """What a run promises about greedy exactness beyond the algorithm (None: token-identical to `ar`).

    The algorithm is exact in any dtype; the arithmetic need not be. A tree forward computes a
    token's logits in a different batch shape than `ar`'s 1-token forward; in bfloat16/float16 the
    rounding differs enough to flip the argmax where two tokens nearly tie, unless the target's
    forwards are width-invariant (forward/invariant.py: forward path "lean+invariant", "+padded" or
    "+graphs" after it, each row gets the bits it would get alone). float32 differs by ~1e-7 and
    stays token-identical in practice."""
    given = [forward_paths] if isinstance(forward_paths, str) else forward_paths
    paths = [p for p in given if p and not p.startswith("hf")]  # HF's own runs are references, not trees
    name = str(dtype).removeprefix("torch.")
    bitwise = bool(paths) and all("+invariant" in p and "not bitwise" not in p for p in paths)
    if name in ("float32", "float64") or bitwise:
        return None
    return (
        f"In {name}, greedy outputs can differ from `ar`'s at near-ties: the tree forward rounds differently "
        "from a 1-token forward (numerics, not the algorithm); width-invariant forwards (--width-invariant on, "
        "lean architectures) remove this. float32 is token-identical."
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


def ratio(num: float, den: float) -> float:
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
        tokens_per_iteration=ratio(new, n_iter),
        acceptance_rate=ratio(accepted, drafted),
        mean_accepted_length=ratio(accepted, n_iter),
        throughput_tps=ratio(new, wall_ms / 1000),
        wall_s=wall_ms / 1000,
        ttft_ms=ttft_ms,
        tpot_ms=ratio(wall_ms - ttft_ms, new - 1) if new > 1 else 0.0,
        peak_memory_mb=max((r.memory_mb for r in records), default=0.0),
        draft_ms=sum(r.draft_ms for r in records),
        verify_ms=sum(r.verify_ms for r in records),
        commit_ms=sum(r.commit_ms for r in records),
        overhead_ms=sum(r.overhead_ms for r in records),
        stop_reason=records[-1].stop if records and records[-1].stop else "none",
        threads=threads,
        forward_path=forward_path,
        capture_s=sum(r.capture_ms for r in records) / 1000,
        draft_kind=draft_kind,
        device=device,
        dtype=dtype,
        records=list(records),
    )


def acceptance_by_depth(records: list[IterationRecord]) -> list[dict]:
    """Per depth d: expected P(the walk accepts >= d drafts) from the per-node analysis (the sum
    of the reach probabilities of depth-d nodes), against the realised fraction of iterations."""
    analysed = [rec for rec in records if rec.analysis]
    expected: dict[int, list[float]] = {}
    for rec in analysed:
        deepest = max(rec.tree.depths[n] for n in rec.order)
        for d in range(1, deepest + 1):
            expected.setdefault(d, []).append(
                sum(v["reach"] for k, v in rec.analysis.items() if rec.tree.depths[int(k)] == d)
            )
    realised = depth_reach(analysed)
    return [
        {
            "depth": d,
            "expected": sum(expected[d]) / len(expected[d]),
            "realised": realised[d][1] / realised[d][0],
            "iterations": len(expected[d]),
        }
        for d in sorted(expected)
    ]


def acceptance_by_source(records: list[IterationRecord]) -> list[dict]:
    """Per source of the verified nodes (core/tree.Source): how many the target read, how many it
    accepted, and the share; sources in the order they first appear."""
    counts: dict[str, list[int]] = {}
    for rec in records:
        accepted = set(rec.accepted)
        for node in rec.order[1:]:
            seen = counts.setdefault(rec.tree.source(node), [0, 0])
            seen[0] += 1
            seen[1] += node in accepted
    return [
        {"source": source, "verified": v, "accepted": a, "acceptance": a / v if v else 0.0}
        for source, (v, a) in counts.items()
    ]


def depth_reach(records: list[IterationRecord]) -> dict[int, tuple[int, int]]:
    """Per depth d: (iterations whose verified tree reached depth d, those that accepted >= d drafts)."""
    out: dict[int, tuple[int, int]] = {}
    for rec in records:
        deepest = max((rec.tree.depths[n] for n in rec.order), default=0)
        for d in range(1, deepest + 1):
            reached, accepted = out.get(d, (0, 0))
            out[d] = (reached + 1, accepted + (len(rec.accepted) >= d))
    return out


def speed_breakdown(records: list[IterationRecord], step_ms: float | None = None) -> dict[str, float]:
    """Where an iteration's time goes, against plain decoding's cost per token (`step_ms`: a
    one-token target forward from the latency profile, or an AR run's time per token).

    speedup ~= tokens per iteration x step_ms / iteration_ms: speculation pays only when the
    tokens an iteration commits outweigh what drafting and the wider verification cost."""
    n = len(records)
    if n == 0:
        return {}

    def mean(values: list[float]) -> float:
        return sum(values) / n

    out = {
        "iterations": n,
        "tokens_per_iteration": mean([len(r.committed) for r in records]),
        "draft_ms": mean([r.draft_ms for r in records]),
        "draft_forwards": mean([r.draft_forwards for r in records]),
        "verify_ms": mean([r.verify_ms for r in records]),
        "other_ms": mean([r.commit_ms + r.overhead_ms for r in records]),
        "tokens_verified": mean([len(r.order) - 1 + r.chain_len for r in records]),  # one target forward's width
    }
    out["iteration_ms"] = out["draft_ms"] + out["verify_ms"] + out["other_ms"]
    if step_ms:
        out["step_ms"] = step_ms
        out["verify_vs_step"] = out["verify_ms"] / step_ms
        out["break_even_tokens"] = out["iteration_ms"] / step_ms
        out["expected_speedup"] = out["tokens_per_iteration"] * step_ms / out["iteration_ms"]
    return out
