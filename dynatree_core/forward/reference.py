"""What every forward returns, and the reference forward the faster ones are checked against.

`Forward` is the one result type of every forward in core: the HF reference here, the lean
forward (fastpath.py), the captured one (graphs.py), the width-invariant one (invariant.py
attention inside the lean forward) and a draft's own forward (drafts/fused.py). Logits always;
hidden states only when asked. Which of them a model's runs take is decided in one place,
`choice.choose_forward`; `kv.KVState.run` runs it and hands out a `Forward`.

`reference_forward` is transformers' own forward over a cache, with the additive 4D mask and
explicit position ids (a ready 4D mask is used as-is by transformers 5.x).

Contract: knows models and caches, never trees or policies.
"""

from __future__ import annotations

import dataclasses

import torch

from dynatree_core.core.taps import stack_taps


@dataclasses.dataclass(frozen=True)
class Forward:
    """One forward's result.

    Attributes:
        logits: (logits_to_keep, vocab), the last rows' logits (float32 from KVState.run;
            the model's dtype from the implementations under it); None where none were asked
            for (the lean forward with logits_to_keep 0: the recipes' batched answers).
        states: None unless asked for. `hidden=True`: (q, hidden) final post-norm states of all
            q rows, what the LM head reads; a tuple of taps (core/taps.py): (q, len(taps), hidden).
    """

    logits: torch.Tensor | None
    states: torch.Tensor | None = None


def reference_forward(
    model: torch.nn.Module,
    cache,
    ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    logits_to_keep: int,
    *,
    embeds: torch.Tensor | None = None,
    hidden: bool | tuple[int, ...] = False,
) -> Forward:
    """transformers' forward of `model` over `cache` (appending the q new keys/values).

    Args:
        ids, positions: (1, q) on the model's device.
        mask: (1, 1, q, past + q) additive float mask.
        embeds: (1, q, hidden) inputs instead of the ids' embeddings.
        hidden: also return the final states, or a tuple of taps (core/taps.py).
    """
    if not hidden and embeds is None:
        out = model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,  # (1, 1, q, kv): used as-is by transformers
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        return Forward(out.logits[0])
    taps = hidden if isinstance(hidden, tuple) else ()
    base = model.base_model(  # the base model, then the head: the hidden state is its output
        input_ids=None if embeds is not None else ids,
        inputs_embeds=embeds,
        position_ids=positions,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=bool(taps),
    )
    states = base.last_hidden_state[0]
    logits = model.get_output_embeddings()(states[-logits_to_keep:])
    if taps:  # transformers' hidden_states[i] is the input of layer i (core/taps.py)
        states = stack_taps(taps, {t: base.hidden_states[t][0] for t in taps if t >= 0}, states)
    return Forward(logits, states if hidden else None)


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """visible (..., q, kv) bool -> the additive mask of the same shape: 0 where visible, the
    dtype's min elsewhere (every forward here and the recipes' batched answers build it so)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)
