"""TALF for the feature draft: the tree-aware loss of the SALF & TALF paper on EAGLE-style drafts.

The paper fine-tunes a converged feature draft (salf-talf-tree-loss-and-stopping.md sec. 3.2,
Algorithm 1): for roots s of a training window the TARGET builds an EAGLE-2 beam tree and records
its next-token distribution at every node (Alg. 1 lines 2, 5: `talf.build_target_trees`, stored
by `talf-label`); the DRAFT follows every path from the root, feeding its own predicted feature
back as the input of the next depth as in HASS (line 6, "input features omitted for brevity"),
and the loss sums the per-node cross-entropies to the target's distributions (lines 7-8). As in
the paper there is no feature-regression term by default ("training solely on the token
probability distributions ... was sufficient", sec. 3.2).

Layout of one window's draft sequence (the same as a drafted tree in `FeatureDrafter`):

    entries 0..W-1      pair e reads (f_e, x_{e+1}) at position e + 1 and predicts x_{e+2}
    entry W + r*N + n   node n of root r: token t_n, feature = the draft's prediction at its
                        parent (the root's parent is the pair of the root token, entry s_r - 1),
                        position s_r + depth_n; it sees the pairs at positions <= s_r, its
                        ancestors and itself (tree attention, Alg. 1 line 6)

A node's input feature is the draft's own output one level up, so depth d needs d forwards:
`levels` forwards without gradient fill the inputs level by level, then one forward with
gradient computes every output from those inputs (the inputs are held constant: HASS-style
detached features). The window's pairs get the KD cross-entropy to head(f) as the root nodes
(`x_s -> p_{s+1}`), over a random `ce_share` of them, as in feature.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dynatree_core.core.vocab import OTHER

TREE_KEYS = ("roots", "tokens", "parents", "depths", "topk_ids", "topk_logp")


class TargetTrees:
    """The `talf-label` file, restricted to windows whose features exist in `rows_with_features`."""

    def __init__(self, path: Path, rows_with_features: np.ndarray):
        with np.load(path) as data:
            keep = np.isin(data["row"], rows_with_features)
            self.rows = data["row"][keep]
            self.arrays = {key: data[key][keep] for key in TREE_KEYS}
        if not len(self.rows):
            raise SystemExit(f"{path} holds no tree for a window with labelled features")

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, index: np.ndarray) -> dict[str, torch.Tensor]:
        return {key: torch.from_numpy(self.arrays[key][index].astype(np.int64)) for key in TREE_KEYS[:-1]} | {
            "topk_logp": torch.from_numpy(self.arrays["topk_logp"][index].astype(np.float32))
        }


def tree_layout(width: int, roots: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, pair_valid):
    """Mask, positions and parent entries for B windows of `width` pairs + R x N tree nodes.

    Args: roots (B, R) root positions s (a node is kept only for 1 <= s <= valid pairs);
    parents, depths (B, R, N); pair_valid (B, W) bool.
    Returns: see (B, Q, Q) bool, positions (B, Q), source (B, R*N) entry whose output is each
    node's input feature, node_ok (B, R*N) bool.
    """
    b, r, n = parents.shape
    q = width + r * n
    device = parents.device
    see = torch.zeros(b, q, q, dtype=torch.bool, device=device)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    see[:, :width, :width] = causal[None] & pair_valid[:, None, :]
    # ancestors within a root's tree: anc[b, r, i, j] = node j is i or an ancestor of i
    anc = torch.eye(n, dtype=torch.bool, device=device).expand(b, r, n, n).clone()
    hop = parents.clone()
    for _ in range(n):
        has = hop >= 0
        if not has.any():
            break
        anc |= torch.nn.functional.one_hot(hop.clamp(min=0), n).bool() & has[..., None]
        hop = torch.where(has, parents.gather(-1, hop.clamp(min=0)), hop)
    blocks = torch.zeros(b, r * n, r * n, dtype=torch.bool, device=device)
    for i in range(r):
        blocks[:, i * n : (i + 1) * n, i * n : (i + 1) * n] = anc[:, i]
    see[:, width:, width:] = blocks
    s = roots.repeat_interleave(n, dim=1)  # (B, R*N) root position of each node
    entries = torch.arange(width, device=device)
    see[:, width:, :width] = (entries[None, None, :] < s[..., None]) & pair_valid[:, None, :]
    positions = torch.cat([torch.arange(1, width + 1, device=device).expand(b, -1), s + depths.reshape(b, -1)], dim=1)
    base = width + torch.arange(r, device=device).repeat_interleave(n) * n  # (R*N,) first entry of each root
    flat_parents = parents.reshape(b, -1)
    source = torch.where(flat_parents >= 0, base[None] + flat_parents.clamp(min=0), s - 1)
    node_ok = (s >= 1) & (s <= pair_valid.sum(1, keepdim=True))
    return see, positions, source.clamp(min=0), node_ok


def _additive(see: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(see.shape, dtype=dtype, device=see.device)
    return mask.masked_fill_(~see, torch.finfo(dtype).min)[:, None]


def tree_outputs(draft, tokens: torch.Tensor, pair_feats: torch.Tensor, see, positions, source, levels: int):
    """The draft's outputs (B, Q, H) at every entry, each node reading its parent's prediction.

    tokens (B, Q) target ids of every entry; pair_feats (B, W, H) the pairs' input features.
    `levels` forwards without gradient settle the node inputs level by level; the last forward
    (with gradient when enabled) reads them."""
    b, width, hidden = pair_feats.shape
    mask = _additive(see, draft.dtype)
    node_feats = torch.zeros(b, tokens.shape[1] - width, hidden, device=pair_feats.device, dtype=pair_feats.dtype)

    def forward(nodes: torch.Tensor) -> torch.Tensor:
        embeds = draft.inputs(tokens, torch.cat([pair_feats, nodes], 1).to(draft.dtype))
        return draft.lm.model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask).last_hidden_state

    with torch.no_grad():
        for _ in range(levels):
            out = forward(node_feats)
            node_feats = out.gather(1, source[..., None].expand(-1, -1, hidden)).to(pair_feats.dtype)
    return forward(node_feats)


def feature_talf_loss(
    draft,
    x: torch.Tensor,
    f: torch.Tensor,
    valid: torch.Tensor,
    trees: dict[str, torch.Tensor],
    *,
    noise: float,
    ce_share: float = 1.0,
    regression_weight: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """Alg. 1's loss for a batch of windows with their target trees: the mean over the window's
    sampled pairs and every tree node of the soft cross-entropy to the target's distribution."""
    device = x.device
    trees = {k: v.to(device) for k, v in trees.items()}
    pair_inputs = f[:, :-1]
    if noise > 0:
        pair_inputs = pair_inputs + (torch.rand_like(pair_inputs) * 2 - 1) * noise
    pair_tokens, goal, pair_valid = x[:, 1:], f[:, 1:], valid[:, 1:]
    b, width = pair_tokens.shape
    levels = int(trees["depths"].max())
    see, positions, source, node_ok = tree_layout(width, trees["roots"], trees["parents"], trees["depths"], pair_valid)
    tokens = torch.cat([pair_tokens, trees["tokens"].reshape(b, -1)], 1)
    out = tree_outputs(draft, tokens, pair_inputs, see, positions, source, levels).float()
    pred, node_pred = out[:, :width], out[:, width:]
    # the roots' own predictions (x_s -> p_{s+1}): KD cross-entropy to head(f) on a share of the pairs
    rows = pair_valid if ce_share >= 1 else pair_valid & (torch.rand(pair_valid.shape, device=device) < ce_share)
    logq = torch.log_softmax(draft.reduced_logits(pred[rows]), -1)
    with torch.no_grad():
        p = torch.softmax(draft.reduced_logits(goal[rows]), -1)
    pair_ce = -(p * logq.nan_to_num(neginf=0.0)).sum(-1)
    # every tree node: cross-entropy to the target's top-k at that node (Alg. 1 line 7)
    k = trees["topk_ids"].shape[-1]
    label_ids = trees["topk_ids"].reshape(b, -1, k)[node_ok]
    label_logp = trees["topk_logp"].reshape(b, -1, k)[node_ok]
    if draft.token_map is not None:
        label_ids = draft.token_map.to_draft(label_ids)
        label_logp = label_logp.masked_fill(label_ids == OTHER, -torch.inf)  # outside the head: not learnable
    node_full = torch.log_softmax(draft.reduced_logits(node_pred[node_ok]), -1)
    node_logq = node_full.gather(-1, label_ids)
    node_p = torch.softmax(label_logp, -1)
    node_ce = -(node_p * node_logq.nan_to_num(neginf=0.0)).sum(-1)
    count = pair_ce.numel() + node_ce.numel()
    loss = (pair_ce.sum() + node_ce.sum()) / max(count, 1)
    parts = {"pair_ce": float(pair_ce.detach().mean()) if len(pair_ce) else 0.0}
    parts["node_ce"] = float(node_ce.detach().mean()) if len(node_ce) else 0.0
    node_top = node_full.argmax(-1) == label_ids[:, 0]  # the draft's top-1 at a node is the target's
    parts["agreement"] = float(node_top.float().mean()) if len(node_top) else 0.0
    if regression_weight > 0:
        m = pair_valid.float()
        reg = (torch.nn.functional.smooth_l1_loss(pred, goal, reduction="none").mean(-1) * m).sum() / m.sum()
        loss = loss + regression_weight * reg
        parts["regression"] = float(reg.detach())
    return loss, parts
