"""The feature draft unrolled over its own predicted features: how `agreement_by_depth`
(feature/train.py) measures deeper tree levels, and the reference the packed step's unrolled
levels are tested against (tests/test_packed_training.py).

Plain KD (feature/train.py) always feeds the draft the target's true feature of the previous position.
In a drafted tree only depth 1 gets that: a node at depth k >= 2 reads the feature its parent
*predicted*, a distribution training never showed it, so agreement decays with depth (0.61 /
0.52 / 0.49 / 0.48 at depths 1-4 for the KD draft). EAGLE-3's training-time test and HASS fix
this by unrolling the draft during training; here, for `steps` levels over a window of pairs
(pair j reads (f_j, x_{j+1}) and predicts f_{j+1}):

    level 1:  every pair reads the target's feature                      (plain KD)
    level k:  pair j reads level k-1's prediction at pair j-1, and attends, exactly as a depth-k
              tree node whose root is pair j-k+1 does, to the committed pairs <= j-k+1 (level 1)
              and to its ancestors (pair j-k+m at level m, m = 2..k-1), through the cached keys
              and values of the earlier levels (`depth_mask`'s rows of level k)

so one extra forward of W rows per level (the earlier levels are read from the cache, never
recomputed). The predicted features passed to the next level are detached. (Training on this
unrolled loss in `train-feature` lost to KD at equal compute and was removed; the packed step
trains unrolled levels: packed/step.py.)

`unrolled_predictions` is tested to equal drafting every chain separately.
"""

from __future__ import annotations

import torch

from dynatree_core.drafts.feature import FeatureDraft
from dynatree_core.forward.reference import additive
from dynatree_core.forward.rows import visibility


def depth_mask(levels: int, width: int, valid: torch.Tensor) -> torch.Tensor:
    """(B, 1, L*W, L*W) additive mask for `levels` stacked copies of a window's pairs: row (k, j)
    is a tree node at depth k whose root is pair j-k+1. It sees what a draft level's row sees
    (forward/rows.visibility): the committed pairs 1..j-k+1 of level 1 (true features), and its
    lineage, its ancestors (level m at pair j-k+m, m = 2..k-1) and itself; a row with no root in
    the window only itself; no key of a pair that is not `valid`."""
    n = levels * width
    k = torch.arange(levels).repeat_interleave(width)  # level of each row, 0-based
    root = torch.arange(width).repeat(levels) - k  # the pair the row's chain starts from
    own, hops = torch.arange(n)[:, None], torch.arange(1, levels)  # the levels above the first
    lines = hops * width + root[:, None] + hops  # the row's node at level m: its ancestor (m < k), itself (m = k)
    lines = torch.cat([torch.where((hops <= k[:, None]) & (root[:, None] >= 0), lines, own), own], dim=1)
    see = visibility(root + 1, lines, n, real=root >= 0)
    see = see[None] & valid.repeat(1, levels)[:, None, :]
    return additive(see, torch.float32)[:, None]


def unrolled_predictions(
    draft: FeatureDraft, x: torch.Tensor, f: torch.Tensor, valid: torch.Tensor, *, steps: int, noise: float = 0.0
) -> list[torch.Tensor]:
    """Per level 1..steps, the draft's predicted features (B, W-1, H) at every pair (module docstring).
    x (B, W) ids, f (B, W, H) target features, valid (B, W) bool."""
    from transformers import DynamicCache

    inputs = f[:, :-1]
    if noise > 0:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
    tokens, pair_valid = x[:, 1:], valid[:, 1:]
    batch, width = tokens.shape
    positions = torch.arange(1, width + 1, device=x.device)[None].expand(batch, -1)
    cache = DynamicCache()
    preds: list[torch.Tensor] = []
    for level in range(1, steps + 1):
        if level > 1:  # pair j reads level k-1's prediction at pair j-1 (pair 0 has no parent: a placeholder)
            inputs = torch.cat([f[:, :1], preds[-1][:, :-1].detach().to(f.dtype)], dim=1)
        mask = depth_mask(level, width, pair_valid.cpu())[:, :, (level - 1) * width :]  # level k's rows
        out = draft.lm.model(
            inputs_embeds=draft.inputs(tokens, inputs.to(draft.dtype)),
            position_ids=positions,
            attention_mask=mask.to(device=x.device, dtype=draft.dtype),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        preds.append(out)
    return preds
