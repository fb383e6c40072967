"""The feature draft unrolled over its own predictions (training/feature/depth.py, the reference
for agreement by depth and the packed step's levels) equals drafting every chain separately."""

from __future__ import annotations

import torch
from conftest import tiny_model

from dynatree_core.drafts.feature import FeatureDraft
from dynatree_core.training.feature.depth import unrolled_predictions


def _data(target, batch=2, width=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(1, target.config.vocab_size, (batch, width), generator=gen)
    with torch.no_grad():
        f = target.base_model(input_ids=x).last_hidden_state
    valid = torch.ones(batch, width, dtype=torch.bool)
    valid[1, width - 3 :] = False  # a shorter second window
    return x, f, valid


@torch.no_grad()
def _chain(draft, x, f, b: int, p: int, depth: int) -> torch.Tensor:
    """Draft one chain as decoding does: committed pairs 0..r read true features (r = p-depth+1),
    then each chain node reads the feature its parent predicted; the prediction at pair p."""
    r = p - depth + 1
    feats = [f[b, q] for q in range(r + 1)]
    tokens = [x[b, q + 1] for q in range(r + 1)]

    def run():
        embeds = draft.inputs(torch.stack(tokens), torch.stack(feats))[None]
        positions = torch.arange(1, len(tokens) + 1)[None]
        return draft.lm.model(inputs_embeds=embeds, position_ids=positions).last_hidden_state[0, -1]

    out = run()
    for q in range(r + 1, p + 1):
        feats.append(out)
        tokens.append(x[b, q + 1])
        out = run()
    return out


def test_each_level_equals_drafting_every_chain_separately():
    target = tiny_model("llama")
    draft = FeatureDraft.from_target(target, seed=3)
    x, f, valid = _data(target)
    with torch.no_grad():
        preds = unrolled_predictions(draft, x, f, valid, steps=3)
    checked = 0
    for level, pred in enumerate(preds, 1):
        for b in range(2):
            for p in range(level - 1, int(valid[b].sum()) - 1):
                torch.testing.assert_close(pred[b, p], _chain(draft, x, f, b, p, level), rtol=1e-9, atol=1e-9)
                checked += 1
    assert checked > 30
