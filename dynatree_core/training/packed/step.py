"""The packed recipe's step (`train-packed`): the cheap training step for either head kind.

One step (packed/data.py: packed windows, no padding; the compact teacher, no target LM head):

    level 1   every pair reads the target's state: the feature kind fc([embed; f_j]), the fused
              kind fc over the normed taps (EAGLE-3)
    level k   pair j reads level k-1's output at pair j-1 (its parent in a drafted tree, detached),
              attending as a depth-k tree node does (packed.level_mask), through the keys and values
              of the earlier levels (EAGLE-3's training-time test; `levels` = 1 is plain KD)

    loss = sum_k 0.8^(k-1) [ CE(teacher, draft at level k) + regression_weight * smoothL1(pred, f_{j+1}) ]
           / sum_k 0.8^(k-1)

CE is the soft cross-entropy to the teacher's top-k renormalised over the draft's map, over the
counted pairs whose root lies in the same window; the regression term applies to the feature kind
only (the fused kind predicts no target state: EAGLE-3 dropped the feature loss).

The schedule around it (passes, evaluations, checkpoints) is packed/train.py over the one loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from dynatree_core.core.vocab import OTHER
from dynatree_core.drafts.fused import FusedDraft
from dynatree_core.training.packed.data import PackedAnswers, PackedBatch, level_mask


@dataclasses.dataclass
class PackedTrainConfig:
    passes: float = 15.0  # over the training loss pairs: the schedule's length
    pairs_per_step: int = 8192  # packed pair slots a step reads (about 16 rows of 512)
    lr: float = 5e-4
    warmup: int = 50
    weight_decay: float = 0.0
    levels: int = 1  # 1: KD; > 1: unrolled over the draft's own outputs (training-time test)
    level_decay: float = 0.8
    regression_weight: float = 1.0  # feature kind: smooth L1 to the next feature (0 for the fused kind)
    ce_weight: float = 0.1  # feature kind's weight of the CE beside the regression (fused kind: CE alone)
    ce_share: float = (
        1.0  # CE over this random share of the counted pairs (fused kind: its whole loss), fewer head products
    )
    noise: float = 0.0  # uniform noise on the level-1 input states (EAGLE sec. 4.2)
    autocast: str = "bfloat16"  # "" for float32
    train_head: bool = False  # fused kind: train its head too (EAGLE-3 does; frozen = the target's rows)
    seed: int = 0
    log_every: int = 10
    checkpoint_every_s: float = 0.0  # > 0: a log line checkpoints only this long after the last (trainer.Loop)
    eval_every_s: float = 1800.0  # training seconds between held-out / OOD evaluations (<= 0: none)
    eval_windows: int = 96  # held-out windows in each evaluation (OOD: all of them)
    eval_first: bool = False  # also evaluate before the first step (the curve's starting point)
    stop_after_s: float = 0.0  # > 0: end this process after this much training time (the schedule stays)
    budget_s: float = 0.0  # > 0: the schedule is this much training time instead of `passes` (equal-compute runs)
    device: str = "cpu"


def level_inputs(draft, batch: PackedBatch) -> torch.Tensor:
    """Level 1's hidden inputs (R, T, H) for the fused kind, or the features for the feature kind."""
    if isinstance(draft, FusedDraft):
        return draft.fuse(batch.inputs)
    return batch.inputs.to(draft.dtype)


def _layer_of(draft):
    """(decoder layer, rotary embedding) of either kind: both layers have the Llama block's parts."""
    if isinstance(draft, FusedDraft):
        return draft.midlayer, draft.rotary
    return draft.lm.model.layers[0], draft.lm.model.rotary_emb


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (R, T, ...) at index (R, S) along T."""
    return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))


def level_forward(draft, tokens, hidden, positions, mask, past=None, select=None):
    """One pass of the draft's layer over packed rows, written out so that the query side runs
    only where an output is needed: keys and values for every pair (later pairs and levels read
    them), queries, attention, o and the MLP only at `select`, (index (R, S), valid (R, S)) as
    `compacted` gives them (None: all).
    Same arithmetic as the drafter's forward (tests/test_packed_training.py).

    Returns (outputs (R, S, H) at the selected rows in row-major order, S = the most selected in
    a row, and their validity (R, S) bool; (keys, values) including this pass's, for the next)."""
    layer, rotary = _layer_of(draft)
    attn = layer.self_attn
    if isinstance(draft, FusedDraft):
        resid = draft.residual(hidden)
        x = torch.cat([layer.input_layernorm(draft.token_embeds(tokens)), layer.hidden_norm(hidden)], dim=-1)
    else:
        resid = draft.inputs(tokens, hidden)
        x = layer.input_layernorm(resid)
    rows, width = tokens.shape
    config = draft.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = attn.q_proj.out_features // heads
    cos, sin = rotary(resid, positions)  # (R, T, d)
    k = attn.k_proj(x).view(rows, width, kv_heads, dim).transpose(1, 2)
    v = attn.v_proj(x).view(rows, width, kv_heads, dim).transpose(1, 2)
    k = _rope(k, cos[:, None], sin[:, None])
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    if select is None:
        index = torch.arange(width, device=tokens.device)[None].expand(rows, -1)
        valid = torch.ones(rows, width, dtype=torch.bool, device=tokens.device)
    else:
        index, valid = select
    xq, rq = _gather_rows(x, index), _gather_rows(resid, index)
    q = attn.q_proj(xq).view(rows, -1, heads, dim).transpose(1, 2)
    q = _rope(q, _gather_rows(cos, index)[:, None], _gather_rows(sin, index)[:, None])
    m = mask.gather(2, index[:, None, :, None].expand(-1, 1, -1, mask.shape[-1])).to(q.dtype)
    groups = heads // kv_heads
    keys, values = (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)) if groups > 1 else (k, v)
    a = F.scaled_dot_product_attention(q, keys, values, attn_mask=m)
    h = rq + attn.o_proj(a.transpose(1, 2).reshape(rows, -1, heads * dim))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, valid, (k, v)


def compacted(select: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected slots of (R, T) bool `select` moved to the front of each row, in order: their
    indices (R, S) and validity (R, S), S the most selected in a row (at least 1). S is read from
    the values: the step plans it on the host (`plan_step`), where reading costs nothing."""
    count = select.sum(1)
    index = torch.argsort((~select).to(torch.int8), dim=1, stable=True)[:, : max(int(count.max()), 1)]
    return index, torch.arange(index.shape[1], device=select.device)[None] < count[:, None]


def level_selects(last: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """(R, T) bool per level 1..levels: where that level's outputs are needed for the last level's
    rows `last` (level m at their ancestors, the pairs `levels - m` earlier)."""
    selects = []
    for level in range(1, levels + 1):
        select = torch.zeros_like(last)
        select[:, : last.shape[1] - (levels - level)] = last[:, levels - level :]
        selects.append(select)
    return selects


def unrolled_outputs(draft, batch: PackedBatch, levels: int, *, noise: float = 0.0, detach: bool = True, last=None,
                     selects=None):  # fmt: skip
    """Per level 1..levels, the draft's outputs (R, T, H) at every pair slot (module docstring).

    With `last` (R, T) bool, only what the last level's rows `last` depend on is computed: the
    last level at those rows, returned as (outputs, valid) (level_forward), and level m < levels
    at their ancestors, the pairs `levels - m` earlier, returned (R, T, H) with zeros elsewhere
    (keys and values are computed everywhere; no needed row attends to the rest). `selects`: the
    levels' `compacted` selections, planned ahead (StepPlan), in place of `last`."""
    tokens, positions = batch.tokens, batch.positions
    hidden = level_inputs(draft, batch)
    if noise > 0:
        hidden = hidden + (torch.rand_like(hidden) * 2 - 1) * noise
    if selects is None and last is not None:
        selects = [compacted(s) for s in level_selects(last, levels)]
    outs: list = []
    past = None
    for level in range(1, levels + 1):
        if level > 1:  # pair j reads its parent's output, at pair j-1 (pair 0 reads a placeholder: never counted)
            prev = outs[-1].detach() if detach else outs[-1]
            hidden = torch.cat([hidden[:, :1], prev[:, :-1].to(hidden.dtype)], dim=1)
        mask = level_mask(batch.seg, level)
        select = None if selects is None else selects[level - 1]
        out, valid, past = level_forward(draft, tokens, hidden, positions, mask, past, select)
        if select is not None and level < levels:  # back to pair slots, for the next level's inputs
            full = torch.zeros(*tokens.shape, out.shape[-1], dtype=out.dtype, device=out.device)
            out = full.scatter(1, select[0][..., None].expand(-1, -1, out.shape[-1]), out * valid[..., None])
        outs.append((out, valid) if select is not None and level == levels else out)
    return outs


def root_ok(seg: torch.Tensor, level: int) -> torch.Tensor:
    """(R, T) bool: the pair's level-`level` chain starts inside its own window."""
    if level == 1:
        return seg >= 0
    shifted = torch.full_like(seg, -2)
    shifted[:, level - 1 :] = seg[:, : -(level - 1)]
    return (seg >= 0) & (shifted == seg)


def soft_ce(draft, h: torch.Tensor, slots: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean soft cross-entropy of the draft's head at outputs h (n, H) to the teacher's
    probabilities p (n, K) on draft slots `slots` (n, K), OTHER left out of the normaliser;
    and the logits (n, slots), for the agreement. As lse(z) - sum_k p_k z_k (sum_k p_k = 1): no
    (n, slots) log-softmax is materialised, in either direction."""
    z = draft.lm_head(draft.norm(h)) if isinstance(draft, FusedDraft) else draft.lm.lm_head(h)
    lse = torch.logsumexp(z[:, OTHER + 1 :], dim=-1).float()  # slot 0 is OTHER, never proposed
    picked = z.gather(1, slots).float()
    return (lse - (p * picked).sum(-1)).mean(), z


@dataclasses.dataclass
class LevelPlan:
    """One level's selections: `select` ((index, valid), `compacted`) where its outputs are computed;
    `rows` (n,): the flat (R * T) pair slots of its loss rows, and `outs` (n,): the same rows in
    its flattened output ((R * S) for the last level, whose outputs are compacted; (R * T) before);
    `ce` (m,): the positions among the n rows where the CE is taken (None: all of them)."""

    select: tuple[torch.Tensor, torch.Tensor]
    rows: torch.Tensor
    outs: torch.Tensor
    ce: torch.Tensor | None

    def to_all(self, fn) -> LevelPlan:
        """`fn` applied to each tensor (a move to the device, pinning)."""
        move = lambda t: None if t is None else fn(t)  # noqa: E731
        return LevelPlan((move(self.select[0]), move(self.select[1])), move(self.rows), move(self.outs), move(self.ce))


@dataclasses.dataclass
class StepPlan:
    """Every data-dependent choice of a step (which rows the loss takes, where each level's outputs
    are computed, the CE's random share), decided on the host before the batch moves, so that on a
    GPU the step's forward and backward never wait for the device's values (each such read drains
    the queue of launched kernels; tests/test_packed_training.py counts none)."""

    levels: list[LevelPlan]

    def to_all(self, fn) -> StepPlan:
        return StepPlan([level.to_all(fn) for level in self.levels])


def plan_step(batch: PackedBatch, cfg: PackedTrainConfig, fused: bool, generator=None) -> StepPlan:
    """The step's plan (StepPlan) from `batch`'s masks, on their device: the host's before the
    batch moves. The CE's share is drawn from `generator` (None: torch's default)."""
    counted, seg = batch.counted, batch.seg
    share = None
    if cfg.ce_share < 1:
        share = torch.rand(counted.shape, generator=generator, device=counted.device) < cfg.ce_share
    last = counted & root_ok(seg, cfg.levels)
    if fused and share is not None:  # the fused kind's only loss is the CE: its outputs are needed there only
        last &= share
    plans = []
    for level, select in enumerate(level_selects(last, cfg.levels), 1):
        index, valid = compacted(select)
        if level < cfg.levels:  # levels before the last are computed at the last one's ancestors only
            rows = (select & counted & root_ok(seg, level)).flatten().nonzero()[:, 0]
            outs = rows
        else:
            rows, outs = last.flatten().nonzero()[:, 0], valid.flatten().nonzero()[:, 0]
        ce = None if share is None or fused else share.flatten()[rows].nonzero()[:, 0]  # feature kind: CE on the share
        plans.append(LevelPlan((index, valid), rows, outs, ce))
    return StepPlan(plans)


def packed_loss(draft, batch: PackedBatch, cfg: PackedTrainConfig, *, parts: bool = True) -> tuple[torch.Tensor, dict]:
    """The step's loss (module docstring) over `batch.plan` (planned here when the batch has none);
    with `parts`, its terms and per-level agreement with the teacher's argmax (for the log: read
    from the device, on logging steps only)."""
    fused = isinstance(draft, FusedDraft)
    plan = batch.plan if batch.plan is not None else plan_step(batch, cfg, fused)
    outs = unrolled_outputs(draft, batch, cfg.levels, noise=cfg.noise, selects=[p.select for p in plan.levels])
    flat = lambda t: t.flatten(0, 1)  # noqa: E731  (R, T, ...) -> (R * T, ...)
    total, weights, info = 0.0, 0.0, {}
    for level, (out, at) in enumerate(zip(outs, plan.levels, strict=True), 1):
        if at.rows.numel() == 0:  # a shape: known on the host
            continue
        h = flat(out[0] if isinstance(out, tuple) else out).index_select(0, at.outs)
        rows = at.rows if at.ce is None else at.rows.index_select(0, at.ce)
        hc = h if at.ce is None else h.index_select(0, at.ce)
        term = 0.0
        if hc.shape[0]:
            slots, p = flat(batch.teacher_slots).index_select(0, rows), flat(batch.teacher_p).index_select(0, rows)
            ce, z = soft_ce(draft, hc, slots, p)
            term = ce if fused else cfg.ce_weight * ce
            if parts:
                info[f"ce{level}"] = float(ce.detach())
                best = z.detach()[:, OTHER + 1 :].argmax(-1) + OTHER + 1
                info[f"agree{level}"] = float((best == slots[:, 0]).float().mean())
        if not fused and cfg.regression_weight > 0:
            goal = flat(batch.goal).index_select(0, at.rows)
            reg = F.smooth_l1_loss(h.float(), goal.float(), reduction="none").mean(-1).mean()
            term = term + cfg.regression_weight * reg
            if parts:
                info[f"reg{level}"] = float(reg.detach())
        weight = cfg.level_decay ** (level - 1)
        total, weights = total + weight * term, weights + weight
    return total / max(weights, 1e-9), info


@torch.no_grad()
def packed_agreement(draft, data: PackedAnswers, rows: np.ndarray, target_head, *, depths: int = 4) -> list[float]:
    """Top-1 agreement of the draft's best real token with the target's greedy token (argmax of
    its float32 head over the whole vocabulary at the stored next feature) at tree depth 1..`depths`,
    given accepted ancestors; over every answer pair of `rows`, as training/feature/train.py measures it."""
    hits, total = np.zeros(depths), np.zeros(depths)
    device = next(draft.parameters()).device
    step = 16
    for start in range(0, len(rows), step):
        batch = data.batch(rows[start : start + step], with_goal=True).to(device)
        greedy = target_head(batch.goal.to(target_head.weight.dtype)).argmax(-1)  # (R, T) target ids
        for level, out in enumerate(unrolled_outputs(draft, batch, depths, detach=False), 1):
            pick = draft.token_map.draft_to_target.to(device)[draft.reduced_logits(out).argmax(-1)]
            ok = batch.answer & root_ok(batch.seg, level)
            hits[level - 1] += float(((pick == greedy) & ok).sum())
            total[level - 1] += float(ok.sum())
    return [float(h / max(t, 1)) for h, t in zip(hits, total, strict=True)]
