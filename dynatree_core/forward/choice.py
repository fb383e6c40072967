"""Which forward a model's runs take: decided here, once per run, and said why.

Four implementations give the same logits (tests pin each against the reference):

  reference   transformers' own forward (forward.py), over the static cache ("static") or, for
              sliding-window models or when the static cache is off, transformers' DynamicCache
              ("dynamic");
  lean        the straight-line Llama-block forward over the static cache (fastpath.py);
  captured    the lean forward at fixed shapes, one CUDA graph per width (graphs.py; on a CPU,
              or when the model is not capture-safe, the same shapes run eagerly);
  invariant   the lean forward with width-invariant attention and linears (invariant.py).

A draft that is no stock model (`own_forward`, drafts/fused.py) runs its own forward as `lean`.
The switches (None: the environment's override, else the default) are the run's
`ForwardSettings` (core/settings.py): `static` DYNATREE_STATIC_CACHE, `fast` DYNATREE_FAST_FORWARD,
`graphs` DYNATREE_GRAPHS (CUDA only by default); `invariant` is decided by the caller
(invariant.invariant_wanted).

Contract: knows models and devices, never caches' contents, trees or policies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from dynatree_core.core.settings import env_on
from dynatree_core.forward import graphs as cuda_graphs  # looked up at call time: tests stand in for a GPU
from dynatree_core.forward.fastpath import fast_forward_enabled, lean_forward_for
from dynatree_core.forward.invariant import WidthVerdict, width_verdict
from dynatree_core.forward.static_rows import static_attention_agrees

KINDS = ("reference", "lean", "captured", "invariant")  # kv.KVState runs `_<kind>`


@dataclasses.dataclass(frozen=True)
class ForwardChoice:
    """How one model's forwards run for one run.

    Attributes:
        kind: one of KINDS.
        path: the name records carry (RunResult.forward_path): "dynamic", "static", "lean",
            "lean+padded", "lean+graphs", "lean+invariant" (rows grouped by key count, eager) or
            "lean+invariant+padded" / "+graphs" (fixed shapes, captured), with a reason in parentheses
            where something asked for could not be had.
        why: one line saying why this kind was picked.
        static: preallocated per-layer buffers (kv.SlotLayer); else transformers' DynamicCache.
        lean: the forward `lean` / `captured` / `invariant` run (fastpath.LeanForward or a
            draft's own forward); None for `reference`.
        capture: `captured` or padded `invariant`: replay CUDA graphs (else fixed shapes run eagerly).
        verdict: `invariant` only: what invariant.width_verdict found on this device.
    """

    kind: str
    path: str
    why: str
    static: bool
    lean: Callable | None = None
    capture: bool = False
    verdict: WidthVerdict | None = None
    padded: bool = False  # `invariant` only: fixed shapes (static_rows.StaticRows), captured when `capture`


def static_cache_enabled(static: bool | None = None) -> bool:
    """An explicit choice wins; else on unless DYNATREE_STATIC_CACHE=0."""
    return static if static is not None else env_on("DYNATREE_STATIC_CACHE")


def full_attention_only(model: torch.nn.Module) -> bool:
    """True when no layer uses a sliding window (the static buffers keep every position)."""
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None)
    if types:
        return all(t == "full_attention" for t in types)
    return not getattr(config, "sliding_window", None)


def choose_forward(
    model: torch.nn.Module,
    *,
    static: bool | None = None,
    fast: bool | None = None,
    graphs: bool | None = None,
    invariant: bool = False,
) -> ForwardChoice:
    """The forward `model`'s runs take on its device and dtype (module docstring).

    Builds (or reuses: fastpath.lean_forward_for caches it per model) the lean forward, and for
    `invariant` probes this device's kernels once (invariant.width_verdict, cached)."""
    choice = _pick(model, static, fast, graphs, invariant)
    if invariant and choice.kind != "invariant":
        return dataclasses.replace(choice, path=choice.path + " (not width-invariant: needs the lean forward)")
    return choice


def _pick(model, static, fast, graphs, invariant: bool) -> ForwardChoice:
    own = getattr(model, "own_forward", None)
    if own is not None:
        return ForwardChoice("lean", "lean", "a draft that is no stock model runs its own forward", True, own)
    if not static_cache_enabled(static):
        return ForwardChoice(
            "reference", "dynamic", "static cache off (static=False or DYNATREE_STATIC_CACHE=0)", False
        )
    if not full_attention_only(model):
        return ForwardChoice("reference", "dynamic", "sliding-window layers keep transformers' DynamicCache", False)
    lean = lean_forward_for(model, fast)
    if lean is None:
        off = not fast_forward_enabled(fast)
        why = "lean forward off (fast=False or DYNATREE_FAST_FORWARD=0)" if off else "not a Llama-block model"
        return ForwardChoice("reference", "static", f"{why}: HF forward over the static cache", True)
    device = model.get_input_embeddings().weight.device
    if invariant:
        # fixed shapes (static_rows.StaticRows), captured where graphs are: where this device's
        # kernels keep a row's bits in calls of other rows (else each row group eagerly, whose
        # attention the verdict then probes too)
        # (probed the way they will run: replayed from graphs where the forwards are captured)
        wanted = cuda_graphs.graphs_enabled(device, graphs)
        replays = wanted and cuda_graphs.capture_wanted(device, model)
        padded = wanted and static_attention_agrees(lean, model.dtype, device, captured=replays)
        capture = padded and replays
        verdict = width_verdict(lean, model.dtype, device, attention=not padded, captured=capture)
        note = f" (not bitwise on this device: {verdict.reason})" if verdict.reason else ""
        why = "width-invariant forwards asked for (each row's logits as if alone)"
        path = "lean+invariant" + ("+graphs" if capture else "+padded" if padded else "") + note
        return ForwardChoice("invariant", path, why, True, lean, capture=capture, verdict=verdict, padded=padded)
    if cuda_graphs.graphs_enabled(device, graphs):
        capture = cuda_graphs.capture_wanted(device, model)
        why = "CUDA and a capture-safe model" if capture else "fixed shapes run eagerly (no CUDA, or not capture-safe)"
        return ForwardChoice("captured", "lean+graphs" if capture else "lean+padded", why, True, lean, capture=capture)
    return ForwardChoice("lean", "lean", "a Llama-block model over the static cache", True, lean)


def forward_path(
    model: torch.nn.Module, static: bool | None = None, fast: bool | None = None, graphs: bool | None = None
) -> str:
    """The path name a run of `model` with these switches records (ForwardChoice.path)."""
    return choose_forward(model, static=static, fast=fast, graphs=graphs).path
