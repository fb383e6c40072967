"""Latency profile: one cached forward's time against the number of new tokens it reads and the
context already in the cache, for the target and the draft, on this device and dtype.

This is what decides whether a tree pays: speculation wins when verifying n nodes costs little
more than one token. Each point is the median of `repeats` timed forwards after a warm-up, using
the engine's own path (KVState: additive 4D mask, explicit positions, the cache cut back after
each forward), with a causal mask over the new tokens (a chain; a tree mask costs the same).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from dynatree_core.core.kv import KVState, chain_then_tree_visibility

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_CONTEXTS = (128, 512)


@dataclasses.dataclass
class LatencyPoint:
    model: str  # "target" or "draft"
    context: int
    new_tokens: int
    ms: float  # median over the timed repeats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def forward_ms(
    model: torch.nn.Module,
    context: int,
    new_tokens: int,
    repeats: int = 5,
    *,
    static: bool | None = None,
    fast: bool | None = None,
    graphs: bool | None = None,
) -> float:
    """Median ms of a forward over `new_tokens` tokens with `context` tokens already cached, on
    the forward path the engine would use (`static` / `fast`: kv.KVState's switches)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = [(7 * i + 3) % vocab for i in range(context + new_tokens)]
    kv = KVState(model, ids[:context], capacity=context + new_tokens, static=static, fast=fast, graphs=graphs)
    prefill = chain_then_tree_visibility(0, context, torch.zeros(0, 0, dtype=torch.bool))
    kv.forward(kv.pending, list(range(context)), prefill, logits_to_keep=1)
    kv.pending = []
    chain = torch.ones(new_tokens, new_tokens, dtype=torch.bool).tril()
    visible = chain_then_tree_visibility(context, 0, chain)
    device = kv.device
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        _sync(device)
        t0 = time.perf_counter()
        kv.forward(ids[context:], list(range(context, context + new_tokens)), visible, logits_to_keep=new_tokens)
        _sync(device)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
        kv.keep(list(range(context)))
    return statistics.median(times)


def profile(
    models: dict[str, torch.nn.Module],
    tokens: tuple[int, ...] = DEFAULT_TOKENS,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    repeats: int = 5,
    progress=None,
    *,
    static: bool | None = None,
    fast: bool | None = None,
    graphs: bool | None = None,
) -> list[LatencyPoint]:
    points = []
    total, done = len(models) * len(tokens) * len(contexts), 0
    for name, model in models.items():
        for context in contexts:
            for n in tokens:
                ms = forward_ms(model, context, n, repeats, static=static, fast=fast, graphs=graphs)
                points.append(LatencyPoint(name, context, n, ms))
                done += 1
                if progress:
                    progress(done, total, f"{name} context {context}, {n} tokens")
    return points
