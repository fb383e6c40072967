"""Every recipe's resume check (trainer.py): what a run records of itself, so a rerun continues only it.

Every trainer's `checkpoint.pt` carries `run`: the draft's form (kind, width, heads, MLP, the
target layers it reads and how they are normed, its vocabulary and token map) and the settings
that decide what is trained. On resume the trainer builds the same record from the command it
was given and `core.weights.check_same_run` refuses a checkpoint whose record differs, naming the
settings, instead of continuing another run in place. The weights are then loaded whole
(`core.weights.load_weights`) and the checkpoint is written whole (`core.weights.save_whole`).
"""

from __future__ import annotations

import hashlib

import torch

from dynatree_core.core.vocab import TokenMap


def token_map_digest(token_map: TokenMap | None) -> str | None:
    """A short fingerprint of which target id each draft slot stands for (None: the full vocabulary)."""
    if token_map is None:
        return None
    ids = token_map.draft_to_target.to(torch.int64).numpy().tobytes()
    return f"{len(token_map)} slots of {token_map.target_vocab}, sha1 {hashlib.sha1(ids).hexdigest()[:12]}"


def head_run(draft: torch.nn.Module, **settings) -> dict:
    """The record of a run training `draft` (a feature or fused head) with `settings`."""
    config = draft.config
    record = {
        "kind": draft.kind,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "taps": list(getattr(draft, "taps", ())),
        "fc_norm": getattr(draft, "fc_norm_kind", None),
        "norm_before_residual": getattr(draft, "norm_before_residual", None),
        "token_map": token_map_digest(draft.token_map),
    }
    if draft.kind == "feature":
        record["input_norm"] = not isinstance(draft.lm.model.layers[0].input_layernorm, torch.nn.Identity)
    return record | settings
