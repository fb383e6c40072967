"""Glue shared by the CLI and the app: resolve a model pair and encode prompts.

Keeps the rules in one place: which draft the embedded target uses, the tokenizer check, and
how a prompt (plain or chat) becomes token ids.
"""

from __future__ import annotations

import dataclasses
import warnings

from dynatree_core.dtypes import saved_choice
from dynatree_core.errors import DynaTreeError
from dynatree_core.models import (
    EMBEDDED,
    PRESETS,
    LoadedModel,
    check_tokenizers_compatible,
    load_model,
    resolve_device,
)
from dynatree_core.packing import pack_linears, packing_enabled


@dataclasses.dataclass
class ModelPair:
    target: LoadedModel
    draft: LoadedModel | None
    draft_is_stand_in: bool = False
    dtype_source: str = "asked"  # "asked" (an explicit dtype), "probe" (a saved dtype probe) or "rule"


def default_draft_for(target_spec: str) -> str | None:
    for preset in PRESETS.values():
        if preset.target == target_spec:
            return preset.draft
    return None


def load_pair(
    target_spec: str = EMBEDDED,
    draft_spec: str | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    need_draft: bool = True,
    pack: bool = True,
) -> ModelPair:
    """Load target and draft. Without a draft spec, use the preset's draft, else the target
    itself as a stand-in (correct but never faster; a warning says so). On CPU the linear
    layers are pre-packed for oneDNN unless `pack` is False or DYNATREE_PACK=0 (packing.py).
    dtype "auto" takes the dtype a saved probe chose for this device and pair (dtypes.py), else
    the static rule (models.resolve_dtype); both models always share one dtype."""
    source = "asked"
    if dtype == "auto":
        probed = saved_choice(resolve_device(device), target_spec, draft_spec or default_draft_for(target_spec))
        source, dtype = ("probe", probed) if probed else ("rule", "auto")
    target = load_model(target_spec, device=device, dtype=dtype)
    if pack and packing_enabled(target.device, target.dtype):
        pack_linears(target.model)
    if not need_draft:
        return ModelPair(target, None, dtype_source=source)
    draft_spec = draft_spec or default_draft_for(target_spec)
    if draft_spec is None or draft_spec == target_spec:
        warnings.warn(
            f"no draft model for {target_spec!r}: using the target itself as a stand-in draft "
            "(outputs stay exact, but nothing gets faster)",
            stacklevel=2,
        )
        return ModelPair(target, target, draft_is_stand_in=True, dtype_source=source)
    draft = load_model(draft_spec, device=str(target.device), dtype=dtype)
    check_tokenizers_compatible(target, draft)
    if pack and packing_enabled(draft.device, draft.dtype):
        pack_linears(draft.model)
    return ModelPair(target, draft, dtype_source=source)


def encode_prompt(tokenizer, text: str, *, chat: bool) -> list[int]:
    """Token ids for a prompt. Chat mode applies the tokenizer's chat template."""
    if text is None or not text.strip():
        raise DynaTreeError("the prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise DynaTreeError("this model has no chat template: turn chat mode off")
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
