"""Latency profile: one cached forward's time against the number of new tokens it reads and the
context already in the cache, for the target and the draft, on this device and dtype.

This is what decides whether a tree pays: speculation wins when verifying n nodes costs little
more than one token. Each point is the median of `repeats` timed forwards after a warm-up, on the
engine's own paths, the cache cut back after each forward:

- the target: `KVState.run` over a chain of n new tokens (a tree mask costs the same);
- the draft, whatever its kind (a standalone LM, a feature or fused head): its drafter's level
  step (`Drafter.expand_level`, drafts/session.py) over n children of the root, i.e. one draft level of
  n nodes, input rows and log-probabilities included. A head reads the target's hidden states:
  the context is fed as zero features of the shape its taps take, which costs what real ones do.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.core.taps import FINAL
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.engine import vocab_size
from dynatree_core.drafts.heads import make_drafter
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows

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


def _median_ms(run: Callable[[], None], restore: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median ms of `run` over `repeats` calls after one warm-up, `restore` after each (untimed)."""
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
        restore()
    return statistics.median(times)


def _ids(vocab: int, n: int) -> list[int]:
    return [(7 * i + 3) % vocab for i in range(n)]


@torch.inference_mode()
def forward_ms(
    model: torch.nn.Module,
    context: int,
    new_tokens: int,
    repeats: int = 5,
    *,
    settings: ForwardSettings = ForwardSettings(),
) -> float:
    """Median ms of a target forward over `new_tokens` tokens with `context` tokens already
    cached, on the forward path the engine would take with these settings."""
    ids = _ids(model.get_input_embeddings().weight.shape[0], context + new_tokens)
    kv = KVState(model, ids[:context], capacity=context + new_tokens, **settings.cache_switches())
    kv.run(Rows.chain(kv.pending, 0))
    kv.pending = []
    rows = Rows.chain(ids[context:], context, new_tokens)

    def run() -> None:
        kv.run(rows)

    return _median_ms(run, lambda: kv.keep(list(range(context))), kv.device, repeats)


@torch.inference_mode()
def level_ms(
    draft: torch.nn.Module,
    vocab: int,
    context: int,
    new_tokens: int,
    repeats: int = 5,
    *,
    token_map: TokenMap | None = None,
    settings: ForwardSettings = ForwardSettings(),
) -> float:
    """Median ms of one draft level of `new_tokens` nodes (children of the root) after `context`
    committed tokens, through the drafter the engine makes for this draft (`vocab`: the pair's
    shared vocabulary; `token_map`: a reduced-vocabulary draft's)."""
    ids = _ids(vocab, context + new_tokens)
    drafter = make_drafter(draft, ids[:context], vocab, token_map, **settings.cache_switches())
    if drafter.wants_features:  # a head reads (feature, next token) pairs; the zero features cost the same
        hidden = draft.config.hidden_size
        shape = (context, hidden) if drafter.taps == (FINAL,) else (context, len(drafter.taps), hidden)
        drafter.add_features(torch.zeros(shape, dtype=draft.dtype, device=drafter.kv.device), ids[:context])
    drafter.expand_level(None, None, 0)  # the root's forward: the context goes into the draft's cache
    tokens = torch.tensor(ids[context:], device=drafter.kv.device)
    parents, root = torch.zeros_like(tokens), drafter.ancestors  # every node a child of the root's row

    def restore() -> None:
        drafter.kv.keep(list(range(drafter.committed)))
        drafter.ancestors, drafter.level_starts = root, []

    return _median_ms(lambda: drafter.expand_level(tokens, parents, 1), restore, drafter.kv.device, repeats)


def profile(
    target: torch.nn.Module,
    draft: torch.nn.Module | None = None,
    tokens: tuple[int, ...] = DEFAULT_TOKENS,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    repeats: int = 5,
    progress=None,
    *,
    token_map: TokenMap | None = None,
    settings: ForwardSettings = ForwardSettings(),
) -> list[LatencyPoint]:
    """Every (model, context, tokens) point: the target's forwards, then the draft's levels."""
    vocab = min(vocab_size(target), vocab_size(draft)) if draft is not None else 0
    timers = {"target": lambda c, n: forward_ms(target, c, n, repeats, settings=settings)}
    if draft is not None:
        timers["draft"] = lambda c, n: level_ms(draft, vocab, c, n, repeats, token_map=token_map, settings=settings)
    points = []
    total, done = len(timers) * len(tokens) * len(contexts), 0
    for name, timer in timers.items():
        for context in contexts:
            for n in tokens:
                points.append(LatencyPoint(name, context, n, timer(context, n)))
                done += 1
                if progress:
                    progress(done, total, f"{name} context {context}, {n} tokens")
    return points


def pair_profile(
    pair, tokens: tuple[int, ...], contexts: tuple[int, ...], repeats: int, progress=None, *, settings=ForwardSettings()
) -> list[LatencyPoint]:
    """`profile` of a loaded model pair (decoding/pairs.ModelPair): its draft unless it is a stand-in."""
    if pair.draft is None or pair.draft_is_stand_in:
        return profile(pair.target.model, None, tokens, contexts, repeats, progress, settings=settings)
    draft = pair.draft
    return profile(
        pair.target.model,
        draft.model,
        tokens,
        contexts,
        repeats,
        progress,
        token_map=draft.token_map,
        settings=settings,
    )
