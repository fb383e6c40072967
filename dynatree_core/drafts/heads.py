"""Drafts that read the target's own hidden states ("heads"), whatever their kind, behind one door.

`is_head_dir(spec)` tells a directory holding one from a standalone draft LM; `load_head` builds
it on the target it serves (checked against it: width, layers, vocabulary); `make_drafter` makes
the per-run drafter of any draft, a head's or a standalone LM's (a head's `taps` say which of the
target's hidden states the verification forward hands over: core/taps.py). Kinds: the feature
draft (feature.py: the final state) and the fused-feature draft (fused.py: EAGLE-3's three
layers); published EAGLE-1 and EAGLE-3 heads are read into those two kinds (published.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dynatree_core.core.vocab import TokenMap
from dynatree_core.drafts import feature, fused, published
from dynatree_core.drafts.session import Drafter
from dynatree_core.forward.kv import KVState


def is_head(model: torch.nn.Module | None) -> bool:
    return isinstance(model, (feature.FeatureDraft, fused.FusedDraft))


def head_kind(model: torch.nn.Module) -> str:
    return model.kind


def draft_kind(draft: torch.nn.Module | None) -> str:
    """A head's kind ("feature", "fused"), "token" for a standalone draft LM, "" for none."""
    if draft is None:
        return ""
    return head_kind(draft) if is_head(draft) else "token"


def is_head_dir(spec: str | None) -> bool:
    return feature.is_feature_draft_dir(spec) or fused.is_fused_draft_dir(spec) or published.is_published_head_dir(spec)


def load_head(spec: str, target: torch.nn.Module) -> torch.nn.Module:
    """The head saved in directory `spec`, attached to `target` (DynaTreeError when it does not fit)."""
    path = Path(spec).expanduser()
    if fused.is_fused_draft_dir(str(path)):
        return fused.FusedDraft.load(path, target)
    if feature.is_feature_draft_dir(str(path)):
        return feature.FeatureDraft.load(path, target)
    return published.load_published(path, target)


def make_drafter(
    draft: torch.nn.Module, prompt_ids: list[int], vocab: int, token_map: TokenMap | None = None, **paths
) -> Drafter:
    """The per-run drafter of any draft kind, over its own KV cache (`paths`: KVState's forward
    options): a head's (it reads the target's features and carries its own token map) or a
    standalone draft LM's (the prompt pending in its cache; `token_map` for a reduced vocabulary)."""
    if isinstance(draft, fused.FusedDraft):
        return fused.FusedDrafter(draft, vocab, kv=KVState(draft, [], **paths))
    if isinstance(draft, feature.FeatureDraft):
        return feature.FeatureDrafter(draft, vocab, kv=KVState(draft.lm, [], **paths))
    return Drafter(draft, prompt_ids, vocab, token_map, kv=KVState(draft, prompt_ids, **paths))
